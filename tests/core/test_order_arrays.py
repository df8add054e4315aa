"""The orders' formulas against torch's own schedule classes, action by action."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeswift_lab.core.order_arrays import OrderArrays, formulas_agree, from_orders, order_arrays
from pipeswift_lab.core.schedule_orders import compute_orders
from pipeswift_lab.core.vocabulary import COMPUTE_KINDS, SCHEDULES, SINGLE_CHUNK_SCHEDULES, V_SHAPE_SCHEDULES, accepts


def chunk_counts(schedule):
    """The ``v`` a schedule takes here: 1, exactly 2 (a V), or 1 to 4."""
    if schedule in SINGLE_CHUNK_SCHEDULES:
        return [1]
    return [2] if schedule in V_SHAPE_SCHEDULES else [1, 2, 3, 4]


GRID = [
    (schedule, P, m, v)
    for schedule in SCHEDULES
    for P in range(1, 6)
    for m in (1, 2, 3, 4, 5, 6, 8, 9, 10, 12, 16)
    for v in chunk_counts(schedule)
    if accepts(P, m, schedule, v)
]


def assert_same_orders(got: OrderArrays, want: dict) -> None:
    assert len(want) == got.kind.shape[0]
    for rank, actions in want.items():
        assert got.actions(rank) == actions, f"rank {rank}"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_gives_torch_orders_on_a_grid(schedule):
    cases = [case for case in GRID if case[0] == schedule]
    assert len(cases) >= 20
    for _, P, m, v in cases:
        assert_same_orders(order_arrays(P, m, schedule, v), compute_orders(P, m, schedule, v))


@settings(max_examples=25, deadline=None)
@given(
    schedule=st.sampled_from(SCHEDULES),
    P=st.integers(6, 24),
    m=st.integers(1, 64),
    v=st.integers(1, 4),
)
def test_larger_pipelines_give_torch_orders(schedule, P, m, v):
    v = v if schedule not in SINGLE_CHUNK_SCHEDULES else 1
    v = 2 if schedule in V_SHAPE_SCHEDULES else v
    if not accepts(P, m, schedule, v):
        with pytest.raises(ValueError):
            order_arrays(P, m, schedule, v)
        return
    assert_same_orders(order_arrays(P, m, schedule, v), compute_orders(P, m, schedule, v))


@pytest.mark.parametrize("schedule", SINGLE_CHUNK_SCHEDULES)
def test_fewer_micro_batches_than_ranks_run_unchecked_as_compute_orders_does(schedule):
    for P, m in ((4, 1), (6, 3), (5, 2)):
        want = compute_orders(P, m, schedule, check=False)
        assert_same_orders(order_arrays(P, m, schedule, check=False), want)
    with pytest.raises(ValueError, match="m >= P"):
        order_arrays(4, 2, "1F1B")


def test_torch_refusals_are_refused():
    with pytest.raises(ValueError, match="multiple of its number of rounds"):
        order_arrays(4, 9, "Interleaved1F1B", 2)
    with pytest.raises(ValueError, match="m >= 2\\*P"):
        order_arrays(4, 6, "DualPipeV", 2)
    with pytest.raises(ValueError, match="exactly 2 stages"):
        order_arrays(4, 8, "ZBVZeroBubble", 3)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_formulas_agree_with_the_installed_torch(schedule):
    assert formulas_agree(schedule)


@pytest.mark.parametrize("schedule, P, m, v", [case for case in GRID if case[1] >= 2 and case[2] >= 4])
def test_every_micro_batch_is_forwarded_once_then_released_once(schedule, P, m, v):
    """What the peak forms' held counts rest on: each (stage, micro-batch) of a rank is forwarded once and released
    (B or W) once, after its forward; and every stage runs each micro-batch's input gradient (B or I) once."""
    orders = order_arrays(P, m, schedule, v)
    for rank in range(P):
        actions = orders.actions(rank)
        forwards = {(s, b): t for t, (k, s, b) in enumerate(actions) if k == "F"}
        releases = {(s, b): t for t, (k, s, b) in enumerate(actions) if k in ("B", "W")}
        inputs = [(s, b) for k, s, b in actions if k in ("B", "I")]
        assert len(forwards) == len(releases) == len(inputs) == m * v == sum(k == "F" for k, _, _ in actions)
        assert forwards.keys() == releases.keys() == set(inputs)
        assert all(releases[key] > forwards[key] for key in forwards)


def test_from_orders_round_trips_and_pads_the_shorter_ranks():
    orders = compute_orders(3, 8, "DualPipeV", 2)
    arrays = from_orders(orders)
    assert [arrays.actions(r) for r in range(3)] == [orders[r] for r in range(3)]
    assert len(set(arrays.length.tolist())) > 1  # DualPipeV's ranks run different counts (B or I and W)
    shortest = int(np.argmin(arrays.length))
    assert np.all(arrays.kind[shortest, arrays.length[shortest] :] == -1)
    assert set(np.unique(arrays.kind[arrays.kind >= 0])) <= set(range(len(COMPUTE_KINDS)))
