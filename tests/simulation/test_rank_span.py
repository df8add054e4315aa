"""Timeline.rank_span_bubble_rate: the Zero Bubble paper's bubble rate, each rank measured over its own span."""

import pandas as pd
import pytest

from pipeswift_lab.simulation.simulator import simulate
from pipeswift_lab.simulation.timeline import COLUMNS, Timeline


def two_steps():
    """Two steps of two ranks. Step 0: rank 0 computes 0-2 and 6-10 (span 10, busy 6); rank 1 computes 3-5 and 5-8
    (span 5, busy 5) and sends 8-9.5, which is no compute. Step 1: both ranks compute 20-26 without a gap."""
    rows = [
        # step, rank, stage, mb, kind, start, end
        (0, 0, 0, 0, "F", 0.0, 2.0),
        (0, 1, 1, 0, "F", 3.0, 5.0),
        (0, 1, 1, 0, "B", 5.0, 8.0),
        (0, 1, 1, 0, "SEND_B", 8.0, 9.5),
        (0, 0, 0, 0, "B", 6.0, 10.0),
        (1, 0, 0, 0, "F", 20.0, 22.0),
        (1, 0, 0, 0, "B", 22.0, 26.0),
        (1, 1, 1, 0, "F", 20.0, 23.0),
        (1, 1, 1, 0, "B", 23.0, 26.0),
    ]
    return Timeline(pd.DataFrame(rows, columns=COLUMNS), source="measured", meta={"P": 2})


def test_longest_rank_span_against_the_busiest_rank_mean_over_steps():
    tl = two_steps()
    # step 0: cost = rank 0's span 10, ideal = its 6 busy ms -> 0.4; step 1: 0
    assert tl.rank_span_bubble_rate == pytest.approx((0.4 + 0.0) / 2)
    # bubble_ratio takes each rank's idle share of the whole step: step 0 (4/10 + 5/10) / 2, step 1 nothing
    assert tl.bubble_ratio == pytest.approx((0.45 + 0.0) / 2)


def test_a_rank_waiting_before_its_first_action_is_no_bubble():
    """1F1B with equal stages: every rank but the first starts late and ends early, so the whole step's bubble ratio
    counts it, the first rank's own span alone counts here: (P-1)(F+B) idle of (m+P-1)(F+B) on rank 0 all the same."""
    tl = simulate(pd.DataFrame({"fwd_ms": [1.0] * 4, "bwd_ms": [2.0] * 4}), 8, "1F1B")
    assert tl.rank_span_bubble_rate == pytest.approx(3 / 11)
    shifted = tl.df.assign(
        start_ms=tl.df["start_ms"] + tl.df["rank"] * 100.0, end_ms=tl.df["end_ms"] + tl.df["rank"] * 100.0
    )
    later = Timeline(shifted, meta=tl.meta)  # each rank's span kept, the step's stretched by 300 ms
    assert later.rank_span_bubble_rate == pytest.approx(3 / 11)
    assert later.bubble_ratio > tl.bubble_ratio


def test_with_replicas_the_longest_span_and_the_most_compute_of_any_device_count():
    step_0 = two_steps().df.query("step == 0")
    rows = [(0, 0, 0, 0, "F", 0.0, 9.0), (0, 1, 1, 0, "F", 0.0, 1.0), (0, 1, 1, 0, "B", 11.0, 12.0)]
    other = pd.DataFrame(rows, columns=COLUMNS).assign(replica=1)
    tl = Timeline(pd.concat([step_0, other]), source="measured", meta={"P": 2})
    # the longest span is replica 1's rank 1 (0-12), the most compute replica 1's rank 0 (9 ms)
    assert tl.rank_span_bubble_rate == pytest.approx((12 - 9) / 12)
