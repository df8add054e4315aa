"""The compiled peaks against the replay (rank_peak): every rank, every schedule, random stages and profiles."""

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeswift_lab.core.memory_model import (
    MEMORY_TERMS,
    OptimizerMemory,
    StageBytes,
    default_optimizer_memory,
    rank_peak,
    send_wait,
)
from pipeswift_lab.core.peak_forms import STAGE_FIELDS, StageFields, peak_form
from pipeswift_lab.core.schedule_orders import compute_orders
from pipeswift_lab.core.vocabulary import SCHEDULES, SINGLE_CHUNK_SCHEDULES, V_SHAPE_SCHEDULES, accepts, stage_to_rank
from pipeswift_lab.partitioning.layers import Layers
from pipeswift_lab.partitioning.rank_memory import SplitBytes, rank_memory

OPTIMIZERS = [
    OptimizerMemory(states=0.0),
    OptimizerMemory(states=2.0, per_largest=2.0),
    OptimizerMemory(states=2.0, per_total=1.0),
    default_optimizer_memory("adam", "cpu"),  # 5/3 and 1/3: not whole numbers
]


@st.composite
def pipelines(draw, max_P=6, max_m=12):
    """A ``(schedule, P, m, v)`` torch accepts (GPipe and 1F1B also with ``m < P``, as the memory estimate runs
    them)."""
    schedule = draw(st.sampled_from(SCHEDULES))
    if schedule in SINGLE_CHUNK_SCHEDULES:
        v = 1
    else:
        v = 2 if schedule in V_SHAPE_SCHEDULES else draw(st.integers(1, 4))
    P = draw(st.integers(1, max_P))
    low = 2 * P if schedule == "DualPipeV" else 1
    m = draw(st.integers(low, max(low, max_m)).filter(lambda m: schedule == "1F1B" or accepts(P, m, schedule, v)))
    return schedule, P, m, v


#: Whole numbers of bytes (zeros included) keep every sum exact, so tied moments tie in both and the earliest wins.
whole_bytes = st.one_of(st.just(0.0), st.integers(0, 8).map(float), st.integers(0, 2**36).map(float))


@st.composite
def stage_bytes(draw):
    fields = {name: draw(whole_bytes) for name in STAGE_FIELDS}
    for name in ("first_transient", "input_transient"):  # negative: rank_peak's other branch
        fields[name] = draw(st.one_of(st.just(-1.0), whole_bytes))
    return StageBytes(**fields)


def replayed(stages, schedule, P, m, v, optimizer):
    """rank_peak of every rank, its stages taken as rank_memory takes them."""
    orders = compute_orders(P, m, schedule, v, check=False)
    placement = stage_to_rank(P, v, schedule)
    keys = ("peak_bytes", "peak_at", *(f"{t}_bytes" for t in MEMORY_TERMS))  # not the terms before the backward
    peaks = [
        rank_peak({s: stages[s] for s, rank in enumerate(placement) if rank == r}, orders[r], m, optimizer,
                  send_wait(schedule))
        for r in range(P)
    ]  # fmt: skip
    return [{k: peak[k] for k in keys} for peak in peaks]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), pipeline=pipelines(), optimizer=st.sampled_from(OPTIMIZERS))
def test_every_rank_peak_term_and_moment_is_the_replays(data, pipeline, optimizer):
    schedule, P, m, v = pipeline
    stages = data.draw(st.lists(stage_bytes(), min_size=P * v, max_size=P * v))
    form = peak_form(P, m, schedule, v)
    fields = StageFields.of(stages)
    want = replayed(stages, schedule, P, m, v, optimizer)
    got = form.rank_peaks(fields, optimizer)
    for r in range(P):
        assert got[r].keys() == want[r].keys(), f"rank {r}"
        assert got[r]["peak_at"] == want[r]["peak_at"], f"rank {r}"
        numbers = [k for k in want[r] if k != "peak_at"]  # approx compares numbers only (pytest >= 9.2 raises on a str)
        assert [got[r][k] for k in numbers] == pytest.approx([want[r][k] for k in numbers], rel=1e-12, abs=1e-6), (
            f"rank {r}"
        )
    assert form.peaks(fields, optimizer) == pytest.approx([w["peak_bytes"] for w in want], rel=1e-12, abs=1e-6)


@st.composite
def profile_and_split(draw, n_stages):
    """A per-layer table of random bytes (a loss's in its meta) and a split of it into ``n_stages`` stages."""
    n = draw(st.integers(n_stages, n_stages + 10))
    size = st.floats(0, 4e9, allow_nan=False, allow_subnormal=False)
    column = st.lists(size, min_size=n, max_size=n)
    df = pd.DataFrame(
        {
            "fwd_ms": [1.0] * n,
            "bwd_ms": [2.0] * n,
            "params": draw(st.lists(st.integers(0, 10**9), min_size=n, max_size=n)),
            "param_bytes": draw(column),
            "activation_bytes": draw(column),
            "output_bytes": draw(column),
            "transient_bytes": draw(column),
            "largest_param_bytes": draw(column),
        }
    )
    if draw(st.booleans()):  # a profile that measured what crosses each cut, and the rest
        for name in ("cut_bytes", "cut_grad_bytes", "cut_freed_bytes", "received_held_bytes"):
            df[name] = [0.0, *draw(st.lists(size, min_size=n - 1, max_size=n - 1))]
        df["accumulate_transient_bytes"] = draw(column)
    if draw(st.booleans()):  # a profile that measured a zero-bubble schedule's input-gradient pass
        df["weight_pass_bytes"] = draw(column)
        df["input_pass_peak_bytes"] = draw(st.lists(st.one_of(size, st.just(float("nan"))), min_size=n, max_size=n))
    cuts = sorted(draw(st.sets(st.integers(1, max(1, n - 1)), min_size=n_stages - 1, max_size=n_stages - 1)))
    meta = {"batch_size": 4, "loss_activation_bytes": draw(size), "loss_transient_bytes": draw(size)}
    meta.update({k: draw(size) for k in ("loss_retained_bytes", "input_bytes", "target_bytes")})
    return df, tuple(zip([0, *cuts], [*cuts, n])), meta


@settings(max_examples=120, deadline=None)
@given(
    data=st.data(),
    pipeline=pipelines(max_P=4),
    optimizer=st.sampled_from(["adam", "sgd"]),
    device=st.sampled_from(["cpu", "cuda"]),
    precision=st.sampled_from([None, "bf16-mixed", "bf16-mixed-zero1"]),
    D=st.integers(1, 3),
    micro_batch_size=st.sampled_from([None, 1, 3, 8]),
)
def test_planner_peaks_are_rank_memorys_on_random_profiles(
    data, pipeline, optimizer, device, precision, D, micro_batch_size
):
    """What the planner's search evaluates (SplitBytes' fields, the compiled peaks) against rank_memory's replay of
    stage_bytes; only the peaks, which are what the search reads (with unrounded bytes, two moments that tie exactly
    may be told apart by rounding, and then name another moment and its terms)."""
    schedule, P, m, v = pipeline
    df, bounds, meta = data.draw(profile_and_split(P * v))
    layers = Layers(df)
    layers.meta = {**meta, "device": device}
    want = rank_memory(
        layers,
        bounds,
        stage_to_rank(P, v, schedule),
        P=P,
        m=m,
        schedule=schedule,
        v=v,
        micro_batch_size=micro_batch_size,
        precision=precision,
        optimizer=optimizer,
        D=D,
    )
    memory = default_optimizer_memory(optimizer, device)
    scale = micro_batch_size / meta["batch_size"] if micro_batch_size else 1.0
    placement = stage_to_rank(P, v, schedule)
    fields = SplitBytes(layers, scale=scale, precision=precision, optimizer=memory, D=D).of(bounds, placement)
    got = peak_form(P, m, schedule, v).peaks(fields, memory)
    # SplitBytes takes a stage's transients as differences of sums over all the layers: they round at that scale
    rounding = (
        1e-11 * (np.nansum(df.drop(columns=["fwd_ms", "bwd_ms"]).to_numpy()) + sum(meta.values())) * (scale + 1) * m
    )
    np.testing.assert_allclose(got, want["predicted_peak_bytes"].to_numpy(), rtol=1e-9, atol=rounding)


def test_negative_bytes_and_a_wrong_stage_count_are_refused():
    form = peak_form(2, 4, "1F1B")
    stages = [StageBytes(weights=1.0, grads=1.0, optimizer=0.0, activations=1.0, transient=0.0)] * 2
    with pytest.raises(ValueError, match="one column per stage"):
        form.peaks(StageFields.of(stages[:1]), OPTIMIZERS[0])
    bad = StageFields.of(stages)
    bad.values[STAGE_FIELDS.index("recv"), 1] = -5.0
    with pytest.raises(ValueError, match="stage 1 has recv=-5.0"):
        form.peaks(bad, OPTIMIZERS[0])
    assert form.peaks(StageFields.of(stages), OPTIMIZERS[0]).shape == (2,)  # first_transient=-1 is allowed


def test_a_form_keeps_few_of_a_long_steps_moments():
    """1F1B's 256 backwards per rank come down to the first, the steady state's last and the cool-down's ends."""
    form = peak_form(4, 256, "1F1B")
    assert form.matrix.shape[1] <= 6
    assert peak_form(4, 256, "1F1B") is form  # cached
