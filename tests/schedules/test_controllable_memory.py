"""V-Half and V-Min (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024, arXiv:2405.15362).

Every claim is checked on the Timeline the simulator replays, with unit pass times (F = I = W = 1 per chunk, the
paper's setting) and equal activation bytes per layer, so a chunk holds half of what a 1F1B stage holds:

* valid V-shaped schedules with split backwards, for several (P, m);
* the authors' memory bounds (their table: per rank, in micro-batches of a 1F1B stage, 1F1B ``P``, V-Half
  ``(P+2)//2``, V-Min ``(P+4)//3``), as peaks of in-flight activations and of activation bytes against 1F1B's;
* bubbles in the paper's order on unit times: V-Min > V-Half > ZB-V;
* the orders of the authors' implementation for small cases (sail-sg/zero-bubble-pipeline-parallelism,
  megatron/core/pipeline_parallel/zerobubble/scheduler/zbv_greedy.py, as its Megatron runtime calls it);
* bad input refused.
"""

import pytest

import pipeswift_lab as psl
from pipeswift_lab.core.schedule import Schedule
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.schedules.controllable_memory import v_half, v_min
from pipeswift_lab.simulation.timeline import Timeline

LAYER_BYTES = 1000.0  # activation bytes of one layer (one V chunk); a 1F1B stage holds two layers
GENERATORS = {"V-Half": v_half, "V-Min": v_min}


def paper_bound(name, P):
    """Peak micro-batches of activations per rank (in 1F1B stages' worth), from the authors' table."""
    return {"V-Half": (P + 2) // 2, "V-Min": (P + 4) // 3, "1F1B": P}[name]


def unit_partition(P, v):
    """A 2P-layer model with unit pass times per layer (fwd 1, input grad 1, weight grad 1), split for ``v``."""
    L = 2 * P
    profile = Profile.synthetic(
        fwd_ms=[1.0] * L, bwd_ms=[2.0] * L, wgrad_ms=1.0, activation_bytes=LAYER_BYTES, output_bytes=1.0
    )
    if v == 1:
        return partition(profile, P, "uniform")
    return partition(profile, P, "uniform", v=2, schedule="ZBVZeroBubble")


def simulated(part, schedule: Schedule) -> Timeline:
    """The schedule replayed on the partition's stages by the simulator, as a named schedule is."""
    return psl.simulate(part, schedule.m, schedule)


# ---------------------------------------------------------------------------------------------- shape
@pytest.mark.parametrize("name", GENERATORS)
@pytest.mark.parametrize("P, m", [(2, 1), (2, 7), (3, 2), (3, 8), (4, 4), (4, 9), (5, 3), (5, 10), (6, 6), (6, 13)])
def test_generators_give_valid_v_shaped_schedules_with_split_backwards(name, P, m):
    # Schedule.from_lists checked it: every action once, each I with its W, each stage on one rank, no deadlock
    schedule = GENERATORS[name](P, m)
    assert isinstance(schedule, Schedule)
    assert (schedule.name, schedule.P, schedule.S, schedule.m, schedule.v) == (name, P, 2 * P, m, 2)
    assert schedule.shape == "v"
    assert {kind for row in schedule.actions for kind, _, _ in row} == {"F", "I", "W"}
    assert all(len(row) == 6 * m for row in schedule.actions)  # 2 chunks x (F, I, W) per micro-batch on every rank
    assert GENERATORS[name](P, m) == schedule  # deterministic


# ---------------------------------------------------------------------------------------------- memory
@pytest.mark.parametrize("name", GENERATORS)
@pytest.mark.parametrize("P, m", [(2, 8), (3, 9), (4, 4), (4, 12), (5, 10), (6, 12), (7, 7)])
def test_peak_activations_meet_the_papers_bound_against_1f1b(name, P, m):
    timeline = simulated(unit_partition(P, 2), GENERATORS[name](P, m))
    baseline = simulated(unit_partition(P, 1), Schedule.of("1F1B", P, m))
    stage_bytes = 2 * LAYER_BYTES  # one micro-batch on one 1F1B stage
    assert baseline.peak_inflight.max() == paper_bound("1F1B", P)
    assert baseline.peak_activation_bytes.max() == P * stage_bytes
    bound = paper_bound(name, P)
    assert timeline.peak_inflight.max() == min(m, bound)  # the bound is reached: no looser than the paper says
    assert (timeline.peak_inflight <= bound).all()
    assert timeline.peak_activation_bytes.max() <= bound * stage_bytes
    assert timeline.peak_activation_bytes.max() <= bound / P * baseline.peak_activation_bytes.max()


@pytest.mark.parametrize("name", GENERATORS)
@pytest.mark.parametrize("P, m", [(6, 2), (8, 3)])
def test_fewer_microbatches_than_the_bound_are_all_in_flight_at_once(name, P, m):
    assert m < paper_bound(name, P)
    assert simulated(unit_partition(P, 2), GENERATORS[name](P, m)).peak_inflight.max() == m


# ---------------------------------------------------------------------------------------------- bubble
@pytest.mark.parametrize("P, m", [(4, 8), (4, 16), (6, 12)])
def test_bubbles_rank_as_the_paper_reports_on_unit_times(P, m):
    part = unit_partition(P, 2)
    bubble = {name: simulated(part, make(P, m)).bubble_ratio for name, make in GENERATORS.items()}
    zbv = simulated(part, Schedule.of("ZBVZeroBubble", P, m, 2)).bubble_ratio
    one_f_one_b = simulated(unit_partition(P, 1), Schedule.of("1F1B", P, m)).bubble_ratio
    assert one_f_one_b == pytest.approx((P - 1) / (m + P - 1))
    assert one_f_one_b > bubble["V-Min"] > bubble["V-Half"] > zbv
    assert bubble["V-Half"] <= one_f_one_b / 2  # the authors' table: V-Half B/2, V-Min 2B/3 + overhead


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("make", GENERATORS.values())
@pytest.mark.parametrize(
    "P, m, error, words",
    [
        (1, 4, ValueError, "P=1"),
        (0, 4, ValueError, "P=0"),
        (3, 0, ValueError, "m=0"),
        (3, -2, ValueError, "m=-2"),
        (2.0, 4, TypeError, "P must be an integer"),
        (4, True, TypeError, "m must be an integer"),
    ],
)
def test_bad_input_is_refused_naming_the_argument(make, P, m, error, words):
    with pytest.raises(error, match=words):
        make(P, m)


# ---------------------------------------------------------------------------------------------- faithfulness
# The authors' orders, from their zbv_greedy.PipelineGraph(P, m, "half" | "min", 1000, 1000, 1000, 1) (its
# schedule_from_pattern's stage order, B/b read as I, W/w as W, chunk 1 as stage 2P-1-rank), written as torch's CSV.
# The four cases cover both offsets of each block (P even and odd for V-Half, P a multiple of 3 or not for V-Min).
REFERENCE = {
    ("V-Half", 3, 3): """\
0F0,0F1,0F2,5F0,5I0,5W0,5F1,5I1,5W1,0I0,0W0,5F2,5I2,0I1,5W2,0W1,0I2,0W2
1F0,1F1,4F0,4F1,4I0,4W0,1F2,4I1,1I0,4W1,1W0,4F2,1I1,4I2,4W2,1W1,1I2,1W2
2F0,3F0,2F1,3F1,3I0,3W0,2I0,2W0,2F2,3F2,3I1,2I1,3W1,2W1,3I2,2I2,3W2,2W2
""",
    ("V-Half", 4, 4): """\
0F0,0F1,0F2,0F3,7F0,7I0,7W0,7F1,7I1,7W1,7F2,0I0,7I2,7W2,7F3,0W0,0I1,7I3,7W3,0W1,0I2,0W2,0I3,0W3
1F0,1F1,1F2,1F3,6F0,6F1,6I0,6W0,6F2,6I1,6W1,1I0,1W0,6F3,6I2,6W2,1I1,1W1,6I3,6W3,1I2,1W2,1I3,1W3
2F0,2F1,2F2,5F0,5F1,5F2,5I0,5W0,2F3,5I1,2I0,5W1,2W0,5F3,2I1,5I2,5W2,2W1,2I2,5I3,5W3,2W2,2I3,2W3
3F0,4F0,3F1,4F1,3F2,4F2,4I0,4W0,3I0,3W0,3F3,4F3,4I1,4W1,3I1,3W1,4I2,4W2,3I2,3W2,4I3,4W3,3I3,3W3
""",
    ("V-Min", 3, 3): """\
0F0,0F1,0F2,5F0,5I0,5W0,5F1,5I1,5W1,0I0,0W0,5F2,0I1,5I2,5W2,0W1,0I2,0W2
1F0,1F1,4F0,4F1,4I0,4W0,1I0,1W0,4I1,1F2,4W1,4F2,1I1,1W1,4I2,4W2,1I2,1W2
2F0,3F0,2F1,3F1,3I0,2I0,3W0,2W0,3I1,2F2,3F2,2I1,3W1,2W1,3I2,2I2,3W2,2W2
""",
    ("V-Min", 4, 4): """\
0F0,0F1,0F2,7F0,7I0,7W0,7F1,7I1,7W1,0I0,0W0,0F3,7F2,7I2,0I1,7W2,0W1,7F3,7I3,0I2,7W3,0W2,0I3,0W3
1F0,1F1,6F0,6F1,6I0,6W0,1F2,1I0,6I1,6W1,1W0,6F2,1F3,1I1,6I2,6W2,1W1,6F3,1I2,6I3,6W3,1W2,1I3,1W3
2F0,2F1,5F0,5F1,5I0,5W0,2F2,2I0,2W0,5I1,5F2,5W1,2I1,2F3,2W1,5I2,5F3,5W2,2I2,2W2,5I3,5W3,2I3,2W3
3F0,4F0,3F1,4F1,4I0,3I0,4W0,3W0,3F2,4F2,4I1,3I1,4W1,3W1,3F3,4F3,4I2,3I2,4W2,3W2,4I3,3I3,4W3,3W3
""",
}


@pytest.mark.parametrize("name, P, m", list(REFERENCE))
def test_orders_are_those_of_the_authors_implementation(name, P, m):
    assert GENERATORS[name](P, m).to_csv() == REFERENCE[name, P, m]
