"""A user's schedule: parsed from torch's CSV, checked whole before anything runs, and equal to the built-in schedules
where it is one of them."""

import numpy as np
import pytest

import pipeswift_lab as psl
from pipeswift_lab import Schedule, ScheduleDeadlock
from pipeswift_lab.core.analytic import inflight_microbatches
from pipeswift_lab.core.link import Link
from pipeswift_lab.core.schedule_orders import compute_orders
from pipeswift_lab.core.vocabulary import SCHEDULES, accepts

#: ZB-H1 on two ranks and four micro-batches, written by hand (Qi et al. 2024, Figure 3 top)
ZB_H1 = """0F0,0F1,0I0,0F2,0I1,0F3,0I2,0W0,0I3,0W1,0W2,0W3
1F0,1I0,1F1,1I1,1W0,1F2,1I2,1W1,1F3,1I3,1W2,1W3
"""
SHAPES = [(2, 4, 1), (4, 8, 1), (4, 8, 2), (3, 6, 2)]


def profile(layers=16):
    rng = np.random.default_rng(0)
    return psl.Profile.synthetic(
        fwd_ms=rng.uniform(1, 3, layers),
        bwd_ms=rng.uniform(2, 6, layers),
        output_bytes=1e6,
        activation_bytes=1e7,
        param_bytes=1e6,
    )


def test_a_csv_reads_torch_s_cells_and_writes_them_back(tmp_path):
    sch = Schedule.from_csv(ZB_H1, name="ZB-H1 by hand")
    assert (sch.P, sch.S, sch.m, sch.v, sch.shape) == (2, 2, 4, 1, "loop")
    assert sch.splits_backward and sch.placement == (0, 1)
    assert sch.actions[1][:3] == (("F", 1, 0), ("I", 1, 0), ("F", 1, 1))
    assert sch.to_csv() == ZB_H1
    path = tmp_path / "zb_h1.csv"
    sch.to_csv(path)
    again = Schedule.from_csv(path)
    assert again == sch and again.name == "zb_h1"
    assert Schedule.from_csv(str(path)) == sch
    assert list(sch.frame().iloc[0, :3]) == ["0F0", "0F1", "0I0"]


def test_from_lists_takes_cells_tuples_and_a_mapping_by_rank():
    by_cells = Schedule.from_lists({0: ["0F0", "0B0"], 1: ["1F0", "1B0"]})
    by_tuples = Schedule.from_lists([[("F", 0, 0), ("B", 0, 0)], [("F", 1, 0), ("B", 1, 0)]])
    assert by_cells == by_tuples and by_cells.orders() == {0: [("F", 0, 0), ("B", 0, 0)], 1: [("F", 1, 0), ("B", 1, 0)]}


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_built_in_schedule_is_its_torch_order_and_simulates_as_its_name_does(name):
    prof = profile()
    for P, m, v in SHAPES:
        if not accepts(P, m, name, v):
            continue
        sch = Schedule.of(name, P, m, v)
        assert sch.orders() == compute_orders(P, m, name, v)
        assert Schedule.from_csv(sch.to_csv()) == sch  # DualPipeV's OVERLAP_F_B cells included
        assert inflight_microbatches(P, m, sch, v=v) == inflight_microbatches(P, m, name, v=v)
        part = psl.partition(prof, P, v=v, schedule=name, m=m)
        links = [None] if name in ("1F1B", "GPipe") else [None, Link(latency_ms=0.3, bandwidth_GBps=10)]
        for link in links:
            named, listed = psl.simulate(part, m, name, link=link), psl.simulate(part, m, sch, link=link)
            assert listed.df[["rank", "kind", "stage", "microbatch", "start_ms", "end_ms"]].equals(
                named.df[["rank", "kind", "stage", "microbatch", "start_ms", "end_ms"]]
            )


def test_1f1b_as_lists_runs_on_the_runtime_whose_sends_do_not_block():
    """torch's Schedule1F1B waits for each send with the next receive; the same order handed to
    _PipelineScheduleRuntime does not, so with a link the listed order is never slower."""
    part = psl.partition(profile(), 4, schedule="1F1B", m=8)
    link = Link(latency_ms=0.3, bandwidth_GBps=10)
    named = psl.simulate(part, 8, "1F1B", link=link).step_ms
    listed = psl.simulate(part, 8, Schedule.of("1F1B", 4, 8), link=link).step_ms
    assert listed < named


def test_the_memory_model_follows_the_order_s_in_flight_activations():
    prof = profile()
    sch = Schedule.from_csv(ZB_H1)
    part = psl.partition(prof, 2, schedule=sch, m=4)
    # rank 0 holds micro-batches 0..3 at once: the Is release nothing, the first W comes after the last F
    assert inflight_microbatches(2, 4, sch) == [4.0, 2.0]
    memory = part.memory()
    assert memory.loc[0, "peak_at"] == "W stage 0 mb 0"  # all four held when the first W runs
    one_f_one_b = psl.partition(prof, 2, schedule="1F1B", m=4).memory()
    # the same stages hold two micro-batches more on rank 0 than under 1F1B (4 against 2)
    extra = memory.loc[0, "activations_bytes"] - one_f_one_b.loc[0, "activations_bytes"]
    assert extra == pytest.approx(2 * part.stage_activation_bytes[0], rel=0.02)


@pytest.mark.parametrize(
    "text, message",
    [
        ("0F0,0B0\n1F0,1B0,xx", r"row 2 \(rank 1\), column 3: 'xx'"),
        ("0F0,0B0,0F1\n1F0,1B0,1F1,1B1", "0B1 is missing"),
        ("0F0,0B0,0F0\n1F0,1B0", "0F0 appears twice"),
        ("0F0,0I0\n1F0,1B0", "the I 0I0 has no W"),
        ("0F0,0W0\n1F0,1B0", "the W 0W0 has no I"),
        ("0F0,0B0,0I0,0W0\n1F0,1B0", "both a full backward"),
        ("0F0,0B0,1F0,1B0\n2F0,2B0", "every rank must hold the same number"),
        ("0F0,1F0,0B0\n1B0", "stage 1 runs on rank 0 and on rank 1"),
    ],
)
def test_bad_orders_are_refused_naming_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        Schedule.from_csv(text)


def test_an_order_that_cannot_finish_names_the_rank_and_what_it_waits_for():
    crossed = (
        r"rank 0 waits forever at position 1, action 0B0, for the backward of stage 1, micro-batch 0 "
        r"\(on rank 1, which itself waits at position 0, action 1F1\)"
    )
    with pytest.raises(ScheduleDeadlock, match=crossed):
        Schedule.from_lists({0: ["0F0", "0B0", "0F1", "0B1"], 1: ["1F1", "1B1", "1F0", "1B0"]})
    with pytest.raises(
        ScheduleDeadlock, match=r"rank 0 waits forever at position 0, action 0B0, for 0F0 \(which comes"
    ):
        Schedule.from_lists({0: ["0B0", "0F0"], 1: ["1F0", "1B0"]})


def test_a_schedule_that_does_not_fit_the_partition_is_refused():
    prof = profile()
    loop = psl.partition(prof, 2, v=2, schedule="Interleaved1F1B", m=4)
    zbv = Schedule.of("ZBVZeroBubble", 2, 4, 2)
    with pytest.raises(ValueError, match=r"runs its stages on ranks \[0, 1, 1, 0\] \(v shape\) but the partition"):
        psl.simulate(loop, 4, zbv)
    with pytest.raises(ValueError, match="P=2 ranks with 1 stage"):
        psl.simulate(loop, 4, Schedule.from_csv(ZB_H1))
    one = psl.partition(prof, 2, schedule="1F1B", m=4)
    with pytest.raises(ValueError, match=r"m=4 \(the run has 8\)"):
        psl.simulate(one, 8, Schedule.from_csv(ZB_H1))
    v_part = psl.partition(prof, 2, v=2, schedule=zbv, m=4)
    assert v_part.stage_to_rank == (0, 1, 1, 0)
    assert psl.simulate(v_part, 4, zbv).step_ms == psl.simulate(v_part, 4, "ZBVZeroBubble").step_ms


def test_a_file_that_is_not_there_is_named():
    with pytest.raises(FileNotFoundError, match="no schedule file 'nowhere.csv'"):
        Schedule.from_csv("nowhere.csv")


def test_torchtitan_reads_the_csv_with_the_schedule_name_that_places_its_stages(tmp_path):
    settings = Schedule.from_csv(ZB_H1).to_torchtitan(tmp_path / "zb_h1.csv")
    assert settings == {
        "pipeline_parallel_degree": 2,
        "pipeline_parallel_schedule": "1F1B",
        "pipeline_parallel_schedule_csv": str(tmp_path / "zb_h1.csv"),
        "num_pp_microbatches": 4,
    }
    assert (tmp_path / "zb_h1.csv").read_text() == ZB_H1
    assert psl.schedules.v_half(4, 8).torchtitan_schedule == "ZBVZeroBubble"
    assert Schedule.of("InterleavedZeroBubble", 2, 4, 2).torchtitan_schedule == "Interleaved1F1B"
    odd = Schedule.from_lists({0: ["0F0", "1F0", "1B0", "0B0"], 1: ["2F0", "3F0", "3B0", "2B0"]})
    with pytest.raises(ValueError, match="torchtitan places them in a loop"):
        odd.to_torchtitan(tmp_path / "odd.csv")
