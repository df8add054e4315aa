"""A partition's predicted memory per rank: terms, micro-batch scaling, the optimizer, the profile's own bytes."""

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeswift_lab.core.memory_model import MEMORY_TERMS, OptimizerMemory, default_optimizer_memory
from pipeswift_lab.core.peak_forms import StageFields
from pipeswift_lab.models import reference
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.partitioning.layers import Layers, uniform_bounds
from pipeswift_lab.partitioning.rank_memory import RANK_MEMORY_COLUMNS, SplitBytes, stage_bytes
from pipeswift_lab.profiling.measure import profile
from pipeswift_lab.profiling.table import Profile


@pytest.fixture(scope="module")
def gpt():
    setup = reference("gpt", batch_size=2, vocab_size=1024, seq_len=16, d_model=32)
    return profile(setup.model, setup.inputs, target=setup.targets, loss_fn=setup.loss_fn, repeats=1, progress=False)


def test_terms_add_up_and_the_last_rank_holds_the_loss(gpt):
    part = partition(gpt, 2, schedule="1F1B", m=4)
    mem = part.memory()
    assert list(mem.columns) == [*RANK_MEMORY_COLUMNS, *(f"{t}_before_backward_bytes" for t in MEMORY_TERMS)]
    before = mem[[f"{t}_before_backward_bytes" for t in MEMORY_TERMS]]
    assert (before.sum(axis=1) <= mem["predicted_peak_bytes"]).all() and (
        before["transient_before_backward_bytes"] == 0
    ).all()
    terms = mem[["weights_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "buffers_bytes"]]
    assert (terms.sum(axis=1) + mem["transient_bytes"]).tolist() == pytest.approx(mem["predicted_peak_bytes"].tolist())
    assert part.rank_mem_bytes == tuple(mem["predicted_peak_bytes"])
    assert mem["weights_bytes"].tolist() == [sum(part.stage_param_bytes[s] for s in st) for st in mem["stages"]]
    # the last stage keeps, per micro-batch, the logits (2 x 16 x 1024 floats) and the loss's log-softmax as big
    logits = 2 * 16 * 1024 * 4
    assert gpt.meta["loss_activation_bytes"] >= logits and gpt.df["output_bytes"].iloc[-1] == logits


def test_activations_scale_with_the_micro_batch_and_weights_do_not(gpt):
    part = partition(gpt, 2, schedule="GPipe", m=4)
    small, large = part.memory(micro_batch_size=2), part.memory(micro_batch_size=8)
    assert (large["weights_bytes"] == small["weights_bytes"]).all()
    at_first_backward = (small["peak_at"] == "B stage 0 mb 0") & (large["peak_at"] == small["peak_at"])
    assert (
        large.loc[at_first_backward, "activations_bytes"] == 4 * small.loc[at_first_backward, "activations_bytes"]
    ).all()
    assert (large["predicted_peak_bytes"] > small["predicted_peak_bytes"]).all()


def test_the_optimizer_counts(gpt):
    part = partition(gpt, 2, m=2)
    sgd = part.memory(optimizer="sgd")
    adam = part.memory(optimizer="adam")
    assert (sgd["optimizer_bytes"] == 0).all() and (adam["optimizer_bytes"] == 2 * adam["weights_bytes"]).all()
    fused = part.memory(optimizer=OptimizerMemory(states=2.0, name="AdamW (fused)"))
    assert (fused["predicted_peak_bytes"] <= adam["predicted_peak_bytes"]).all()
    with pytest.raises(ValueError, match="optimizer='lion' is not one of"):
        part.memory(optimizer="lion")


def test_a_profile_without_memory_columns_has_no_prediction():
    part = partition(Profile.synthetic(fwd_ms=[1.0, 1.0], bwd_ms=[1.0, 1.0]).df[["fwd_ms", "bwd_ms"]], 2)
    assert all(x != x for x in part.rank_mem_bytes)  # NaN


def assert_fields_match(layers, bounds, **kwargs):
    want = StageFields.of(stage_bytes(layers, bounds, **kwargs)).values
    got = SplitBytes(layers, **kwargs).of(bounds).values
    # sums over all the layers, differenced: rounding at the scale of the whole profile's bytes
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12 * max(1.0, np.abs(want).sum()))


def test_split_bytes_are_stage_bytes_of_a_measured_profile(gpt):
    layers = Layers(gpt)
    optimizer = default_optimizer_memory("adam", "cpu")
    for K in range(1, layers.n + 1):
        assert_fields_match(layers, uniform_bounds(layers.n, K), scale=2.5, optimizer=optimizer, D=2)
    with pytest.raises(ValueError, match="contiguous stages"):
        SplitBytes(layers, optimizer=optimizer).of(((0, 2), (3, layers.n)))


@settings(max_examples=80, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 14),
    precision=st.sampled_from([None, "fp32", "bf16-mixed", "bf16-mixed-zero1"]),
    D=st.integers(1, 4),
    scale=st.sampled_from([1.0, 0.25, 3.0]),
)
def test_split_bytes_are_stage_bytes_of_random_profiles_and_splits(data, n, precision, D, scale):
    size = st.floats(0, 1e10, allow_nan=False, allow_subnormal=False)
    columns = ["param_bytes", "activation_bytes", "output_bytes", "transient_bytes", "largest_param_bytes"]
    df = pd.DataFrame({c: data.draw(st.lists(size, min_size=n, max_size=n)) for c in columns})
    df = df.assign(fwd_ms=1.0, bwd_ms=1.0, params=data.draw(st.lists(st.integers(0, 10**9), min_size=n, max_size=n)))
    layers = Layers(df)
    layers.meta = {"loss_activation_bytes": data.draw(size), "loss_transient_bytes": data.draw(size)}
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, n - 1)), max_size=n - 1)))
    bounds = tuple(zip([0, *cuts], [*cuts, n]))
    optimizer = data.draw(st.sampled_from([default_optimizer_memory("adam", "cpu"), OptimizerMemory(states=1.0)]))
    assert_fields_match(layers, bounds, scale=scale, precision=precision, optimizer=optimizer, D=D)
