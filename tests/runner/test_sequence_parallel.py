"""Sequence parallelism (``tp=psl.TP(2, sequence_parallel=True)``): Hugging Face families train equal to one process
(SGD, 1e-5) with every process's memory predicted within 10% from the profile's ``sp_activation_bytes``, where the
prediction without sequence parallelism is further off; plans it cannot slice are refused before launch."""

import numpy as np
import pytest
import torch
from model_zoo import build, halves
from test_layouts import LAYOUTS, assert_memory_predicted, layout_spec, sgd, worst
from tiny_transformers import M, lm_loss, single_process, tokens

import pipeswift_lab as psl
from pipeswift_lab.core.sequence_parallel import check_sequence_parallel
from pipeswift_lab.models import GPT_TP_PLAN, gpt
from pipeswift_lab.runner import make_spec

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

#: (family, layout, meta): a pipeline with TP and SP from a checkpoint on meta, and FSDP x TP with SP, no pipeline.
SP_RUNS = [("Llama", "P2xtp2", True), ("Qwen3", "P1xtp2xfsdp2", False)]


def _peaks(spec):
    rows = sorted(spec.meta["memory_predicted"]["rows"], key=lambda r: (r["rank"], r["fsdp"], r["tp"]))
    return np.array([r["predicted_peak_bytes"] for r in rows])


@pytest.mark.processes
@pytest.mark.parametrize(
    ("family", "layout", "meta"), SP_RUNS, ids=[f"{f}-{lay}-{'meta' if m else 'eager'}" for f, lay, m in SP_RUNS]
)
def test_a_family_trains_like_one_process_with_sequence_parallelism(family, layout, meta, tmp_path):
    P, fsdp, tp = LAYOUTS[layout]
    model = build(family)
    model.config.tie_word_embeddings = False
    x, y = tokens()
    prof = psl.profile(model, x[: 8 // (M * fsdp)], layers="auto", progress=False)
    assert prof.meta["sequence_parallel"] is True
    part = psl.partition(prof, P=P)
    kw = dict(fsdp=fsdp, steps=2, optimizer=sgd, progress=False)
    if meta:
        model.save_pretrained(tmp_path / "hf")
        kw["weights"] = tmp_path / "hf"
    run_model = build(family, "meta") if meta else model
    result = psl.run(run_model, (x, y), lm_loss, part, M, tp=psl.TP(tp, sequence_parallel=True), **kw)
    assert result.meta["sequence_parallel"] is True
    assert worst(result.state_dict(), single_process(model, x, y, 2, optimizer=sgd)) <= 1e-5
    assert_memory_predicted(result, P, 1, fsdp, tp)
    # each region's input gradient is reduce-scattered once, as its input was gathered: no all-reduce inside a layer
    collectives = result.tp_collectives.groupby(["phase", "kind"]).size()
    assert collectives[("B", "TP_REDUCE_SCATTER")] == collectives[("F", "TP_REDUCE_SCATTER")] > 0
    if family == "Llama":  # Qwen3 also sums its per-head norms' gradients over the ranks
        assert collectives[("B", "TP_ALL_REDUCE")] == collectives[("F", "TP_ALL_REDUCE")]  # the embedding's, the head's
    # the sliced activations are what the prediction gets right: without them it is further off on some process
    plain = make_spec(run_model, (x, y), lm_loss, part, M, tp=tp, **{k: kw[k] for k in ("fsdp", "steps") if k in kw})
    sliced = make_spec(run_model, (x, y), lm_loss, part, M, tp=psl.TP(tp, sequence_parallel=True), fsdp=fsdp)
    assert (_peaks(sliced) < _peaks(plain)).all()
    measured = result.memory.sort_values(["pp", "fsdp", "tp"])["measured_peak_bytes"].to_numpy()
    assert (abs(_peaks(plain) / measured - 1)).max() > (abs(_peaks(sliced) / measured - 1)).max()


def test_the_profile_counts_the_sequence_slices_between_the_regions():
    x, _ = tokens()
    prof = psl.profile(build("Llama"), x[:2], layers="auto", progress=False)
    layers = prof.df[prof.df["name"].str.startswith("model.layers.")]
    # the norms' inputs and the residual stream are slices, the regions' gathered inputs whole
    assert (layers["tp_activation_bytes"] < layers["sp_activation_bytes"]).all()
    assert (layers["sp_activation_bytes"] < layers["activation_bytes"]).all()
    outside = prof.df[~prof.df["name"].str.startswith("model.layers.")]
    assert (outside["sp_activation_bytes"] == outside["tp_activation_bytes"]).all()


def test_a_plan_that_leaves_parameters_outside_its_regions_cannot_slice_the_sequence():
    gpt_prof = psl.profile(gpt(vocab_size=64, seq_len=8, d_model=32, n_layers=2, n_heads=4), torch.zeros(2, 8).long())
    assert gpt_prof.meta["sequence_parallel"] is False  # its blocks run the attention inline
    assert (gpt_prof.df["sp_activation_bytes"] == gpt_prof.df["tp_activation_bytes"]).all()
    with pytest.raises(ValueError, match=r"'block_0.qkv': .*the layer's own forward would see a slice"):
        check_sequence_parallel(gpt(), GPT_TP_PLAN)
    mixtral = build("Mixtral", "meta")
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp': \"holds parameters outside the plan's"):
        check_sequence_parallel(mixtral, mixtral.tp_plan)


def sp(degree=2, flag=True):
    return lambda: psl.TP(degree, sequence_parallel=flag)


@pytest.mark.parametrize(
    ("model", "tp", "message"),
    [
        ("Mixtral", sp(), r"sequence_parallel=True needs every parameter"),
        ("gpt", sp(), r"'block_0.qkv'.*layer's own forward"),
        ("Llama-odd", sp(), r"a micro-batch of shape \(2, 15\) has no sequence"),
        ("Llama", sp(2.0), r"tp must be an int"),
        ("Llama", lambda: 2.0, r"tp must be an int \(the tensor-parallel degree\) or a psl.TP"),
        ("Llama", sp(flag="yes"), r"sequence_parallel"),
    ],
    ids=["mixture-of-experts", "inline-attention", "odd-sequence", "float-degree", "float-tp", "flag-not-bool"],
)
def test_bad_sequence_parallelism_is_refused_before_launch(model, tp, message):
    with pytest.raises((ValueError, TypeError), match=message):
        if model == "gpt":
            layout_spec(tp=tp())
        else:
            llama = build(model.split("-")[0], "meta")
            x, y = tokens()
            if model.endswith("odd"):
                x, y = x[:, :15], y[:, :15]
            make_spec(llama, (x, y), lm_loss, halves(llama), M, tp=tp())
