"""``psl.frameworks.read``: a user's own configuration read into the fields a plan prices, the frameworks' own
splits when it names none, and what is inconsistent refused with the reason."""

import json

import pytest

import pipeswift_lab as psl
from pipeswift_lab.frameworks import read
from pipeswift_lab.frameworks.deepspeed import partition_balanced, partition_uniform
from pipeswift_lab.frameworks.megatron import expand_layout
from pipeswift_lab.frameworks.names import bounds_of_stages, decoder_parts

USER_TORCHTITAN = """
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer


def llama3_debug_pp() -> Trainer.Config:
    return Trainer.Config(
        model_spec=model_registry("debugmodel"),
        training=TrainingConfig(local_batch_size=16, seq_len=2048, steps=100, disable_cuda_graphs=True),
        parallelism=ParallelismConfig(
            pipeline_parallel_degree=2,
            data_parallel_shard_degree=2,
            pipeline_parallel_schedule="1F1B",
            pipeline_parallel_microbatch_size=2,
        ),
        activation_checkpoint=FullAC.Config(),
    )
"""

HF_LLAMA = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(6)), "model.rotary_emb", "model.norm", "lm_head"]


def test_a_users_torchtitan_config_is_read_without_running_it_and_split_as_torchtitan_splits(plans):
    mine = read("torchtitan", USER_TORCHTITAN)
    assert (mine.P, mine.D, mine.fsdp, mine.tp, mine.v) == (2, 1, 2, 1, 1)
    assert (mine.m, mine.microbatch_size, mine.schedule, mine.seq_len) == (8, 2, "1F1B", 2048)
    assert mine.recompute == "0:full 1:full" and mine.stage_modules == ()
    # no module_fqns_per_model_part: torchtitan's own split, the embedding and the output weighed as a layer each
    stages = psl.frameworks.even_stage_modules(mine, ["embed", *(f"block_{i}" for i in range(6)), "head"])
    assert stages == (
        ("tok_embeddings", "layers.0", "layers.1", "layers.2"),
        ("layers.3", "layers.4", "layers.5", "norm", "lm_head"),
    )
    priced = plans["uneven"].price(mine)
    assert priced.stage_bounds == "0-4 4-8" and priced.recompute == "0:full 1:full"


def test_compare_puts_a_users_config_beside_the_best(plans):
    plan = plans["uneven"]
    mine = read("torchtitan", USER_TORCHTITAN)
    table = plan.compare(mine)
    assert list(table.index) == ["plan's best", "yours", "yours - best"]
    yours, best = table.loc["yours"], table.loc["plan's best"]
    assert yours["label"] == mine.label and best["label"] == plan.best.label
    assert best["total_s"] == pytest.approx(plan.best.total_s)
    assert table.loc["yours - best", "total_s"] == pytest.approx(yours["total_s"] - best["total_s"])
    # the same samples: 32 a step (16 on each of 2 FSDP ranks) against the plan's 64 trains twice the steps
    assert (yours["global_batch"], yours["steps"]) == (32, 200)
    assert yours["peak_mem_bytes"] > 0 and bool(yours["fits"]) and yours["gpus"] == 4


def test_megatron_arguments_are_read_with_their_world(plans):
    args = "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 64"
    with pytest.raises(ValueError, match="pass world="):
        read("megatron", args)
    mine = read("megatron", "torchrun --nproc-per-node 8 pretrain_gpt.py " + args + " --num-layers 6")
    assert (mine.P, mine.D, mine.m, mine.v, mine.schedule) == (2, 4, 16, 1, "1F1B")
    stages = psl.frameworks.even_stage_modules(mine, ["embed", *(f"block_{i}" for i in range(6)), "head"])
    assert ["".join(s) for s in stages] == ["Ettt", "tttL"]
    with pytest.raises(ValueError, match=r"world=6 is not divisible by tensor x pipeline = 1 x 4"):
        read("megatron", args.replace("size 2", "size 4"), world=6)
    with pytest.raises(
        ValueError, match=r"--global-batch-size 64 is not divisible by --micro-batch-size 1 x data-parallel size 3"
    ):
        read("megatron", args, world=6)
    with pytest.raises(ValueError, match=r"holds 7 transformer layers \(t\) but --num-layers is 6"):
        read("megatron", args + " --num-layers 6 --pipeline-model-parallel-layout Ettt|ttttL", world=8)
    with pytest.raises(ValueError, match="interleaving needs m a multiple of P"):
        read("megatron", args.replace("64", "6") + " --pipeline-model-parallel-layout Ett|t|tt|tL", world=4)
    interleaved = read("megatron", args + " --pipeline-model-parallel-layout Ett|t|tt|tL", world=8)
    assert (interleaved.v, interleaved.schedule, interleaved.m) == (2, "Interleaved1F1B", 16)
    assert interleaved.stage_modules == (("E", "t", "t"), ("t",), ("t", "t"), ("t", "L"))
    assert expand_layout("E(tt|)*2ttL") == ["Ett", "tt", "ttL"] and expand_layout("Et*3|t*2L") == ["Ettt", "ttL"]


def test_deepspeed_configs_are_read_as_deepspeed_checks_them(tmp_path):
    ds = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8}
    bare = read("deepspeed", ds)
    assert (bare.P, bare.D, bare.m) == (1, 4, 8)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"ds_config": ds, "pipeline_module": {"num_stages": 2}}))
    staged = read("deepspeed", str(path))
    assert (staged.P, staged.D, staged.m, staged.schedule) == (2, 4, 8, "1F1B")
    with pytest.raises(
        ValueError, match=r"train_batch_size 64 != .* x gradient_accumulation_steps 8 x data-parallel size 2"
    ):
        read("deepspeed", {"ds_config": ds, "pipeline_module": {"num_stages": 2}}, world=4)
    with pytest.raises(ValueError, match="ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"):
        read(
            "deepspeed", {"ds_config": {**ds, "zero_optimization": {"stage": 3}}, "pipeline_module": {"num_stages": 2}}
        )
    few = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8}
    with pytest.raises(ValueError, match=r"DualPipeV needs gradient_accumulation_steps >= 2 \* 8, got 8"):
        read("deepspeed", {"ds_config": few, "pipeline_module": {"num_stages": 8, "class": "DualPipeVModule"}}, world=8)
    with pytest.raises(ValueError, match="not JSON"):
        read("deepspeed", "{nope")


def test_a_torchtitan_config_torchtitan_refuses_is_refused():
    with pytest.raises(ValueError, match="refuses pipeline parallelism with CUDA graphs"):
        read("torchtitan", USER_TORCHTITAN.replace(", disable_cuda_graphs=True", ""))
    compiled = USER_TORCHTITAN.replace('"1F1B"', '"ZBVZeroBubble"').replace(
        "activation_checkpoint=FullAC.Config(),", "activation_checkpoint=None, compile=CompileConfig(enable=True),"
    )
    with pytest.raises(ValueError, match="fails on compiled stages"):
        read("torchtitan", compiled)
    with pytest.raises(ValueError, match=r"dp_replicate\(1\) \* dp_shard\(3\) .* != WORLD_SIZE"):
        read("torchtitan", "[parallelism]\npipeline_parallel_degree = 2\ndata_parallel_shard_degree = 3\n", world=8)
    with pytest.raises(ValueError, match="is not Python"):
        read("torchtitan", "def broken(:\n")


def test_layers_are_read_as_decoder_parts_and_stage_lists_map_back_to_them():
    parts = decoder_parts(HF_LLAMA)
    assert [p.kind for p in parts] == ["embed", *["block"] * 6, "free", "norm", "head"]
    gpt2 = decoder_parts(
        ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.ln_f", "lm_head"]
    )
    assert [p.kind for p in gpt2] == ["embed", "positions", "block", "block", "norm", "head"]
    with pytest.raises(ValueError, match="numbered"):
        decoder_parts(["model.layers.1", "model.layers.0"])
    fqns = [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.2", "layers.3"],
        ["layers.4", "layers.5", "norm", "lm_head"],
    ]
    assert bounds_of_stages("torchtitan", HF_LLAMA, fqns) == "0-3 3-5 5-10"
    assert bounds_of_stages("megatron", HF_LLAMA, [list("Ett"), list("tt"), list("ttL")]) == "0-3 3-5 5-10"
    with pytest.raises(ValueError, match="layer 'model.layers.5' \\(layers.5\\) is in no stage"):
        bounds_of_stages(
            "torchtitan",
            HF_LLAMA,
            [["tok_embeddings", "layers.0", "layers.1"], ["layers.2", "layers.3", "layers.4", "norm", "lm_head"]],
        )
    with pytest.raises(ValueError, match="do not hold consecutive layers"):
        bounds_of_stages(
            "torchtitan",
            HF_LLAMA,
            [
                ["tok_embeddings", "layers.0", "layers.2"],
                ["layers.1", "layers.3", "layers.4", "layers.5", "norm", "lm_head"],
            ],
        )


def test_deepspeeds_own_partitions():
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(3, 4) == [0, 1, 2, 3, 3]
    assert partition_balanced([1, 1, 1, 1, 4], 2) == [0, 4, 5]


def test_torchtitans_defaults_and_sections_are_read_as_torchtitan_reads_them(plans):
    shard_fills = USER_TORCHTITAN.replace("            data_parallel_shard_degree=2,\n", "")
    with pytest.raises(ValueError, match="data_parallel_shard_degree is -1 .* pass world="):
        read("torchtitan", shard_fills)
    assert read("torchtitan", shard_fills, world=8).fsdp == 4  # the shards fill the world, as torchtitan's -1 does
    # a validation section's batch and a checkpoint's enable=True are not the training's, nor compile's
    other = (
        USER_TORCHTITAN.replace(
            "activation_checkpoint=FullAC.Config(),",
            "activation_checkpoint=FullAC.Config(), validation=ValidationConfig(local_batch_size=1, seq_len=128), "
            "checkpoint=CheckpointManager.Config(enable=True),",
        )
        .replace('"1F1B"', '"zbvzerobubble"')
        .replace("pipeline_parallel_degree=2", "pipeline_parallel_degree=2")
    )
    mine = read("torchtitan", other)
    assert (mine.m, mine.seq_len, mine.schedule, mine.v) == (8, 2048, "ZBVZeroBubble", 2)


def test_a_hand_written_order_goes_to_torchtitan_and_comes_back(llama_profile):
    order = psl.Schedule.of("ZBVZeroBubble", 2, 4, 2)
    plan = psl.plan(
        llama_profile, gpus=2, global_batch=4, steps=10, P=[2], schedules=[order], microbatch_sizes=[1], progress=False
    )
    source = plan.export("torchtitan")
    assert "SCHEDULE_CSV = " in source and "pipeline_parallel_schedule_csv=path" in source
    mine = read("torchtitan", source)
    assert mine.schedule == order and plan.price(mine).total_s == pytest.approx(plan.best.total_s, rel=1e-9)


def test_arguments_and_configs_a_framework_would_not_parse_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="the Megatron-LM arguments do not parse"):
        read("megatron", "--micro-batch-size $MBS --global-batch-size 64", world=8)
    auto = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8}
    with pytest.raises(ValueError, match="'auto'"):
        read("deepspeed", auto)
    with pytest.raises(ValueError, match="pass world="):
        read("deepspeed", {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 8})


def test_a_hand_written_order_goes_to_torchtitan_toml_beside_it(llama_profile, tmp_path):
    order = psl.Schedule.of("ZBVZeroBubble", 2, 4, 2)
    plan = psl.plan(
        llama_profile, gpus=2, global_batch=4, steps=10, P=[2], schedules=[order], microbatch_sizes=[1], progress=False
    )
    plan.export("torchtitan-toml", path=tmp_path / "job.toml")
    assert (tmp_path / "pipeswift_schedule.csv").read_text() == order.to_csv()
    mine = read("torchtitan", tmp_path / "job.toml")
    assert mine.schedule == order and plan.price(mine).total_s == pytest.approx(plan.best.total_s, rel=1e-9)
