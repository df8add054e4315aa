import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeswift_lab import analytic
from pipeswift_lab.core.vocabulary import SCHEDULES

Ps = st.integers(min_value=1, max_value=64)
ms = st.integers(min_value=1, max_value=512)
vs = st.integers(min_value=1, max_value=8)


def test_worked_examples_practitioners_quote():
    assert analytic.bubble_ratio(8, 16) == pytest.approx(7 / 23)
    assert round(analytic.bubble_ratio(8, 16), 3) == 0.304
    assert round(analytic.bubble_ratio(4, 16), 3) == 0.158
    assert analytic.bubble_overhead(8, 16, "1F1B") == pytest.approx(7 / 16)
    assert analytic.bubble_overhead(4, 8, "Interleaved1F1B", v=2) == pytest.approx(3 / 16)


@given(Ps, ms)
def test_gpipe_and_1f1b_closed_forms(P, m):
    for schedule in ("GPipe", "1F1B"):
        assert analytic.bubble_ratio(P, m, schedule) == pytest.approx((P - 1) / (m + P - 1))
        assert analytic.bubble_overhead(P, m, schedule) == pytest.approx((P - 1) / m)


@given(Ps, ms, vs)
def test_interleaved_closed_forms(P, m, v):
    for schedule in ("Interleaved1F1B", "LoopedBFS"):
        assert analytic.bubble_overhead(P, m, schedule, v=v) == pytest.approx((P - 1) / (v * m))
        assert analytic.bubble_ratio(P, m, schedule, v=v) == pytest.approx((P - 1) / (v * m + P - 1))


@given(Ps, ms, st.sampled_from(SCHEDULES), st.floats(0.1, 10), st.floats(0.1, 10), st.floats(0, 1))
def test_conventions_are_tied_and_bounded(P, m, schedule, fwd, bwd, share):
    v = 2 if schedule in ("ZBVZeroBubble", "DualPipeV", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble") else 1
    kw = dict(v=v, fwd_ms=fwd, bwd_ms=bwd, wgrad_fraction=share)
    ratio = analytic.bubble_ratio(P, m, schedule, **kw)
    overhead = analytic.bubble_overhead(P, m, schedule, **kw)
    assert 0 <= ratio < 1
    assert ratio == pytest.approx(overhead / (1 + overhead))
    assert analytic.step_ms(P, m, schedule, **kw) == pytest.approx(m * (fwd + bwd) * (1 + overhead))


@given(Ps, ms)
def test_bubble_shrinks_with_m_and_grows_with_P(P, m):
    assert analytic.bubble_ratio(P, m + 1) <= analytic.bubble_ratio(P, m)
    assert analytic.bubble_ratio(P + 1, m) > analytic.bubble_ratio(P, m)


def test_zero_bubble_family_uses_the_weight_gradient():
    # ZB-H1: bubble (P-1)(F + I - W); with F = I = W it is a third of 1F1B's (P-1)(F + I + W).
    zb = analytic.bubble_overhead(4, 8, "InterleavedZeroBubble", v=1, fwd_ms=1, bwd_ms=2, wgrad_fraction=0.5)
    assert zb == pytest.approx(analytic.bubble_overhead(4, 8, "1F1B") / 3)
    # ZB-V with F = I = W fills the bubble completely.
    assert analytic.bubble_overhead(4, 8, "ZBVZeroBubble", v=2, fwd_ms=1, bwd_ms=2, wgrad_fraction=0.5) == 0
    # The stated default splits the backward in two halves.
    assert analytic.bubble_overhead(4, 8, "InterleavedZeroBubble", fwd_ms=1, bwd_ms=2) == zb


def test_inflight_microbatches_per_schedule():
    assert analytic.inflight_microbatches(4, 8, "GPipe") == [8, 8, 8, 8]
    assert analytic.inflight_microbatches(4, 8, "1F1B") == [4, 3, 2, 1]
    assert analytic.inflight_microbatches(4, 2, "1F1B") == [2, 2, 2, 1]
    assert analytic.inflight_microbatches(4, 8, "LoopedBFS", v=2) == [8] * 4
    # torch's interleaved warm-up: (v-1)*m_round + 2*(P-1-r) forwards, plus the one in progress.
    assert analytic.inflight_microbatches(4, 8, "Interleaved1F1B", v=2) == [11 / 2, 9 / 2, 7 / 2, 5 / 2]
    assert analytic.inflight_microbatches(4, 8, "ZBVZeroBubble", v=2) == [4] * 4
    assert analytic.inflight_microbatches(4, 3, "ZBVZeroBubble", v=2) == [2, 2.5, 3, 3]
    assert analytic.inflight_microbatches(4, 8, "DualPipeV", v=2) == [4.5] * 4
    assert analytic.inflight_microbatches(4, 8, "InterleavedZeroBubble", v=2) == [4] * 4


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_inflight_counts_match_torchs_orders_replayed(schedule):
    """The closed forms against the simulator's replay of the order torch executes."""
    import pandas as pd

    from pipeswift_lab.core.vocabulary import validate
    from pipeswift_lab.simulation.simulator import simulate

    vs = {"GPipe": [1], "1F1B": [1], "ZBVZeroBubble": [2], "DualPipeV": [2]}.get(schedule, [1, 2, 3])
    checked = 0
    for P in range(1, 6):
        for v in vs:
            for m in range(1, 14):
                try:
                    validate(P, m, schedule, v)
                except ValueError:
                    continue
                stages = pd.DataFrame({"fwd_ms": [1.0] * (P * v), "bwd_ms": [2.0] * (P * v)})
                simulated = simulate(stages, m, schedule, v=v).peak_inflight.tolist()
                assert analytic.inflight_microbatches(P, m, schedule, v=v) == pytest.approx(simulated), (P, m, v)
                checked += 1
    assert checked >= 10


def test_activation_memory_follows_inflight_counts():
    assert analytic.activation_memory_bytes(4, 8, 100.0, "1F1B") == [400, 300, 200, 100]
    assert analytic.activation_memory_bytes(2, 8, [10.0, 20.0], "GPipe") == [80, 160]
    with pytest.raises(ValueError, match="one per rank, P=2"):
        analytic.activation_memory_bytes(2, 8, [1.0], "GPipe")


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: analytic.bubble_ratio(0, 4), r"P=0 is invalid; it must be >= 1"),
        (lambda: analytic.bubble_ratio(4, 0), r"m=0 is invalid; it must be >= 1"),
        (lambda: analytic.bubble_ratio(4, 4, "1F1B", v=2), r"v=2 is not allowed for schedule='1F1B'"),
        (lambda: analytic.bubble_ratio(4, 4, "ZBVZeroBubble", v=3), r"v=3 .* exactly 2 stages per rank"),
        (lambda: analytic.bubble_ratio(4, 4, "Interleaved1F1B", v=0), r"v=0 is invalid"),
        (lambda: analytic.bubble_ratio(4, 4, "nope"), r"schedule='nope' is not known; valid schedules are"),
        (lambda: analytic.bubble_ratio(4, 4, fwd_ms=-1), r"fwd_ms=-1.0 is invalid; it must be >= 0"),
        (lambda: analytic.bubble_ratio(4, 4, bwd_ms=math.nan), r"bwd_ms=nan is invalid; it must be a finite number"),
        (
            lambda: analytic.bubble_ratio(4, 4, bwd_ms=1, wgrad_fraction=2),
            r"wgrad_fraction=2.0 is invalid; it is a share of the backward and must be <= 1",
        ),
    ],
)
def test_bad_input_names_the_argument(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_type_errors():
    with pytest.raises(TypeError, match="P must be an integer; got float 2.5"):
        analytic.bubble_ratio(2.5, 4)
    with pytest.raises(TypeError, match="m must be an integer; got bool"):
        analytic.bubble_ratio(2, True)


def test_one_way_to_give_the_weight_gradient_share_and_one_default_schedule():
    zb = dict(v=2, fwd_ms=1, bwd_ms=2)
    with pytest.raises(TypeError, match="unexpected keyword argument 'wgrad_ms'"):
        analytic.bubble_ratio(4, 8, "ZBVZeroBubble", **zb, wgrad_ms=0.5)
    assert analytic.bubble_ratio(4, 8, "ZBVZeroBubble", **zb, wgrad_fraction=0.25) < analytic.bubble_ratio(
        4, 8, "ZBVZeroBubble", **zb, wgrad_fraction=0.1
    )
    with pytest.raises(TypeError, match="positional"):
        analytic.bubble_ratio(4, 8, "Interleaved1F1B", 2)  # keyword-only after (P, m, schedule)
    assert analytic.bubble_ratio(4, 8) == analytic.bubble_ratio(4, 8, "1F1B")
    assert analytic.bubble_overhead(4, 8) == analytic.bubble_overhead(4, 8, "1F1B")


def test_schedule_names_are_case_insensitive():
    assert analytic.bubble_ratio(4, 8, "gpipe") == analytic.bubble_ratio(4, 8, "GPipe")
    assert analytic.bubble_overhead(4, 8, "interleaved1f1b", v=2) == analytic.bubble_overhead(
        4, 8, "Interleaved1F1B", v=2
    )


def test_the_first_stage_has_no_input_gradient_to_split():
    igrad, wgrad = analytic.backward_parts([2.0, 2.0, 4.0], [0.5, 0.5, 1.0])
    assert igrad == [0.0, 1.5, 3.0] and wgrad == [2.0, 0.5, 1.0]  # the first stage's W is its whole backward
    assert analytic.backward_parts([], []) == ([], [])


def test_a_split_backward_recomputes_in_both_passes():
    """A checkpointed stage recomputes in its I and again in its W: the two add up to the backward (which holds one
    recomputation) and one recomputation more; the first stage has no I, and its W is the backward."""
    from pipeswift_lab.core.analytic import DEFAULT_WGRAD_FRACTION, backward_parts

    igrad, wgrad = backward_parts([6.0, 6.0], recomputed_ms=[2.0, 2.0])
    assert igrad == [0.0, pytest.approx((1 - DEFAULT_WGRAD_FRACTION) * 4.0 + 2.0)]
    assert wgrad == [6.0, pytest.approx(DEFAULT_WGRAD_FRACTION * 4.0 + 2.0)]
    assert igrad[1] + wgrad[1] == pytest.approx(6.0 + 2.0)
    measured_split = backward_parts([6.0, 6.0], wgrad_ms=[4.0, 4.0], recomputed_ms=[0.0, 2.0])  # wgrad includes it
    assert measured_split == ([0.0, 4.0], [6.0, 4.0])
    assert backward_parts([6.0, 6.0]) == backward_parts([6.0, 6.0], recomputed_ms=[0.0, 0.0])


def test_the_split_passes_as_torch_took_them_replace_the_share_where_measured():
    """Profiled I and W (torch's own passes on each layer) are the durations, the recomputation added to each; a stage
    whose passes were not measured (the first: no I) keeps the rule."""
    from pipeswift_lab.core.analytic import backward_parts

    passes = ([float("nan"), 3.0], [float("nan"), 2.5])
    assert backward_parts([6.0, 4.0], passes_ms=passes) == ([0.0, 3.0], [6.0, 2.5])
    assert backward_parts([6.0, 4.0], recomputed_ms=[1.0, 1.0], passes_ms=passes) == ([0.0, 4.0], [6.0, 3.5])


def test_the_docstrings_worked_examples_hold():
    import doctest

    results = doctest.testmod(analytic, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert results.attempted >= 2 and results.failed == 0
