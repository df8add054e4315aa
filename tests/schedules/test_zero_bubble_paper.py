"""Zero Bubble schedules (Qi et al., ICLR 2024): ZB-H2's drawn order, the heuristic's memory limit, and the paper's
Table 5 bubble rates reproduced from its profiled times through profile -> partition -> schedule -> simulator."""

from functools import cache

import pandas as pd
import pytest

import pipeswift_lab as psl
from pipeswift_lab import Partition, Profile
from pipeswift_lab.core.link import Link
from pipeswift_lab.core.schedule import Schedule
from pipeswift_lab.core.schedule_cells import cell
from pipeswift_lab.data.files import data_path
from pipeswift_lab.schedules.zero_bubble_paper import stage_times, zb_h2, zero_bubble

TABLES = pd.read_csv(data_path("zero_bubble_tables.csv"))


def one_layer_per_stage(fwd_ms, igrad_ms, wgrad_ms, output_bytes=0.0):
    """A Partition of one synthetic layer per stage: backward = I + W, of which W is the weight gradient."""
    n = len(fwd_ms)
    profile = Profile.synthetic(
        fwd_ms=fwd_ms,
        bwd_ms=[i + w for i, w in zip(igrad_ms, wgrad_ms)],
        wgrad_ms=wgrad_ms,
        output_bytes=output_bytes,
    )
    return Partition.from_bounds(profile, [(s, s + 1) for s in range(n)])


def simulated(schedule, part, link=None):
    """The Timeline of ``schedule`` on ``part``: the simulator replaying the order, as for a named schedule."""
    return psl.simulate(part, schedule.m, schedule, link=link)


def inflight(order, share=1.0):
    """The peak activations a rank holds over its order, in micro-batches: +1 at F, -(1 - share) at I, -share at
    W (share 1: forwards done minus weight gradients done)."""
    delta = {"F": 1.0, "I": share - 1.0, "B": -1.0, "W": -share}
    held = peak = 0.0
    for kind, _, _ in order:
        held += delta[kind]
        peak = max(peak, held)
    return peak


# ---------------------------------------------------------------- ZB-H2
#: Figure 3 (bottom) of the paper, P=4, m=8, rank by rank (1-based micro-batches; the paper's B is our I).
FIGURE_3_ZB_H2 = [
    "F1 F2 F3 F4 F5 F6 F7 B1 W1 F8 B2 W2 B3 W3 B4 W4 B5 W5 B6 W6 B7 W7 B8 W8",
    "F1 F2 F3 F4 F5 B1 F6 B2 F7 B3 W1 F8 B4 W2 B5 W3 B6 W4 B7 W5 B8 W6 W7 W8",
    "F1 F2 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 W1 F8 B6 W2 B7 W3 B8 W4 W5 W6 W7 W8",
    "F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 W1 F8 B8 W2 W3 W4 W5 W6 W7 W8",
]


def test_zb_h2_is_the_order_of_figure_3():
    sch = zb_h2(4, 8)
    drawn = [[f"{'I' if c[0] == 'B' else c[0]}{int(c[1:]) - 1}" for c in row.split()] for row in FIGURE_3_ZB_H2]
    assert [[cell(a)[1:] for a in row] for row in sch.actions] == drawn
    assert [{s for _, s, _ in row} for row in sch.actions] == [{0}, {1}, {2}, {3}]
    assert (sch.name, sch.P, sch.m, sch.shape, sch.splits_backward) == ("ZB-H2", 4, 8, "loop", True)


@pytest.mark.parametrize("P,m", [(1, 1), (2, 3), (4, 7), (4, 20), (8, 15), (8, 24)])
def test_zb_h2_holds_2p_minus_1_micro_batches_on_the_first_stage(P, m):
    sch = zb_h2(P, m)
    assert [inflight(row) for row in sch.actions] == [2 * P - 1] * P  # forwards done minus weight gradients done
    # Section 2.3: rank r holds (2P - 2r - 1) M_B + 2r M_W, the most on the first stage as W keeps less than B
    assert [inflight(row, share=0.5) for row in sch.actions] == [2 * P - 1 - r for r in range(P)]
    part = one_layer_per_stage([1.0] * P, [1.0] * P, [1.0] * P)
    assert simulated(sch, part).peak_inflight.tolist()[0] == 2 * P - 1


@pytest.mark.parametrize("P,m", [(2, 3), (4, 8), (6, 20)])
def test_zb_h2_leaves_no_bubble_in_any_rank_span_with_equal_times(P, m):
    """Table 2: ZB-H2's bubble is (p-1)(T_F + T_B - 2 T_W), zero when the three are equal (and no transfer time)."""
    part = one_layer_per_stage([2.0] * P, [2.0] * P, [2.0] * P)
    tl = simulated(zb_h2(P, m), part)
    assert tl.rank_span_bubble_rate == 0.0


def test_zb_h2_refuses_too_few_micro_batches_and_bad_arguments():
    with pytest.raises(ValueError, match=r"zb_h2 needs m >= 2P - 1 = 7 micro-batches for P=4 .* got m=6"):
        zb_h2(4, 6)
    with pytest.raises(ValueError, match="P=0 is invalid"):
        zb_h2(0, 4)
    with pytest.raises(TypeError, match="m must be an integer"):
        zb_h2(4, 8.0)


# ---------------------------------------------------------------- the heuristic
UNEVEN = ([3.0, 2.0, 4.0, 2.5], [2.0, 3.0, 2.0, 3.5], [1.0, 2.5, 1.5, 2.0])


@pytest.mark.parametrize("factor", [1, 2])
@pytest.mark.parametrize("m", [3, 8, 17])
def test_zero_bubble_keeps_every_rank_within_max_inflight(factor, m):
    part = one_layer_per_stage(*UNEVEN, output_bytes=4e6)
    link = Link(latency_ms=0.2, bandwidth_GBps=10.0)
    sch = zero_bubble(part, m, link=link, max_inflight=factor * 4)
    assert (sch.name, sch.P, sch.m, sch.shape, sch.splits_backward) == (f"ZB-{factor}p", 4, m, "loop", True)
    assert max(inflight(row) for row in sch.actions) <= factor * 4
    tl = simulated(sch, part, link)
    assert tl.peak_inflight.max() <= factor * 4
    assert 0.0 <= tl.rank_span_bubble_rate < tl.bubble_ratio


def test_zero_bubble_with_the_paper_memory_share_counts_what_w_keeps():
    share = 32 * 2304 / (34 * 2304 + 5 * 24 * 1024)  # Table 1's M_W / M_B for the 1.5B model
    part = one_layer_per_stage(*UNEVEN)
    sch = zero_bubble(part, 24, max_inflight=8, w_memory_share=share)
    assert max(inflight(row, share) for row in sch.actions) <= 8 + 1e-9
    assert max(inflight(row) for row in sch.actions) > 8  # more forwards than a whole-micro-batch count admits


def test_zero_bubble_with_one_micro_batch_in_flight_runs_f_i_w_in_turn():
    sch = zero_bubble(one_layer_per_stage(*UNEVEN), 5, max_inflight=1)
    assert [inflight(row) for row in sch.actions] == [1.0] * 4
    assert [cell(a)[1:] for a in sch.actions[2]] == [f"{k}{i}" for i in range(5) for k in "FIW"]


def test_zero_bubble_default_is_zb_1p_and_stage_times_follow_the_simulator():
    part = one_layer_per_stage(*UNEVEN, output_bytes=1e6)
    assert zero_bubble(part, 8) == zero_bubble(part, 8, max_inflight=4)
    assert zero_bubble(part, 8).name == "ZB-1p"
    assert zero_bubble(part, 8, max_inflight=6).name == "ZB(max_inflight=6)"
    times = stage_times(part, Link(latency_ms=1.0, bandwidth_GBps=1.0))
    assert times.f == (3.0, 2.0, 4.0, 2.5)
    assert times.i == (0.0, 3.0, 2.0, 3.5)  # the first stage's input needs no gradient: its W is the whole backward
    assert times.w == (3.0, 2.5, 1.5, 2.0)
    assert times.transfer == (2.0, 2.0, 2.0, 1.0)  # latency + 1 MB at 1 GB/s; the last stage's output stays


def test_zero_bubble_refuses_bad_input_with_clear_errors():
    part = one_layer_per_stage(*UNEVEN)
    with pytest.raises(TypeError, match="partition must be a pipeswift_lab.Partition; got DataFrame"):
        zero_bubble(part.stage_table(), 8)
    with pytest.raises(ValueError, match="max_inflight=0.5 is invalid: .* must be >= 1"):
        zero_bubble(part, 8, max_inflight=0.5)
    with pytest.raises(ValueError, match="m=0 is invalid"):
        zero_bubble(part, 0)
    with pytest.raises(ValueError, match="w_memory_share=1.5 is invalid"):
        zero_bubble(part, 8, w_memory_share=1.5)
    with pytest.raises(TypeError, match="link must be a pipeswift_lab.Link"):
        zero_bubble(part, 8, link=0.5)
    profile = Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4)
    looped = Partition.from_bounds(profile, [(s, s + 1) for s in range(4)], v=2, schedule="Interleaved1F1B")
    with pytest.raises(ValueError, match="one stage per rank; the partition has v=2"):
        zero_bubble(looped, 8)


# ---------------------------------------------------------------- the paper's Table 5
@cache
def table_5_setting(row):
    """Row ``row`` of Table 5 as the paper computed it: ``p`` stages of equal profiled times (its appendix table of
    T_F, T_B, T_W, T_comm), a link whose transfer takes T_comm, and Table 1's M_W / M_B for the model."""
    r = TABLES.iloc[row]
    p = int(r["p"])
    part = one_layer_per_stage([r["t_f_ms"]] * p, [r["t_b_ms"]] * p, [r["t_w_ms"]] * p)
    link = Link(latency_ms=float(r["t_comm_ms"]), bandwidth_GBps=1.0)  # no bytes cross: a transfer takes T_comm
    share = 32 * r["hidden"] / (34 * r["hidden"] + 5 * r["heads"] * r["seq_len"])
    return r, part, link, share


@pytest.mark.parametrize("row", range(12), ids=[f"{r.model}-m{r.m}" for r in TABLES.itertuples()])
def test_table_5_bubble_rates_are_reproduced_to_the_printed_decimals(row):
    r, part, link, share = table_5_setting(row)
    p, m = int(r["p"]), int(r["m"])
    schedules = {
        "bubble_zb_h2": zb_h2(p, m),
        "bubble_zb_1p": zero_bubble(part, m, link=link, max_inflight=p, w_memory_share=share),
        "bubble_zb_2p": zero_bubble(part, m, link=link, max_inflight=2 * p, w_memory_share=share),
        "bubble_1f1b": Schedule.of("1F1B", p, m),
    }
    got = {col: round(simulated(sch, part, link).rank_span_bubble_rate, 4) for col, sch in schedules.items()}
    assert got == {col: r[col] for col in schedules}
