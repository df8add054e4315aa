"""The tensor-parallel columns of a profile: worked out by hand for the reference GPT, and checked against real tensor
parallelism (torch's DTensor styles, ``parallelize_module``): each unit's local saved bytes and the bytes its
collectives move, in this process with torch's fake process group (the tensors are the real local shards; only the
communication is skipped), and once in two gloo processes.

The styles run as the issue's runner runs them (transformers' mapping to torch): ``colwise`` is ``ColwiseParallel()``,
``colwise_gather_output`` ``ColwiseParallel(output_layouts=Replicate())``, ``rowwise`` ``RowwiseParallel()``,
``rowwise_split_input`` and ``embedding_rowwise`` ``RowwiseParallel(input_layouts=Replicate())``.
"""

import contextlib
import copy
import json
import multiprocessing
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tiny_transformers import SMALL, VOCAB

import pipeswift_lab as psl
from pipeswift_lab.core.fake_device import _as_traced
from pipeswift_lab.core.tp_plan import model_tp_plan, tp_targets
from pipeswift_lab.profiling.measure import profile
from pipeswift_lab.profiling.table import TP_COLUMNS, Profile
from pipeswift_lab.profiling.tp_dataflow import trace_tp_dataflow

B, T, D, HEADS = 2, 16, 32, 4
FP32 = 4
#: Llama-style configs whose key/value heads stay more than one per rank at tp = 2 (with one, a traced graph's
#: repeated keys and values are views of the rank's one head, and save less than a shard of the whole).
LLAMA_TP2 = dict(SMALL, num_attention_heads=8, num_key_value_heads=4)


def gpt(n_layers=2):
    return psl.models.gpt(vocab_size=VOCAB, seq_len=T, d_model=D, n_layers=n_layers, n_heads=HEADS)


def tokens():
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(0))


def quick(model, *args, **kwargs):
    return profile(model, *args, warmup=0, repeats=1, progress=False, **kwargs)


def hf(family, **overrides):
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**{**LLAMA_TP2, "use_cache": False, **overrides})
    return getattr(transformers, f"{family}ForCausalLM")(config)


def hf_units(model):
    inner = model.model
    return [
        ("model.embed_tokens", inner.embed_tokens),
        *[(f"model.layers.{i}", layer) for i, layer in enumerate(inner.layers)],
        ("model.norm", inner.norm),
        ("lm_head", model.lm_head),
    ]


# -- the reference GPT, by hand ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt_profile():
    return quick(gpt(), tokens())


def test_the_reference_gpt_gets_the_plan_and_the_sizes_tp_divides(gpt_profile):
    assert gpt_profile.meta["tp_plan"] == gpt().tp_plan
    # qkv's 3d outputs, proj's d inputs, the MLP's 4d, the vocabulary of the embedding and the head
    assert gpt_profile.meta["tp_divides"] == sorted({3 * D, D, 4 * D, VOCAB})
    assert list(gpt_profile.df.columns[-len(TP_COLUMNS) :]) == list(TP_COLUMNS)


def test_the_reference_gpt_columns_are_its_plan_worked_out_by_hand(gpt_profile):
    df = gpt_profile.df.set_index("name")
    tokens_d = B * T * D * FP32  # one hidden state
    # the token embedding's table; qkv and mlp.0 with their biases (colwise), proj and mlp.2 without (rowwise); the head
    assert df.loc["embed", "tp_param_bytes"] == VOCAB * D * FP32
    block = (3 * D * D + 3 * D) + D * D + (4 * D * D + 4 * D) + 4 * D * D
    assert df.loc["block_0", "tp_param_bytes"] == block * FP32
    assert df.loc["head", "tp_param_bytes"] == VOCAB * D * FP32
    # forward: the embedding's lookups all-reduced; qkv's output gathered, proj's and mlp.2's all-reduced; the logits
    assert df.loc["embed", "tp_forward_bytes"] == tokens_d
    assert df.loc["block_0", "tp_forward_bytes"] == 3 * tokens_d + tokens_d + tokens_d
    assert df.loc["head", "tp_forward_bytes"] == B * T * VOCAB * FP32
    # backward: the input gradients of qkv and mlp.0 all-reduced, proj's split input's all-gathered; the head's input
    assert list(df["tp_backward_bytes"]) == [0, 3 * tokens_d, 3 * tokens_d, tokens_d]
    # saved shards: proj's slice of its input, the MLP's hidden state before and after the GELU (attention runs on
    # the gathered qkv: whole heads on every rank)
    assert df.loc["block_0", "tp_activation_bytes"] == tokens_d + 2 * 4 * tokens_d
    assert (df["tp_activation_bytes"] <= df["activation_bytes"]).all()
    # compute: every matrix product but attention's is sharded
    linears = 2 * B * T * D * (3 * D + D + 4 * D + 4 * D)
    attention = 2 * 2 * B * HEADS * T * T * (D // HEADS)
    assert df.loc["block_0", "tp_flop_fraction"] == pytest.approx(linears / (linears + attention))
    assert list(df["tp_flop_fraction"][["embed", "head"]]) == [0.0, 1.0]


def test_a_meta_model_profiled_unit_by_unit_gets_the_same_columns(gpt_profile):
    with torch.device("meta"):
        meta = gpt()
    prof = quick(meta, tokens())
    assert prof.meta["unit_by_unit"] and prof.meta["tp_divides"] == gpt_profile.meta["tp_divides"]
    assert prof.df[list(TP_COLUMNS)].equals(gpt_profile.df[list(TP_COLUMNS)])


def test_bf16_mixed_halves_what_the_forward_communicates(gpt_profile):
    prof = quick(gpt(), tokens(), precision="bf16-mixed")
    assert list(prof.df["tp_forward_bytes"][1:]) == [b / 2 for b in gpt_profile.df["tp_forward_bytes"][1:]]


def test_the_columns_and_the_plan_survive_csv(gpt_profile, tmp_path):
    gpt_profile.to_csv(tmp_path / "p.csv")
    back = Profile.read_csv(tmp_path / "p.csv")
    assert back.meta["tp_plan"] == gpt_profile.meta["tp_plan"]
    assert back.df[list(TP_COLUMNS)].equals(gpt_profile.df[list(TP_COLUMNS)])


def test_a_synthetic_profile_refuses_a_flop_fraction_outside_0_1():
    with pytest.raises(ValueError, match="tp_flop_fraction.*between 0 and 1"):
        Profile.synthetic([1.0, 1.0], [2.0, 2.0], tp_flop_fraction=[0.5, 1.5])
    with pytest.raises(ValueError, match="tp_param_bytes"):
        Profile.synthetic([1.0], [2.0], tp_param_bytes=[-1])


# -- which models get them -------------------------------------------------------------------------------------------
def test_a_model_without_a_plan_and_an_empty_plan_get_none():
    plain = quick(psl.models.mlp(), torch.randn(4, 64))
    assert not set(TP_COLUMNS) & set(plain.df.columns)
    assert not {"tp_plan", "tp_divides", "tp_plan_error"} & set(plain.meta)
    empty = quick(gpt(n_layers=1), tokens(), tp_plan={})
    assert not set(TP_COLUMNS) & set(empty.df.columns) and "tp_plan" not in empty.meta


def test_a_given_plan_replaces_the_model_s():
    prof = quick(gpt(n_layers=1), tokens(), tp_plan={"block_*.mlp.0": "colwise", "block_*.mlp.2": "rowwise"})
    df = prof.df.set_index("name")
    assert prof.meta["tp_plan"] == {"block_*.mlp.0": "colwise", "block_*.mlp.2": "rowwise"}
    assert list(df["tp_param_bytes"]) == [0, (4 * D * D + 4 * D + 4 * D * D) * FP32, 0]
    assert list(df["tp_forward_bytes"]) == [0, B * T * D * FP32, 0]


def test_a_model_whose_own_plan_does_not_fit_is_profiled_without_the_columns():
    model = psl.models.mlp()
    model.tp_plan = {"layer_*.0": "colwise", "layer_*.1": "rowwise"}  # the ReLUs
    prof = quick(model, torch.randn(4, 64))
    assert not set(TP_COLUMNS) & set(prof.df.columns)
    assert "applies to Linear" in prof.meta["tp_plan_error"]


def test_a_model_s_own_plan_may_name_modules_it_lacks():
    """A model's own plan is Hugging Face's for the family: a mixture of experts' names a dense MLP its layers lack."""
    model = gpt(n_layers=1)
    model.tp_plan = {**model.tp_plan, "block_*.moe.gate": "colwise"}
    prof = quick(model, tokens())
    assert prof.df["tp_param_bytes"].sum() > 0 and "tp_plan_error" not in prof.meta


@pytest.mark.parametrize(
    "plan,error,match",
    [
        ({"block_*.mlp.0": "diagonal"}, ValueError, "styles .* not known"),
        ({"blocks.*.mlp.0": "colwise"}, ValueError, "matches no module"),
        ({"block_*.ln_attn": "colwise"}, ValueError, "applies to Linear"),
        ([("block_*.mlp.0", "colwise")], TypeError, "dict of"),
    ],
)
def test_a_bad_plan_is_refused_before_anything_runs(plan, error, match):
    model = gpt(n_layers=1)
    ran = []
    model.register_forward_pre_hook(lambda module, args: ran.append(1))
    with pytest.raises(error, match=match):
        quick(model, tokens(), tp_plan=plan)
    assert ran == []


# -- Hugging Face families -------------------------------------------------------------------------------------------
def test_qwen3s_head_norms_are_replicated_and_compute_on_the_sharded_heads():
    model = hf("Qwen3", head_dim=4, num_hidden_layers=2)  # the first block is checked: two make the blocks repeated
    prof = quick(model, tokens(), layers="auto")
    df = prof.df.set_index("name")
    layer = model.model.layers[0]
    replicated = sum(
        p.numel() * FP32
        for m in (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.q_norm, layer.self_attn.k_norm)
        for p in m.parameters()
    )
    assert df.loc["model.layers.0", "param_bytes"] - df.loc["model.layers.0", "tp_param_bytes"] == replicated
    assert df.loc["model.layers.0", "tp_flop_fraction"] == 1.0  # projections and attention, all on the rank's heads
    assert prof.meta["tp_divides"][0] == 4  # the key/value heads: the smallest size tp must divide


def test_mixtral_shards_its_attention_and_replicates_its_experts():
    model = hf("Mixtral", num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2)  # the first block is checked
    prof = quick(model, tokens(), layers="auto")
    row = prof.df.set_index("name").loc["model.layers.0"]
    attention = model.model.layers[0].self_attn
    assert row["tp_param_bytes"] == sum(p.numel() * FP32 for p in attention.parameters())
    assert 0.0 < row["tp_flop_fraction"] < 0.5  # the experts' products, more than attention's, stay whole
    assert row["tp_forward_bytes"] == B * T * SMALL["hidden_size"] * FP32  # o_proj alone
    assert 0 < row["tp_activation_bytes"] < row["activation_bytes"] / 2


# -- against real tensor parallelism ---------------------------------------------------------------------------------
def parallelized(model, targets, tp):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {
        "colwise": ColwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise": RowwiseParallel,
        "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
    }
    plan = {name: styles[style]() for name, style in targets.items() if style in styles}
    return parallelize_module(model, init_device_mesh("cpu", (tp,)), plan)


def measured_tp(model, targets, units, sample, tp, traced=False):
    """``{"saved": [local bytes each unit saves], "forward": [bytes each unit's collectives move], "backward": bytes
    the backward's collectives move}`` of ``model`` parallelized over the ``tp`` ranks of the current process group: a
    collective's bytes are its whole tensor's (an all-gather's output, an all-reduce's input)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    def local(t):
        t = t._local_tensor if isinstance(t, DTensor) else t
        return t.trigger_wait() if hasattr(t, "trigger_wait") else t  # an all-reduce's output, waited for

    class Collectives(TorchDispatchMode):
        moved = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            if name in ("_c10d_functional::all_reduce", "_c10d_functional::all_gather_into_tensor"):
                self.moved += args[0].numel() * args[0].element_size() * (tp if "gather" in name else 1)
            return func(*args, **(kwargs or {}))

    parallelized(model, targets, tp)
    state = {local(t).untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    comm, stack, kept = Collectives(), [], []
    saved, forward = [{} for _ in units], [0] * len(units)

    def pack(t):
        storage = local(t).untyped_storage()
        if stack and storage.data_ptr() not in state:
            saved[stack[-1]].setdefault(storage.data_ptr(), storage.nbytes())
        kept.append(t)
        return t

    def enter(module, args, index):
        stack.append(index)
        forward[index] -= comm.moved

    def leave(module, args, output, index):
        stack.pop()
        forward[index] += comm.moved

    handles = []
    for index, (_, module) in enumerate(units):
        handles.append(module.register_forward_pre_hook(lambda m, a, i=index: enter(m, a, i)))
        handles.append(module.register_forward_hook(lambda m, a, o, i=index: leave(m, a, o, i)))
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        comm,
        _as_traced() if traced else contextlib.nullcontext(),
    ):
        output = model(*sample)
    for handle in handles:
        handle.remove()
    before = comm.moved
    with comm:
        (output if isinstance(output, torch.Tensor) else output.logits).sum().backward()
    return {"saved": [sum(s.values()) for s in saved], "forward": forward, "backward": comm.moved - before}


def predicted_tp(model, units, sample, tp):
    """What the dataflow pass predicts for the same measures: a unit's local saved bytes are its replicated ones plus a
    ``tp``-th of its sharded ones."""
    targets = tp_targets(model, model_tp_plan(model))
    flows = trace_tp_dataflow(model, units, targets, (sample, {}), device=torch.device("cpu"))
    return targets, {
        "saved": [f.saved_bytes - f.sharded_saved_bytes + f.sharded_saved_bytes // tp for f in flows],
        "forward": [f.forward_bytes for f in flows],
        "backward": sum(f.backward_bytes for f in flows),
    }


@pytest.fixture
def fake_group():
    """A process group of two ranks in this process (torch's fake backend: tensors are real, collectives skipped)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield 2
    dist.destroy_process_group()


def test_the_gpt_matches_real_tensor_parallelism_exactly(fake_group, gpt_profile):
    model = gpt()
    targets, predicted = predicted_tp(model, list(model.named_children()), (tokens(),), fake_group)
    real = copy.deepcopy(model)
    measured = measured_tp(real, targets, list(real.named_children()), (tokens(),), fake_group)
    assert measured == predicted
    # what the runner and the planner predict from the profile's columns: its measured blocks, less the shards'
    # tp-1 parts, plus the attention's output, which the projection's split copies while attention keeps it whole
    blocks = gpt_profile.df[gpt_profile.df["name"].str.startswith("block_")]
    sharded = blocks["tp_activation_bytes"]
    from_profile = blocks["activation_bytes"] - sharded + sharded // fake_group + blocks["tp_duplicated_bytes"]
    assert list(from_profile) == measured["saved"][1:-1]
    assert (blocks["tp_duplicated_bytes"] == B * T * D * FP32).all()


@pytest.mark.parametrize("family", ["Llama", "Qwen3"])
def test_hugging_face_layers_match_real_tensor_parallelism(fake_group, family):
    """Per unit, the local saved bytes (of the graph torch.export takes, which the profile's ``activation_bytes``
    measures for a Hugging Face model: its causal mask explicit, keys and values repeated) and the forward's
    collectives are exact. torch's styles all-reduce the input gradient of every colwise module apart: q, k and v, and
    gate and up, each their own, where the column counts each shared input once (Megatron's fused count)."""
    model = hf(family, **({"head_dim": 4} if family == "Qwen3" else {}))
    targets, predicted = predicted_tp(model, hf_units(model), (tokens(),), fake_group)
    real = copy.deepcopy(model)
    measured = measured_tp(real, targets, hf_units(real), (tokens(),), fake_group, traced=True)
    assert measured["saved"] == predicted["saved"]
    assert measured["forward"] == predicted["forward"]
    hidden = B * T * SMALL["hidden_size"] * FP32
    assert measured["backward"] == predicted["backward"] + (2 + 1) * hidden * SMALL["num_hidden_layers"]


def _gloo_rank(rank, folder):
    """One of two gloo ranks: the reference GPT's one block under real tensor parallelism, measured."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    try:
        model = gpt(n_layers=1)
        measured = measured_tp(model, tp_targets(model, model.tp_plan), list(model.named_children()), (tokens(),), 2)
        (Path(folder) / f"rank{rank}.json").write_text(json.dumps(measured))
    finally:
        dist.destroy_process_group()


@pytest.mark.processes
def test_a_gpt_block_matches_two_gloo_ranks(tmp_path):
    model = gpt(n_layers=1)
    _, predicted = predicted_tp(model, list(model.named_children()), (tokens(),), 2)
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_gloo_rank, args=(rank, str(tmp_path))) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=180)
        if process.is_alive():
            process.kill()
    # what each rank wrote is the check: a gloo rank may abort at exit after its work (docs/development.md's traps)
    measured = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert measured[0] == measured[1] == predicted
