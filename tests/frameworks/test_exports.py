"""``Plan.export``: each framework's configuration carries the plan's split, degrees, batch, schedule, recomputation
and precision; what a framework cannot run is exported as its nearest configuration, priced, with a warning; what it
refuses is refused here."""

import dataclasses
import json
import warnings

import pytest

import pipeswift_lab as psl
from pipeswift_lab.core.display import hours
from pipeswift_lab.frameworks import ExportWarning
from pipeswift_lab.frameworks.megatron import expand_layout
from pipeswift_lab.frameworks.torchtitan import read_python


def _flag(args, name):
    return args[args.index(name) + 1]


def _stages_of(plan, config):
    """The plan's split of ``config`` as layer names, per global stage."""
    names = list(plan.checked.costs.table(1)["name"])
    bounds = [tuple(int(x) for x in item.split("-")) for item in plan.price(config).stage_bounds.split()]
    return [names[a:e] for a, e in bounds]


@pytest.mark.parametrize("which", ["uneven", "interleaved", "3d"])
def test_megatron_arguments_carry_the_plan(plans, which):
    plan = plans[which]
    best = plan.best
    if best.fsdp > 1:  # Megatron's data parallelism shards the optimizer state, not the weights, under a pipeline
        with pytest.warns(ExportWarning, match=r"fsdp=2 -> data-parallel ranks \(D=1 -> 2\)"):
            args = plan.export("megatron")
        assert "--use-distributed-optimizer" in args
    else:
        args = plan.export("megatron")
    assert int(_flag(args, "--tensor-model-parallel-size")) == best.tp
    assert int(_flag(args, "--pipeline-model-parallel-size")) == best.P
    assert int(_flag(args, "--micro-batch-size")) == best.microbatch_size
    # Megatron's data-parallel ranks are the replicas times the FSDP shards: the global batch is the plan's
    assert int(_flag(args, "--global-batch-size")) == best.m * best.microbatch_size * best.D * best.fsdp
    layout = expand_layout(_flag(args, "--pipeline-model-parallel-layout"))
    assert len(layout) == best.P * best.v
    letters = {"embed": "E", "head": "L"}
    expected = [
        "".join(letters.get(n, "t" if n.startswith("block") else "") for n in s) for s in _stages_of(plan, best)
    ]
    assert layout == expected
    assert "--bf16" in args and int(_flag(args, "--num-layers")) == 6 and int(_flag(args, "--hidden-size")) == 256


@pytest.mark.parametrize("which", ["uneven", "interleaved", "3d"])
def test_torchtitan_config_carries_the_plan(plans, which):
    plan = plans[which]
    best = plan.best
    found = read_python(plan.export("torchtitan"))
    assert found["pipeline_parallel_degree"] == best.P
    assert (found["data_parallel_replicate_degree"], found["data_parallel_shard_degree"]) == (best.D, best.fsdp)
    assert found["tensor_parallel_degree"] == best.tp
    assert found["local_batch_size"] == best.m * best.microbatch_size
    assert found["pipeline_parallel_microbatch_size"] == best.microbatch_size
    assert found["pipeline_parallel_schedule"] == best.schedule
    assert found["flavor"] == "debugmodel" and found["activation_checkpoint"] == "none"
    renamed = {"embed": ["tok_embeddings"], "head": ["norm", "lm_head"]}
    expected = [
        [f for n in s for f in renamed.get(n, [f"layers.{n.removeprefix('block_')}"])] for s in _stages_of(plan, best)
    ]
    assert found.get("module_fqns_per_model_part", [sum(expected, [])]) == expected


@pytest.mark.parametrize("framework", ["torchtitan", "torchtitan-toml", "megatron", "deepspeed"])
@pytest.mark.parametrize("which", ["uneven", "interleaved", "3d"])
def test_read_of_an_export_prices_as_the_plan(plans, which, framework):
    plan = plans[which]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ExportWarning)
        exported = plan.export(framework)
    nearest = [w.message for w in caught if isinstance(w.message, ExportWarning)]
    mine = psl.frameworks.read(framework, exported, world=plan.best.gpus)
    priced = plan.price(mine)
    expected = nearest[0].nearest if nearest else plan.best  # what the warning priced, else the plan's own
    if nearest:
        assert f"predicted to take {hours(priced.total_s)}" in str(nearest[0])
    assert priced.total_s == pytest.approx(expected.total_s, rel=1e-9)
    assert priced.step_ms == pytest.approx(expected.step_ms, rel=1e-9)
    assert priced.peak_mem_bytes == pytest.approx(expected.peak_mem_bytes, rel=1e-9)
    # which plans a framework runs only as its nearest: Megatron and DeepSpeed shard no weights under a pipeline,
    # DeepSpeed runs one stage a rank
    changed = (which == "3d" and framework in ("megatron", "deepspeed")) or (which, framework) == (
        "interleaved",
        "deepspeed",
    )
    assert bool(nearest) == changed, [str(w) for w in nearest]


def test_deepspeed_exports_its_batch_and_the_split_method_that_gives_the_plan(plans):
    plan = plans["uneven"]
    best = plan.best
    out = plan.export("deepspeed")
    ds, module = out["ds_config"], out["pipeline_module"]
    assert ds["train_micro_batch_size_per_gpu"] == best.microbatch_size
    assert ds["gradient_accumulation_steps"] == best.m
    assert ds["train_batch_size"] == best.m * best.microbatch_size * best.D
    assert ds["bf16"] == {"enabled": True} and module["num_stages"] == best.P
    bounds = [tuple(int(x) for x in s.split("-")) for s in plan.price(best).stage_bounds.split()]
    assert module["planned_parts"] == [a for a, _ in bounds] + [bounds[-1][1]]
    json.dumps(out)  # what path= writes


def test_what_a_framework_cannot_run_is_exported_as_its_nearest_priced(plans, llama_profile):
    plan = psl.plan(
        llama_profile, gpus=8, global_batch=64, steps=100, precision="bf16-mixed", P=[2], schedules=["ZBVZeroBubble"],
        microbatch_sizes=[1], progress=False,
    )  # fmt: skip
    assert plan.best.schedule == "ZBVZeroBubble"
    with pytest.warns(ExportWarning, match=r"ZBVZeroBubble -> Interleaved1F1B \(Megatron-LM core runs 1F1B"):
        args = plan.export("megatron")
    nearest = psl.frameworks.read("megatron", args, world=plan.best.gpus)
    assert nearest.schedule == "Interleaved1F1B" and nearest.v == 2
    with pytest.raises(ValueError, match="megatron cannot run .* ZBVZeroBubble .*; strict=False exports it"):
        plan.export("megatron", strict=True)
    # torchtitan runs it as planned, with attention that is not compiled (split backwards fail on compiled stages)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ExportWarning)
        source = plan.export("torchtitan")
    assert "attn_backend='varlen'" in source


def test_stages_that_recompute_differently_become_one_mode_with_a_warning(plans):
    plan = plans["uneven"]
    split = plan.price(plan.best).stage_bounds  # a recomputing row of the table always names its split
    best = dataclasses.replace(plan.best, recompute="0:full 1:selective", stage_bounds=split)
    with pytest.warns(ExportWarning, match=r"recompute 0:full 1:selective -> full on every stage"):
        args = plan.export("megatron", best)
    assert _flag(args, "--recompute-granularity") == "full"
    with pytest.warns(ExportWarning, match="activation_checkpoint applies to every block"):
        assert "FullAC.Config()" in plan.export("torchtitan", best)


def test_the_frameworks_refusals_are_met_here(plans, tmp_path):
    plan = plans["interleaved"]
    odd = dataclasses.replace(plan.best, m=3)
    with pytest.raises(ValueError, match="Megatron-LM interleaves only with P >= 2 and m a multiple of P"):
        plan.export("megatron", odd)
    uneven = plans["uneven"]
    with pytest.raises(ValueError, match="framework='colossalai' is not one the toolkit exports to"):
        uneven.export("colossalai")
    with pytest.raises(ValueError, match="torchtitan needs seq_len divisible by tp"):
        plans["3d"].export("torchtitan", seq_len=2047)
    bounds = ((0, 1), (1, 2), (2, 3), (3, 4), (4, 6), (6, 8))
    dual = psl.frameworks.ExportTarget(
        P=3, v=2, D=1, fsdp=1, tp=1, m=2, microbatch_size=1, schedule="DualPipeV", bounds=bounds,
        layer_names=tuple(f"block_{i}" for i in range(8)),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"DualPipeV needs gradient_accumulation_steps >= 2 \* num_stages = 6"):
        psl.frameworks.exporter("deepspeed").write(dual)
    path = tmp_path / "job.py"
    assert uneven.export("torchtitan", path=path) == path.read_text()


def test_a_model_a_framework_cannot_name_is_refused_naming_the_first_layer(llama_profile):
    df = llama_profile.df.copy()
    df.loc[3, "name"] = "vision_tower"
    prof = psl.Profile(df, llama_profile.meta)
    plan = psl.plan(
        prof, gpus=2, global_batch=8, steps=10, P=[2], schedules=["1F1B"], microbatch_sizes=[1], progress=False
    )
    with pytest.raises(ValueError, match="layer 'vision_tower' is no part of a decoder"):
        plan.export("megatron")
    gpt = dataclasses.replace(
        psl.TransformerSpec(layers=6, hidden=256, heads=16, seq_len=2048, vocab=2048), name="gpt2"
    )
    plain = psl.plan(
        llama_profile, gpus=2, global_batch=8, steps=10, P=[2], schedules=["1F1B"], microbatch_sizes=[1], progress=False
    )
    with pytest.raises(ValueError, match="torchtitan has no model for model_type 'gpt2'"):
        plain.export("torchtitan", model_config=gpt)


def test_a_profiled_hugging_face_model_is_exported_by_the_config_its_profile_recorded(one_torch_thread):
    import torch
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    prof = psl.profile(
        transformers.Qwen3ForCausalLM(config), torch.randint(0, 512, (2, 16)), layers="auto", progress=False
    )
    assert prof.meta["model_config"]["model_type"] == "qwen3" and prof.meta["model_config"]["num_hidden_layers"] == 4
    plan = psl.plan(prof, gpus=2, global_batch=8, steps=10, P=[2], schedules=["1F1B"], progress=False)
    found = read_python(plan.export("torchtitan"))
    assert found["flavor"] in psl.frameworks.torchtitan.FLAVORS["qwen3"]
    fqns = found["module_fqns_per_model_part"]
    assert fqns[0][0] == "tok_embeddings" and fqns[-1][-2:] == ["norm", "lm_head"]
    assert sum(len([f for f in s if f.startswith("layers.")]) for s in fqns) == 4
    args = plan.export("megatron")
    assert "--qk-layernorm" in args and _flag(args, "--kv-channels") == "32" and _flag(args, "--seq-length") == "16"
    mine = psl.frameworks.read("megatron", args, world=plan.best.gpus)
    assert plan.price(mine).total_s == pytest.approx(plan.best.total_s, rel=1e-9)
