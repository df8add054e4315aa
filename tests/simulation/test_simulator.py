import math

import pandas as pd
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pipeswift_lab import analytic
from pipeswift_lab.core.link import Link
from pipeswift_lab.core.schedule import Schedule
from pipeswift_lab.core.schedule_orders import action_groups, compute_orders
from pipeswift_lab.core.vocabulary import SCHEDULES, stage_to_rank, validate
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.simulation.simulator import ScheduleDeadlock, simulate


def equal_stages(P, v, chunk_fwd, chunk_bwd):
    return pd.DataFrame({"fwd_ms": [float(chunk_fwd)] * (P * v), "bwd_ms": [float(chunk_bwd)] * (P * v)})


def valid(P, m, schedule, v):
    try:
        validate(P, m, schedule, v)
        return True
    except ValueError:
        return False


# ---------------------------------------------------------------- closed forms
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.integers(1, 8), st.integers(1, 40), st.integers(1, 6), st.integers(1, 6), st.sampled_from(["GPipe", "1F1B"]))
def test_gpipe_and_1f1b_equal_the_closed_forms_exactly(P, m, f, b, schedule):
    if not valid(P, m, schedule, 1):
        m = P + m  # 1F1B needs m >= P
    tl = simulate(equal_stages(P, 1, f, b), m, schedule)
    assert tl.step_ms == analytic.step_ms(P, m, schedule, fwd_ms=f, bwd_ms=b)
    assert tl.bubble_ratio == pytest.approx(analytic.bubble_ratio(P, m, schedule, fwd_ms=f, bwd_ms=b), abs=1e-12)
    assert tl.peak_inflight.tolist() == analytic.inflight_microbatches(P, m, schedule)


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 8),
    st.integers(1, 4),
    st.integers(0, 40),
    st.integers(1, 5),
    st.integers(1, 5),
    st.sampled_from(["Interleaved1F1B", "LoopedBFS"]),
)
def test_interleaved_equals_the_closed_form_for_every_m_from_P(P, v, extra, f, b, schedule):
    """torch's Interleaved1F1B and LoopedBFS reach (P-1)(F+B)/v of bubble for every m >= P they accept."""
    m = P + extra
    assume(valid(P, m, schedule, v))
    tl = simulate(equal_stages(P, v, f, b), m, schedule, v=v)
    # a rank's forward of one micro-batch is v chunks of f
    assert tl.step_ms == analytic.step_ms(P, m, schedule, v=v, fwd_ms=v * f, bwd_ms=v * b)
    assert tl.bubble_ratio == pytest.approx(analytic.bubble_ratio(P, m, schedule, v=v), abs=1e-12)
    assert tl.peak_inflight.tolist() == pytest.approx(analytic.inflight_microbatches(P, m, schedule, v=v))


def split_stages(P, v, F, i_, W):
    """Equal chunks of forward F, input-gradient I (``i_``) and weight-gradient W (ms)."""
    return pd.DataFrame(
        {"fwd_ms": [float(F)] * (P * v), "bwd_ms": [float(i_ + W)] * (P * v), "wgrad_ms": [float(W)] * (P * v)}
    )


def closed_form_step_ms(P, m, schedule, v, F, i_, W):
    """The closed form with one chunk's F, I (``i_``), W given as a rank's times (v chunks each)."""
    return analytic.step_ms(P, m, schedule, v=v, fwd_ms=v * F, bwd_ms=v * (i_ + W), wgrad_fraction=W / (i_ + W))


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 6), st.integers(1, 2), st.integers(0, 20), st.integers(1, 6), st.integers(1, 6), st.data())
def test_zb_h1_equals_its_closed_form_wherever_w_fits_the_bubble(P, v, extra, F, i_, data):
    """InterleavedZeroBubble (ZB-H1, Qi et al. 2024): (P-1)(F+I-W)/v of bubble for any F, I and W <= min(F, I)."""
    W = data.draw(st.integers(1, min(F, i_)))
    m = P + extra
    assume(valid(P, m, "InterleavedZeroBubble", v))
    tl = simulate(split_stages(P, v, F, i_, W), m, "InterleavedZeroBubble", v=v)
    assert tl.step_ms == pytest.approx(closed_form_step_ms(P, m, "InterleavedZeroBubble", v, F, i_, W), abs=1e-9)


def test_zb_h1_with_a_weight_gradient_longer_than_the_bubble_takes_longer_than_its_closed_form():
    # W = 2 > min(F, i_) = 1: the deferred W no longer fits, and torch's order is a unit longer per step
    tl = simulate(split_stages(2, 1, 1, 1, 2), 4, "InterleavedZeroBubble", v=1)
    assert tl.step_ms == 17.0 > closed_form_step_ms(2, 4, "InterleavedZeroBubble", 1, 1, 1, 2) == 16.0


@pytest.mark.parametrize("P", [2, 3, 4, 5])
@pytest.mark.parametrize("extra", [0, 1, 2, 7])
@pytest.mark.parametrize("unit", [1, 3])
def test_dualpipev_equals_deepseeks_closed_form_with_equal_passes(P, extra, unit):
    """DeepSeek-V3's Table 2, (PP/2-1)(F&B+B-3W) with PP = 2P chunks, is exact for F = i_ = W per chunk."""
    m = 2 * P + extra
    tl = simulate(split_stages(P, 2, unit, unit, unit), m, "DualPipeV", v=2)
    assert tl.step_ms == closed_form_step_ms(P, m, "DualPipeV", 2, unit, unit, unit)
    assert tl.step_ms - m * 6 * unit == (P - 1) * 2 * unit  # F + 2B - 3W = 2 units of idle per rank


def test_dualpipev_worked_example_of_the_issue():
    # P = 4, m = 10, F = i_ = W = 1 per chunk: a 66-unit step with 6 idle units per rank, bubble over compute 0.10
    assert simulate(split_stages(4, 2, 1, 1, 1), 10, "DualPipeV", v=2).step_ms == 66.0
    assert analytic.bubble_overhead(4, 10, "DualPipeV", v=2, fwd_ms=2, bwd_ms=4, wgrad_fraction=0.5) == pytest.approx(
        0.1
    )
    assert analytic.step_ms(4, 10, "DualPipeV", v=2, fwd_ms=2, bwd_ms=4, wgrad_fraction=0.5) == 66.0


def test_interleaved_and_looped_bfs_with_fewer_microbatches_than_ranks_exceed_the_closed_form():
    # the gap reported to the lead: torch's orders only reach (P-1)/v when m >= P
    for schedule in ("Interleaved1F1B", "LoopedBFS"):
        tl = simulate(equal_stages(4, 2, 1, 2), 2, schedule, v=2)
        assert tl.step_ms == 27.0
        assert analytic.step_ms(4, 2, schedule, v=2, fwd_ms=2, bwd_ms=4) == 21.0
        assert simulate(equal_stages(4, 2, 1, 2), 8, schedule, v=2).step_ms == analytic.step_ms(
            4, 8, schedule, v=2, fwd_ms=2, bwd_ms=4
        )


# ---------------------------------------------------------------- semantics
def check_causal(tl, fwd, bwd, wgrad, transfer, placement, exact_start=False):
    """Every action lasts its duration, waits for its inputs, and ranks run one action at a time.

    An output leaves its rank when the torch action that made it is over (both parts of an
    OVERLAP_F_B). With ``exact_start`` every action starts as soon as its rank is free and its
    inputs are there.
    """
    df = tl.df[tl.df["kind"].isin(["F", "B", "I", "W"])]
    end = {(r.kind, r.stage, r.microbatch): r.end_ms for r in df.itertuples(index=False)}
    P, m, schedule, v = tl.meta["P"], tl.meta["m"], tl.meta["schedule"], tl.meta["v"]
    done, sent = {}, {}
    for rank_groups in action_groups(P, m, schedule, v):
        for group in rank_groups:
            group_end = max(end[a] for a in group)
            for kind, s, i in group:
                key = ("F" if kind == "F" else "G" if kind in ("B", "I") else "W", s, i)
                done[key], sent[key] = end[(kind, s, i)], group_end
    S = len(fwd)
    order = compute_orders(P, m, schedule, v)
    for rank, actions in order.items():
        rows = df[df["rank"] == rank]  # the Timeline keeps execution order for equal times
        assert [(r.kind, r.stage, r.microbatch) for r in rows.itertuples()] == actions
        prev_end = 0.0
        for r in rows.itertuples():
            s, i = r.stage, r.microbatch
            w = bwd[s] if s == 0 else wgrad[s]  # the first stage's input needs no gradient: its W is its whole backward
            expected = {"F": fwd[s], "B": bwd[s], "I": bwd[s] - w, "W": w}[r.kind]
            assert r.end_ms - r.start_ms == pytest.approx(expected)
            assert r.start_ms >= prev_end - 1e-9
            ready = prev_end
            if r.kind == "F" and s > 0:
                cross = placement[s - 1] != placement[s]
                ready = max(ready, sent[("F", s - 1, i)] + transfer[s - 1] if cross else done[("F", s - 1, i)])
            if r.kind in ("B", "I"):
                ready = max(ready, done[("F", s, i)])
                if s < S - 1:
                    cross = placement[s + 1] != placement[s]
                    ready = max(ready, sent[("G", s + 1, i)] + transfer[s] if cross else done[("G", s + 1, i)])
            if r.kind == "W":
                ready = max(ready, done[("G", s, i)])
            assert r.start_ms >= ready - 1e-9
            if exact_start:
                assert r.start_ms == pytest.approx(ready)
            prev_end = r.end_ms


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(SCHEDULES),
    st.integers(1, 4),
    st.integers(1, 10),
    st.lists(st.floats(0.1, 5.0), min_size=16, max_size=16),
    st.floats(0.0, 1.0),
    st.booleans(),
)
def test_actions_wait_for_their_inputs_with_any_times(schedule, P, m, times, share, with_link):
    v = 1 if schedule in ("GPipe", "1F1B") else 2
    if schedule == "DualPipeV":
        m = max(m, 2 * P)
    if schedule == "1F1B":
        m = max(m, P)
    if not valid(P, m, schedule, v):
        m = P * max(1, m // P)
    S = P * v
    fwd, bwd = times[:S], times[8 : 8 + S]
    table = pd.DataFrame({"fwd_ms": fwd, "bwd_ms": bwd, "output_bytes": [2e6] * S})
    link = Link(0.05, 4.0) if with_link else None
    tl = simulate(table, m, schedule, v=v, link=link, wgrad_fraction=share)
    transfer = [link.transfer_ms(2e6) if link else 0.0] * S
    check_causal(
        tl, fwd, bwd, [share * b for b in bwd], transfer, stage_to_rank(P, v, schedule), exact_start=not with_link
    )


def test_1f1b_with_a_link_serializes_transfers_as_torchs_fused_batches():
    # P=2, F=1, B=2 per stage, each transfer 0.5 ms. Worked by hand from Schedule1F1B._step_microbatches:
    # rank 1: F0 1.5-2.5, B0 2.5-4.5, then waits for its gradient send (5.0) before F1 5.0-6.0, B1 6.0-8.0;
    # rank 0: F0 0-1, F1 1-2, waits for F1's send (2.5) and B0's gradient (5.0): B0 5.0-7.0, B1 8.5-10.5.
    table = pd.DataFrame({"fwd_ms": [1.0, 1.0], "bwd_ms": [2.0, 2.0], "output_bytes": [5e6, 0]})
    link = Link(latency_ms=0.0, bandwidth_GBps=10.0)  # 5e6 bytes: 0.5 ms
    tl = simulate(table, 2, "1F1B", link=link)
    compute = tl.df[tl.df["kind"].isin(["F", "B"])]
    got = {(r.rank, r.kind, r.microbatch): (r.start_ms, r.end_ms) for r in compute.itertuples()}
    assert got == {
        (0, "F", 0): (0.0, 1.0),
        (0, "F", 1): (1.0, 2.0),
        (0, "B", 0): (5.0, 7.0),
        (0, "B", 1): (8.5, 10.5),
        (1, "F", 0): (1.5, 2.5),
        (1, "B", 0): (2.5, 4.5),
        (1, "F", 1): (5.0, 6.0),
        (1, "B", 1): (6.0, 8.0),
    }
    assert tl.step_ms == 10.5
    sends = tl.df[tl.df["kind"].str.startswith("SEND")]
    recvs = tl.df[tl.df["kind"].str.startswith("RECV")]
    assert len(sends) == len(recvs) == 4
    assert set(zip(sends["kind"], sends["rank"], sends["start_ms"], sends["end_ms"])) == {
        ("SEND_F", 0, 1.0, 1.5),
        ("SEND_F", 0, 2.0, 2.5),
        ("SEND_B", 1, 4.5, 5.0),
        ("SEND_B", 1, 8.0, 8.5),
    }
    assert set(zip(recvs["kind"], recvs["rank"], recvs["stage"])) == {("RECV_F", 1, 1), ("RECV_B", 0, 0)}


def test_gpipe_with_a_link_by_hand():
    table = pd.DataFrame({"fwd_ms": [1.0, 1.0], "bwd_ms": [2.0, 2.0], "output_bytes": [5e6, 0]})
    tl = simulate(table, 2, "GPipe", link=Link(0.0, 10.0))
    b = tl.df[tl.df["kind"] == "B"].set_index(["rank", "microbatch"])
    assert (b.loc[(1, 0), "start_ms"], b.loc[(1, 1), "end_ms"]) == (3.5, 7.5)
    assert (b.loc[(0, 0), "start_ms"], b.loc[(0, 1), "end_ms"]) == (6.0, 10.0)
    assert tl.step_ms == 10.0


def test_multi_chunk_runtime_overlaps_transfers_with_compute():
    """torch's _PipelineScheduleRuntime sends asynchronously; 1F1B's fused batches wait for every send."""
    table = pd.DataFrame({"fwd_ms": [1.0, 1.0], "bwd_ms": [2.0, 2.0], "output_bytes": [5e6, 0]})
    link = Link(0.0, 10.0)  # 0.5 ms per transfer
    assert simulate(table, 4, "Interleaved1F1B", v=1).step_ms == simulate(table, 4, "1F1B").step_ms == 15.0
    # only the two crossings on the critical path (F0 forward, B3 backward) add up: +1.0 ms
    assert simulate(table, 4, "Interleaved1F1B", v=1, link=link).step_ms == 16.0
    # 1F1B also waits for each send in its steady state
    assert simulate(table, 4, "1F1B", link=link).step_ms == 17.5


def test_v_shape_turn_stays_on_the_rank_without_transfers():
    P = 3
    table = pd.DataFrame({"fwd_ms": [1.0] * 6, "bwd_ms": [2.0] * 6, "output_bytes": [1e6] * 6})
    tl = simulate(table, 6, "ZBVZeroBubble", link=Link(0.1, 10))
    sends = tl.df[tl.df["kind"] == "SEND_F"]
    # stages 2 and 3 share rank 2: no activation goes over the link there; 4 links per micro-batch otherwise
    assert not (sends["stage"] == P - 1).any()
    assert len(sends) == 4 * 6
    assert set(tl.df[tl.df["stage"] == 3]["rank"]) == {2}


def test_zero_bubble_splits_the_backward():
    prof = Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4, wgrad_ms=[0.5] * 4)
    part = partition(prof, 2, v=2, schedule="ZBVZeroBubble")
    tl = simulate(part, 4)
    df = tl.df.assign(d=tl.df["end_ms"] - tl.df["start_ms"])
    later = df[df["stage"] > 0].groupby("kind")["d"].agg(["min", "max"])
    assert later.loc["I"].tolist() == [1.5, 1.5] and later.loc["W"].tolist() == [0.5, 0.5]
    # the first stage's input is data: nothing to differentiate in I, its whole backward in W (as torch runs it)
    first = df[df["stage"] == 0].groupby("kind")["d"].agg(["min", "max"])
    assert first.loc["I"].tolist() == [0.0, 0.0] and first.loc["W"].tolist() == [2.0, 2.0]
    assert tl.meta["wgrad_split"] == "profile wgrad_ms"
    tl = simulate(part, 4, wgrad_fraction=0.25)
    w = tl.df[(tl.df["kind"] == "W") & (tl.df["stage"] > 0)]
    assert ((w["end_ms"] - w["start_ms"]) == 0.5).all()
    no_split = partition(Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4), 2, v=2, schedule="ZBVZeroBubble")
    w = simulate(no_split, 4).df.query("kind == 'W' and stage > 0")
    assert ((w["end_ms"] - w["start_ms"]) == 2.0 / 2 * analytic.DEFAULT_WGRAD_FRACTION * 2).all()


def test_dualpipev_runs_its_overlapped_pairs_back_to_back():
    tl = simulate(equal_stages(2, 2, 1, 2), 8, "DualPipeV")
    rank0 = tl.df[(tl.df["rank"] == 0) & tl.df["kind"].isin(["F", "B", "I", "W"])].reset_index(drop=True)
    pairs = [
        (a, b)
        for a, b in zip(rank0.itertuples(), rank0.iloc[1:].itertuples())
        if a.kind == "F" and b.kind == "B" and a.stage != b.stage
    ]
    assert pairs and all(b.start_ms >= a.end_ms for a, b in pairs)


def test_partition_and_stage_table_give_the_same_timeline():
    prof = Profile.synthetic(
        fwd_ms=[1, 2, 3, 1, 2, 2], bwd_ms=[2, 4, 6, 2, 4, 4], output_bytes=[1e6] * 6, activation_bytes=[3e6] * 6
    )
    part = partition(prof, 3)
    a = simulate(part, 6, link=Link(0.1, 5))
    b = simulate(part.stage_table(), 6, "1F1B", link=Link(0.1, 5))
    pd.testing.assert_frame_equal(a.df, b.df)
    assert a.meta["stage_activation_bytes"] == list(part.stage_activation_bytes)


def test_simulator_is_linear_and_fast_enough_for_big_pipelines():
    tl = simulate(equal_stages(32, 2, 0.5, 1.0), 256, "Interleaved1F1B", v=2)
    assert len(tl.df) == 32 * 2 * 256 * 2
    assert tl.step_ms == analytic.step_ms(32, 256, "Interleaved1F1B", v=2, fwd_ms=1.0, bwd_ms=2.0)


# ---------------------------------------------------------------- deadlocks and bad input
def test_an_order_that_cannot_progress_is_a_clear_error():
    table = equal_stages(2, 1, 1, 2)
    ok = {0: [("F", 0, 0), ("B", 0, 0)], 1: [("F", 1, 0), ("B", 1, 0)]}
    assert simulate(table, 1, Schedule.from_lists(ok)).step_ms == 6.0
    bad = {0: [("B", 0, 0), ("F", 0, 0)], 1: [("F", 1, 0), ("B", 1, 0)]}
    with pytest.raises(ScheduleDeadlock, match="rank 0 waits forever at position 0, action 0B0, for 0F0"):
        Schedule.from_lists(bad)
    crossed = {
        0: [("F", 0, 0), ("B", 0, 1), ("F", 0, 1), ("B", 0, 0)],
        1: [("F", 1, 0), ("B", 1, 0), ("F", 1, 1), ("B", 1, 1)],
    }
    with pytest.raises(ScheduleDeadlock, match="rank 0 waits forever at position 1, action 0B1, for 0F1"):
        Schedule.from_lists(crossed)


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: simulate(equal_stages(4, 1, 1, 2), 3, "1F1B"), ValueError, r"P=4, m=3"),
        (lambda: simulate(equal_stages(2, 2, 1, 2), 4, "Interleaved1F1B"), ValueError, "needs v"),
        (
            lambda: simulate(pd.DataFrame({"fwd_ms": [1.0] * 3, "bwd_ms": [1.0] * 3}), 4, "ZBVZeroBubble"),
            ValueError,
            "3 rows; with v=2",
        ),
        (
            lambda: simulate(pd.DataFrame({"fwd_ms": [1.0, math.nan], "bwd_ms": [1.0, 1.0]}), 2),
            ValueError,
            "stage 1 has nan",
        ),
        (
            lambda: simulate(pd.DataFrame({"fwd_ms": [1.0, -1.0], "bwd_ms": [1.0, 1.0]}), 2),
            ValueError,
            "stage 1 has -1.0",
        ),
        (lambda: simulate(pd.DataFrame({"fwd_ms": [1.0]}), 2), ValueError, "no 'bwd_ms' column"),
        (lambda: simulate(equal_stages(2, 1, 1, 2), 2, link=Link(0, 1)), ValueError, "output_bytes"),
        (lambda: simulate([1, 2], 2), TypeError, "Partition"),
        (lambda: simulate(equal_stages(2, 1, 1, 2), 2, wgrad_fraction=1.5), ValueError, "wgrad_fraction=1.5"),
        (lambda: simulate(equal_stages(2, 1, 1, 2), 0), ValueError, "m=0"),
        (
            lambda: simulate(pd.DataFrame({"fwd_ms": [1.0], "bwd_ms": [1.0], "wgrad_ms": [2.0]}), 1),
            ValueError,
            "wgrad_ms=2.0 exceeds",
        ),
    ],
)
def test_bad_input(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_partition_and_schedule_must_agree_on_placement():
    prof = Profile.synthetic(fwd_ms=[1.0] * 8, bwd_ms=[2.0] * 8)
    interleaved = partition(prof, 2, v=2, schedule="Interleaved1F1B")
    with pytest.raises(ValueError, match="places stages on ranks as"):
        simulate(interleaved, 4, "ZBVZeroBubble")
    with pytest.raises(ValueError, match="one stage per rank"):
        simulate(interleaved, 4, "1F1B")
    with pytest.raises(ValueError, match="v=3 does not match"):
        simulate(interleaved, 4, v=3)
    assert simulate(interleaved, 4, "LoopedBFS").meta["schedule"] == "LoopedBFS"  # same round-robin placement
    assert simulate(interleaved, 4).meta["schedule"] == "Interleaved1F1B"


def test_simulate_step_ms_equals_the_timelines_step():
    import random

    from pipeswift_lab.simulation.simulator import simulate_step_ms

    rng = random.Random(3)
    for schedule, v in (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2), ("DualPipeV", 2)):
        P, m = 3, 6
        stages = pd.DataFrame(
            {
                "fwd_ms": [rng.uniform(1, 3) for _ in range(P * v)],
                "bwd_ms": [rng.uniform(2, 6) for _ in range(P * v)],
                "output_bytes": [1e6] * (P * v),
            }
        )
        link = Link(0.1, 1.0)
        assert (
            simulate_step_ms(stages, m, schedule, v=v, link=link)
            == simulate(stages, m, schedule, v=v, link=link).step_ms
        )


# ---------------------------------------------------------------- calibrated
def hand_calibration(**changes):
    from pipeswift_lab.fidelity.calibrator import Calibration

    values = dict(
        compute_scale={2: 2.0, 4: 3.0},
        action_ms=0.5,
        loss_ms=(1.0, 2.0),
        gap={"single-chunk": 0.25, "multi-chunk": 0.1},
        step_overhead={"single-chunk": 10.0, "multi-chunk": 3.0},
        latency_ms=0.0,
        bandwidth_GBps=math.inf,
        step_cv=0.1,
    )
    values.update(changes)
    return Calibration(**values)


@pytest.mark.parametrize("schedule,v", [("1F1B", 1), ("GPipe", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)])
def test_a_calibration_is_the_same_simulation_on_transformed_stage_times(schedule, v):
    table = pd.DataFrame(
        {
            "fwd_ms": [1.0, 2.0, 1.5, 3.0],
            "bwd_ms": [2.0, 4.0, 3.0, 6.0],
            "wgrad_ms": [1.0, 2.0, 1.0, 3.0],
            "output_bytes": [1e6] * 4,
        }
    )
    if v == 1:
        table = table.iloc[:2].reset_index(drop=True)
    cal = hand_calibration(latency_ms=0.2)
    extra = 0.5 + (0.25 if v == 1 else 0.1)
    # every action: 2x + action_ms + gap_ms (a W only action_ms); the last stage's F and B (or its I) also pay the loss.
    # A zero-bubble backward is two actions, I and W: as a stage table, bwd = I + W
    split = schedule == "ZBVZeroBubble"
    by_hand = table.assign(
        fwd_ms=2 * table["fwd_ms"] + extra,
        wgrad_ms=2 * table["wgrad_ms"] + 0.5,
        bwd_ms=2 * table["bwd_ms"] + extra + (0.5 if split else 0.0),
    )
    by_hand.loc[len(table) - 1, "fwd_ms"] += 1.0
    by_hand.loc[len(table) - 1, "bwd_ms"] += 2.0
    link = Link(latency_ms=0.2, bandwidth_GBps=1e15)  # latency only, as the calibration has no bandwidth
    got = simulate(table, 4, schedule, v=v, calibration=cal)
    want = simulate(by_hand, 4, schedule, v=v, link=link)
    assert got.step_ms == pytest.approx(want.step_ms, abs=1e-6)
    assert got.meta["step_overhead_ms"] == cal.step_overhead_ms(schedule) and got.meta["gap_ms"] == cal.gap_ms(
        schedule, 2
    )
    assert got.meta["stage_transfer_ms"] == [0.2] * len(table)
    # an explicit link overrides the calibration's transfers
    assert simulate(table, 4, schedule, v=v, calibration=cal, link=Link(0.0, 1e15)).step_ms < got.step_ms


def test_calibration_scale_of_an_unfitted_P_is_the_nearest():
    cal = hand_calibration()
    assert cal.scale(2) == 2.0 and cal.scale(3) == 3.0 and cal.scale(1) == 2.0 and cal.scale(16) == 3.0
    assert math.isnan(hand_calibration(step_overhead={"single-chunk": math.nan}).step_overhead.get("single-chunk"))
    assert hand_calibration(step_overhead={"single-chunk": math.nan}).step_overhead_ms("1F1B") == 0.0


def test_stage_table_with_strings_names_the_value():
    table = pd.DataFrame({"fwd_ms": ["1.0", "fast"], "bwd_ms": [2.0, 2.0]})
    with pytest.raises(
        ValueError, match=r"stage table column 'fwd_ms': stage 1 has 'fast'; values must be finite numbers >= 0"
    ):
        simulate(table, 4, "1F1B")


def test_editing_a_timeline_leaves_the_cached_order_alone():
    table = pd.DataFrame({"fwd_ms": [1.0] * 2, "bwd_ms": [2.0] * 2})
    first = simulate(table, 4, "1F1B")
    kinds = first.df["kind"].tolist()
    first.df.loc[0, "kind"] = "W"
    first.df.loc[0, "rank"] = 7
    again = simulate(table, 4, "1F1B")
    assert again.df["kind"].tolist() == kinds and set(again.df["rank"]) == {0, 1}


def test_a_custom_order_runs_each_action_once():
    with pytest.raises(ValueError, match="action 0F0 appears twice: rank 0 position 0 and rank 0 position 1"):
        Schedule.from_lists({0: [("F", 0, 0), ("F", 0, 0), ("B", 0, 0)]})
    with pytest.raises(ValueError, match="has both a full backward 0B0 and a split one"):
        Schedule.from_lists({0: [("F", 0, 0), ("I", 0, 0), ("B", 0, 0)]})
