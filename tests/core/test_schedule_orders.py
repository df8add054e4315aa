"""Orders are checked against torch itself: its runtime loops run here with recording stages."""

import logging

import pytest
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping, generate_stage_to_rank_mapping

from pipeswift_lab.core.schedule_orders import _TORCH_CLASS, action_groups, compute_orders, torch_schedule
from pipeswift_lab.core.vocabulary import MULTI_CHUNK_SCHEDULES, SCHEDULES, stage_to_rank, validate

logging.getLogger("torch.distributed.pipelining.schedules").setLevel(logging.ERROR)


class RecordingStage:
    """What torch's runtime loops call on a stage, recording compute calls; no process group, no tensors."""

    def __init__(self, stage_index, num_stages, log, group_rank, group_size):
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.group_rank, self.group_size = group_rank, group_size
        self.submod = None
        self.stage_index_to_group_rank = None
        self.log = log

    def get_fwd_recv_ops(self, i):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, i, *args, **kwargs):
        self.log.append(("F", self.stage_index, i))

    def backward_one_chunk(self, i, loss=None, full_backward=True, last_backward=False):
        self.log.append(("B" if full_backward else "I", self.stage_index, i))

    def backward_weight_one_chunk(self, i, last_backward=False):
        self.log.append(("W", self.stage_index, i))

    def set_local_fwd_input(self, *args):
        pass

    def get_local_bwd_output(self, i):
        return None

    set_local_bwd_input = perform_reduce_grad = clear_runtime_states = set_local_fwd_input


def runtime_order_single(cls, P, m):
    """Run torch's ``_step_microbatches`` of a single-stage schedule on every rank and record it."""
    runner = type("Recording" + cls.__name__, (cls,), {"_initialize_stage": lambda self, *a, **k: None})
    out = {}
    for rank in range(P):
        log = []
        runner(RecordingStage(rank, P, log, rank, P), m)._step_microbatches()
        out[rank] = log
    return out


def runtime_order_multi(schedule, P, m, v):
    """Run torch's ``_PipelineScheduleRuntime._step_microbatches`` on every rank and record it."""
    cls = getattr(torch_schedules, _TORCH_CLASS[schedule])
    runner = type("Recording" + cls.__name__, (cls,), {"_initialize_stages": lambda self, *a, **k: None})
    rank_to_stages = generate_rank_to_stage_mapping(
        P, P * v, style="v" if schedule in ("ZBVZeroBubble", "DualPipeV") else "loop"
    )
    out = {}
    for rank in range(P):
        log = []
        runner([RecordingStage(s, P * v, log, rank, P) for s in rank_to_stages[rank]], m)._step_microbatches()
        out[rank] = log
    return out


@pytest.mark.parametrize("P, m", [(1, 3), (2, 2), (3, 5), (4, 8), (4, 11)])
@pytest.mark.parametrize(
    "schedule, cls", [("GPipe", torch_schedules.ScheduleGPipe), ("1F1B", torch_schedules.Schedule1F1B)]
)
def test_single_stage_orders_are_the_runtime_loops(schedule, cls, P, m):
    assert compute_orders(P, m, schedule) == runtime_order_single(cls, P, m)


def _multi_cases():
    cases = []
    for schedule in MULTI_CHUNK_SCHEDULES:
        for P, m, v in [
            (2, 4, 2),
            (3, 6, 2),
            (4, 8, 2),
            (4, 12, 2),
            (2, 6, 3),
            (4, 8, 1),
            (3, 3, 2),
            (4, 2, 2),
            (2, 5, 2),
        ]:
            v = 2 if schedule in ("ZBVZeroBubble", "DualPipeV") else v
            try:
                validate(P, m, schedule, v)
            except ValueError:
                continue  # refusals are covered by test_validate_applies_torchs_own_rules
            cases.append((schedule, P, m, v))
    return sorted(set(cases))


@pytest.mark.parametrize("schedule, P, m, v", _multi_cases())
def test_multi_chunk_orders_are_what_torchs_runtime_executes(schedule, P, m, v):
    assert compute_orders(P, m, schedule, v) == runtime_order_multi(schedule, P, m, v)


def test_the_visualizer_trap_1f1b_last_rank():
    """torch's visualizer (pipeline_order) shows a different 1F1B than the runtime runs."""
    ours = compute_orders(4, 8, "1F1B")
    assert [a[0] for a in ours[3][:4]] == ["F", "B", "F", "B"]  # the runtime: one warm-up forward on the last rank
    assert ours[0][:5] == [("F", 0, i) for i in range(4)] + [("B", 0, 0)]  # P - rank warm-up forwards
    for rank in range(4):
        assert sum(1 for k, _, _ in ours[rank][: 4 - rank] if k == "F") == 4 - rank
    viz = [str(a) for a in get_schedule_ops("1F1B", 4, 8)[3] if a is not None and a.computation_type.value in "FB"]
    assert viz[:2] == ["3F1", "3B0"]  # the visualizer's last rank starts at micro-batch 1
    assert viz[:2] != ["3F0", "3B0"]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_action_runs_exactly_once_on_its_stages_rank(schedule):
    P, m = 3, 6
    v = 1 if schedule in ("GPipe", "1F1B") else 2
    orders = compute_orders(P, m, schedule, v)
    placement = stage_to_rank(P, v, schedule)
    seen = {}
    for rank, actions in orders.items():
        for kind, s, i in actions:
            assert placement[s] == rank
            seen[(kind, s, i)] = seen.get((kind, s, i), 0) + 1
    assert set(seen.values()) == {1}
    for s in range(P * v):
        for i in range(m):
            assert ("F", s, i) in seen
            assert (("B", s, i) in seen) != (("I", s, i) in seen and ("W", s, i) in seen)


def test_dualpipev_overlapped_actions_are_forward_then_backward():
    groups = action_groups(2, 8, "DualPipeV", 2)
    overlapped = [g for rank in groups for g in rank if len(g) == 2]
    assert overlapped, "DualPipeV's steady state overlaps a forward with a backward"
    for (k1, s1, _), (k2, s2, _) in overlapped:
        assert (k1, k2) == ("F", "B") and s1 != s2
    flat = compute_orders(2, 8, "DualPipeV", 2)
    assert sum(len(g) for g in groups[0]) == len(flat[0])


def test_stage_placement():
    assert stage_to_rank(4, 1) == (0, 1, 2, 3)
    assert stage_to_rank(3, 2, "Interleaved1F1B") == (0, 1, 2, 0, 1, 2)
    assert stage_to_rank(3, 2, "ZBVZeroBubble") == (0, 1, 2, 2, 1, 0)
    assert stage_to_rank(3, 2, "DualPipeV") == tuple(
        generate_stage_to_rank_mapping(3, 6, style="v")[s] for s in range(6)
    )


def _torch_accepts(schedule, P, m, v):
    if schedule in MULTI_CHUNK_SCHEDULES:
        try:
            torch_schedule(P, m, schedule, v, lowered=True)
            return True
        except ValueError:
            return False
    cls = torch_schedules.Schedule1F1B if schedule == "1F1B" else torch_schedules.ScheduleGPipe
    try:
        cls(RecordingStage(0, P, [], 0, P), m)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_validate_applies_torchs_own_rules(schedule):
    vs = [1] if schedule in ("GPipe", "1F1B") else [2] if schedule in ("ZBVZeroBubble", "DualPipeV") else [1, 2, 3]
    for P in range(1, 6):
        for v in vs:
            for m in range(1, 14):
                try:
                    validate(P, m, schedule, v)
                    ours = True
                except ValueError:
                    ours = False
                assert ours == _torch_accepts(schedule, P, m, v), (schedule, P, m, v)


@pytest.mark.parametrize(
    "args, words",
    [
        ((4, 3, "1F1B", 1), r"P=4, m=3, v=1.*m >= P"),
        ((4, 9, "Interleaved1F1B", 2), r"P=4, m=9, v=2.*rounds.*8 and 10"),
        ((3, 5, "DualPipeV", 2), r"P=3, m=5, v=2.*m >= 2\*P = 6"),
        ((3, 6, "ZBVZeroBubble", 3), r"v=3 is not allowed"),
        ((3, 6, "GPipe", 2), r"v=2 is not allowed"),
        ((0, 6, "GPipe", 1), r"P=0"),
        ((2, 0, "GPipe", 1), r"m=0"),
        ((2, 4, "Zigzag", 1), r"schedule='Zigzag' is not known"),
    ],
)
def test_bad_combinations_name_P_m_v(args, words):
    with pytest.raises(ValueError, match=words):
        compute_orders(*args)


def test_schedule_names_are_case_insensitive():
    assert compute_orders(2, 4, "interleaved1f1b", 2) == compute_orders(2, 4, "Interleaved1F1B", 2)
    assert compute_orders(2, 2, "gpipe") == compute_orders(2, 2, "GPipe")


def test_orders_are_cached_and_every_call_gets_lists_of_its_own():
    first = compute_orders(3, 6, "Interleaved1F1B", 2)
    first[0].clear()
    first[1].append(("F", 99, 99))
    again = compute_orders(3, 6, "Interleaved1F1B", 2)
    assert len(again[0]) == len(again[2]) == 2 * 2 * 6 and ("F", 99, 99) not in again[1]
    assert again[1] is not compute_orders(3, 6, "Interleaved1F1B", 2)[1]
