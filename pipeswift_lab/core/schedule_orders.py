"""Per-rank action orders, exactly as ``torch.distributed.pipelining`` executes them.

Every schedule is a list of compute actions per rank, each a ``(kind, stage, microbatch)``
tuple with ``kind`` one of torch's action types:

* ``F`` forward, ``B`` full backward, ``I`` input-grad ("backward input"), ``W``
  weight-grad ("backward weight"), as in torch's ``_ComputationType``;
* torch's ``OVERLAP_F_B`` action (DualPipeV's "F0B1" steps) holds a forward and a full
  backward of two different stages. torch's default runtime
  (``_PipelineScheduleRuntime._step_microbatches``) performs its sub-actions one after the
  other, so it appears here as its ``F`` followed by its ``B``; :func:`compute_orders` keeps
  that order and :func:`action_groups` keeps the grouping (the runtime sends the outputs of
  both sub-actions only after both ran).

Where the orders come from:

* ``GPipe`` and ``1F1B`` reproduce the loops of ``ScheduleGPipe._step_microbatches`` and
  ``Schedule1F1B._step_microbatches``. Their ``pipeline_order`` attribute (and the schedule
  visualizer built on it) is *not* what runs: the runtime 1F1B warms up
  ``min(m, P - rank)`` forwards, the visualizer ``P - 1 - rank``.
* The multi-chunk schedules (``Interleaved1F1B``, ``LoopedBFS``, ``InterleavedZeroBubble``,
  ``ZBVZeroBubble``, ``DualPipeV``) are instantiated from torch itself, with light stand-in
  stages that carry only the rank, the group size and the stage count (what the
  constructors read; no process group), and their ``pipeline_order`` is read. The runtime
  executes ``pipeline_order_with_comms``, whose compute actions are ``pipeline_order``'s in
  the same order; the lowering that adds communication is skipped here because it is
  quadratic in the number of actions.

References: GPipe (Huang et al., NeurIPS 2019); 1F1B (Narayanan et al., *PipeDream*,
SOSP 2019); interleaved 1F1B (Narayanan et al., SC 2021); breadth-first / looped BFS
(Lamy-Poirier, arXiv:2211.05953); zero bubble and ZB-V (Qi et al., ICLR 2024);
DualPipe (DeepSeek-AI, DeepSeek-V3 technical report, 2024).
"""

from __future__ import annotations

import logging
from functools import cache, lru_cache
from typing import Any

from .schedule import Schedule, ScheduleLike
from .vocabulary import COMPUTE_KINDS, MULTI_CHUNK_SCHEDULES, check_schedule_v, validate
from .vocabulary import TORCH_CLASS as _TORCH_CLASS

#: One compute action: ``(kind, stage, microbatch)``.
Action = tuple[str, int, int]
#: Per rank, its groups of actions (one torch action each: a single action, or an ``OVERLAP_F_B``'s two).
Groups = tuple[tuple[tuple[Action, ...], ...], ...]


def compute_orders(
    P: int, m: int, schedule: ScheduleLike = "1F1B", v: int = 1, *, check: bool = True
) -> dict[int, list[Action]]:
    """The compute actions of every rank in the order torch's runtime executes them.

    Returns ``{rank: [(kind, stage, microbatch), ...]}`` for ranks ``0..P-1``, with ``kind``
    in ``F``, ``B``, ``I``, ``W`` (DualPipeV's overlapped ``F``+``B`` actions appear as their
    two parts, forward first); a :class:`~pipeswift_lab.core.schedule.Schedule`'s own lists (which must have ``P``
    ranks, ``m`` micro-batches and ``v`` stages per rank). Raises ``ValueError`` for combinations torch refuses
    (see :func:`~pipeswift_lab.core.vocabulary.validate`); ``check=False`` skips that check where the loops run
    anyway (GPipe and 1F1B with fewer micro-batches than ranks, for a memory estimate), torch's own schedules
    raising what they refuse. The orders are cached by ``(P, m, schedule, v)``; each call returns new lists.
    """
    schedule, v = validate(P, m, schedule, v) if check else check_schedule_v(schedule, v)
    return {rank: list(actions) for rank, actions in enumerate(_orders(int(P), int(m), schedule, int(v)))}


@lru_cache(maxsize=256)
def _orders(P: int, m: int, schedule: ScheduleLike, v: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's actions, :func:`_action_groups` flattened (cached: shared tuples)."""
    return tuple(tuple(a for group in rank_groups for a in group) for rank_groups in _action_groups(P, m, schedule, v))


def builtin_groups(name: str, P: int, m: int, v: int = 1) -> tuple[str, Groups]:
    """The canonical spelling of the built-in schedule ``name`` and its :func:`action_groups` (what
    :meth:`~pipeswift_lab.core.schedule.Schedule.of` reads)."""
    name, v = validate(P, m, name, v)
    return name, _action_groups(int(P), int(m), name, int(v))


def action_groups(P: int, m: int, schedule: ScheduleLike = "1F1B", v: int = 1) -> Groups:
    """Like :func:`compute_orders` but grouped as torch schedules them, as nested tuples.

    ``result[rank]`` is a tuple of groups; a group is one torch action: a single compute
    action, or the two sub-actions of an ``OVERLAP_F_B``. The runtime fires a group's sends
    after the whole group ran. Cached: the tuples are shared, do not rely on identity.
    """
    schedule, v = validate(P, m, schedule, v)
    return _action_groups(int(P), int(m), schedule, int(v))


@lru_cache(maxsize=256)
def _action_groups(P: int, m: int, schedule: ScheduleLike, v: int) -> Groups:
    if isinstance(schedule, Schedule):
        schedule.check_fits(P, P * v, m)
        return schedule.groups
    if schedule == "GPipe":
        return tuple(_gpipe_rank(r, P, m) for r in range(P))
    if schedule == "1F1B":
        return tuple(_one_f_one_b_rank(r, P, m) for r in range(P))
    return _torch_multi_chunk(P, m, schedule, v)


def _gpipe_rank(rank: int, P: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """``ScheduleGPipe._step_microbatches``: every forward, then every backward, in order."""
    return tuple(((k, rank, i),) for k in ("F", "B") for i in range(m))


def _one_f_one_b_rank(rank: int, P: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """``Schedule1F1B._step_microbatches``: ``min(m, P - rank)`` warm-up forwards, then 1B1F, then cool-down."""
    stage = rank  # one stage per rank
    warmup = min(m, P - stage)
    out = [(("F", stage, i),) for i in range(warmup)]
    fwd, bwd = warmup, 0
    while True:  # the runtime's 1B1F loop: a backward, then (unless all forwards ran) a forward
        out.append((("B", stage, bwd),))
        bwd += 1
        if fwd == m:
            break
        out.append((("F", stage, fwd),))
        fwd += 1
    while bwd < m:  # cool-down
        out.append((("B", stage, bwd),))
        bwd += 1
    return tuple(out)


class _OrderStage:
    """Stand-in for a ``PipelineStage`` holding only what the schedule constructors read.

    torch's schedule classes compute the order of *every* rank in their constructor from the
    group size, the number of stages and the number of local stages; they touch no process
    group there. (torch's own ``_schedule_visualizer.get_schedule_ops`` does the same with
    an autospec'd ``PipelineStage``.)
    """

    def __init__(self, group_size: int, num_stages: int) -> None:
        self.group_rank = 0
        self.group_size = group_size
        self.num_stages = num_stages
        self.submod = None
        self.stage_index_to_group_rank = None


@cache
def _order_only_class(schedule: str) -> type:
    """A subclass of torch's schedule class that computes ``pipeline_order`` but skips the comm lowering."""
    from torch.distributed.pipelining import schedules as torch_schedules

    base = getattr(torch_schedules, _TORCH_CLASS[schedule])

    def _prepare_schedule_with_comms(self: Any, actions: Any, format: str = "compute_only") -> None:
        self.pipeline_order_with_comms = None

    return type(f"_OrderOnly{base.__name__}", (base,), {"_prepare_schedule_with_comms": _prepare_schedule_with_comms})


def torch_schedule(P: int, m: int, schedule: str, v: int, lowered: bool = False) -> Any:
    """Instantiate torch's multi-chunk schedule class for ``(P, m, v)`` with stand-in stages.

    With ``lowered=True`` torch's full class runs, including the lowering to
    ``pipeline_order_with_comms`` (slow for large ``m``; used by the tests). Torch's own
    errors are re-raised as ``ValueError`` naming ``P``, ``m`` and ``v``.
    """
    schedule, v = check_schedule_v(schedule, v)
    if schedule not in MULTI_CHUNK_SCHEDULES:
        raise ValueError(
            f"schedule={schedule!r} is not a multi-chunk schedule; those are {list(MULTI_CHUNK_SCHEDULES)}"
        )
    if lowered:
        from torch.distributed.pipelining import schedules as torch_schedules

        cls = getattr(torch_schedules, _TORCH_CLASS[schedule])
    else:
        cls = _order_only_class(schedule)
    stages = [_OrderStage(P, P * v) for _ in range(v)]
    logger = logging.getLogger("torch.distributed.pipelining.schedules")
    level = logger.level
    logger.setLevel(logging.ERROR)  # the constructors log "Using ..." and bubble warnings at INFO/WARNING
    try:
        return cls(stages, m)
    except (ValueError, AssertionError, RuntimeError) as exc:
        raise ValueError(f"torch refuses schedule={schedule!r} with P={P}, m={m}, v={v}: {exc}") from exc
    finally:
        logger.setLevel(level)


def _torch_multi_chunk(P: int, m: int, schedule: str, v: int) -> Groups:
    instance = torch_schedule(P, m, schedule, v)
    out = []
    for rank in range(P):
        groups = []
        for action in instance.pipeline_order[rank]:
            if action is None:
                continue
            subs = action.sub_actions if action.sub_actions is not None else (action,)
            group = []
            for sub in subs:
                kind = sub.computation_type.value
                if kind not in COMPUTE_KINDS:
                    raise ValueError(
                        f"torch's {schedule} order holds action {sub!r} of kind {kind!r}, which the simulator does "
                        "not model"
                    )
                group.append((kind, int(sub.stage_index), int(sub.microbatch_index)))
            groups.append(tuple(group))
        out.append(tuple(groups))
    return tuple(out)


__all__ = ["Action", "Groups", "action_groups", "builtin_groups", "compute_orders", "torch_schedule"]
