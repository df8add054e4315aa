"""A run's layout beyond the pipeline, checked before launch: :func:`check_layout` turns ``run(..., D=, fsdp=, tp=,
tp_plan=)`` into a :class:`RunLayout`.

Each stage runs on ``fsdp * tp`` processes of each of ``D`` replicas (:mod:`~pipeswift_lab.core.layout`). Tensor
parallelism and FSDP2 need the model's own modules in every stage, so a model that is not an ``nn.Sequential`` is
cut with ``split="manual"`` (stage copies run by the model's own forward), not by torch's tracer, whose stage graphs
call the parameters, not the modules the plan names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..core.checks import check_int
from ..core.meta_device import parameter_names
from ..core.sequence_parallel import check_sequence_parallel
from ..core.tp_plan import as_tp, resolve_tp_plan
from .devices import resolve_devices
from .options import Launch, as_fsdp
from .sources import DataSource
from .stages.sequential import StagePlan
from .stages.sharding import check_reshard

__all__ = [
    "REPLICA_UNSUPPORTED",
    "RunLayout",
    "check_layout",
    "check_untied",
    "check_nprocs",
    "check_replica_schedule",
    "layout_placement",
    "reader_batch",
]

#: Schedules whose split backward (I then W) does not go through DDP's synchronized backward.
REPLICA_UNSUPPORTED = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@dataclass(frozen=True)
class RunLayout:
    """The checked layout of one run."""

    fsdp: int
    """FSDP2 shard degree inside a replica."""
    tp: int
    """Tensor-parallel degree."""
    tp_plan: dict[str, str] | None
    """The plan applied when ``tp > 1`` (``None`` otherwise)."""
    sequence_parallel: bool
    """Whether the norms and residuals between the tensor-parallel regions run on a slice of the sequence."""
    reshard_after_forward: bool
    """Whether FSDP2 frees the gathered parameters after each forward."""
    split: str | None
    """How a model that is not an ``nn.Sequential`` is cut (``"manual"`` whenever ``fsdp * tp > 1``)."""

    def world(self, P: int, D: int) -> int:
        """Processes of the run: ``P * D * fsdp * tp``."""
        return P * D * self.fsdp * self.tp

    def check_sequence(self, boundaries: Sequence[tuple[Any, Any]]) -> None:
        """Refuse sequence parallelism on a sequence ``tp`` does not divide: the first stage's input, a micro-batch
        of ``(batch, sequence, ...)``, is read at dimension 1."""
        if not self.sequence_parallel or not boundaries:
            return
        shape = tuple(boundaries[0][0].shape)
        if len(shape) < 2 or shape[1] % self.tp:
            raise ValueError(
                f"sequence parallelism over tp={self.tp} slices dimension 1 of the hidden states, the sequence, into "
                f"{self.tp} equal parts; a micro-batch of shape {shape} has no sequence of a length tp divides"
            )

    def check_zero1(self, precision: str | None) -> None:
        """Refuse ZeRO-1's sharded optimizer (``precision="bf16-mixed-zero1"``) beside FSDP or tensor parallelism."""
        if self.fsdp * self.tp > 1 and precision == "bf16-mixed-zero1":
            raise ValueError(
                "precision='bf16-mixed-zero1' shards the optimizer over the replicas with torch's "
                "ZeroRedundancyOptimizer; with fsdp or tp FSDP2 shards it already: use precision='bf16-mixed'"
            )


def check_layout(
    model: nn.Module,
    plan: StagePlan,
    D: int,
    fsdp: Any,
    tp: Any,
    tp_plan: Mapping[str, str] | None,
    split: str | None,
) -> RunLayout:
    """``fsdp`` (a degree or :class:`~pipeswift_lab.runner.options.FSDP`), ``tp`` and ``tp_plan`` checked against the
    model and the stage plan; returns the :class:`RunLayout`.

    Raises ``ValueError`` for a ``tp`` the plan's sharded sizes or the attention heads do not allow, ``tp > 1`` on a
    model with no plan and no ``tp_plan=``, a plan glob matching no module, an unknown style
    (:func:`~pipeswift_lab.core.tp_plan.resolve_tp_plan`), ``reshard_after_forward=True`` under a schedule that
    splits the backward, ``split="trace"`` with ``fsdp`` or ``tp`` above 1, and a model that ties parameters with
    either above 1 (:func:`check_untied`)."""
    record = as_fsdp(fsdp)
    tp_record = as_tp(tp)
    tp = tp_record.degree
    resolved = resolve_tp_plan(model, tp_plan, tp)
    sequence_parallel = tp_record.sequence_parallel and tp > 1
    if sequence_parallel and resolved is not None:
        check_sequence_parallel(model, resolved)
    reshard = bool(record.reshard_after_forward)
    if record.degree > 1:
        check_reshard(reshard, plan.schedule, plan.P)
    sharded = record.degree * tp > 1
    if sharded:
        check_untied(model, record.degree, tp)
    if sharded and not isinstance(model, nn.Sequential):
        if split == "trace":
            raise ValueError(
                f'split="trace" cannot run fsdp={record.degree}, tp={tp}: torch\'s traced stages call the parameters, '
                'not the modules FSDP and the tensor-parallel plan wrap; use split="manual" (the default then)'
            )
        split = "manual"
    return RunLayout(
        fsdp=record.degree,
        tp=tp,
        tp_plan=resolved if tp > 1 else None,
        sequence_parallel=sequence_parallel,
        reshard_after_forward=bool(reshard),
        split=split,
    )


def check_untied(model: nn.Module, fsdp: int, tp: int) -> None:
    """Refuse ``fsdp`` or ``tp`` above 1 on a model that ties parameters (one tensor under two names: a tied input
    embedding and output head), on one stage or across stages: tensor parallelism replaces each planned module's
    parameters with sharded ones, so the two names would train apart, and FSDP2 refuses a parameter in two of its
    groups; across stages the runner keeps the copies equal by summing their gradients, which it does not do for
    sharded parameters."""
    tied = [names for names in parameter_names(model) if len(names) > 1]
    if tied:
        raise ValueError(
            f"fsdp={fsdp}, tp={tp}: the model ties parameters ({', '.join(' = '.join(names) for names in tied[:4])}), "
            "one tensor under two names, which sharding would untie (tensor parallelism trains the two apart, FSDP2 "
            "refuses a parameter in two of its groups); untie them (tie_word_embeddings=False for a Hugging Face "
            "model) or run with fsdp=1 and tp=1"
        )


def layout_placement(
    plan: StagePlan, D: int, m: int, launch: Launch, layout: RunLayout
) -> tuple[str, str, tuple[int, ...] | None]:
    """Where the ``P * D * fsdp * tp`` processes run: ``(backend, device type, CUDA indices or None)``, after checking
    the process count and the schedule's rules for P, m and v."""
    world = layout.world(plan.P, D)
    check_nprocs(launch.nprocs, plan.P, D, world)
    check_replica_schedule(plan, m, D, ddp=layout.fsdp == 1 and layout.tp == 1)
    what = None if world == plan.P else f"P*D={plan.P}*{D}"
    if layout.fsdp * layout.tp > 1:
        what = f"P*D*fsdp*tp={plan.P}*{D}*{layout.fsdp}*{layout.tp}"
    return resolve_devices(world, launch.backend, launch.devices, what=what)


def check_nprocs(nprocs: int | None, P: int, D: int, world: int) -> None:
    """``nprocs`` must be ``None`` or the run's ``world`` (``P * D * fsdp * tp``): one process runs each rank."""
    if nprocs is None:
        return
    nprocs = check_int("nprocs", nprocs, minimum=1)
    if nprocs != world:
        what = f"the partition's P={P}" if world == P else f"P*D*fsdp*tp={world}"
        raise ValueError(
            f"nprocs={nprocs} differs from {what}; one process runs each rank, so nprocs must be {world} (or None)"
        )


def check_replica_schedule(plan: StagePlan, m: int, D: int, *, ddp: bool = True) -> None:
    """torch's rules for P, m and v of the schedule, and the schedules that cannot run with ``D > 1`` replicas under
    DDP (``ddp``: no FSDP and no tensor parallelism; FSDP2 reduces their split backward correctly)."""
    from ..core.vocabulary import splits_backward, validate

    validate(plan.P, m, plan.schedule, plan.v)
    if D > 1 and ddp and (plan.schedule in REPLICA_UNSUPPORTED or splits_backward(plan.schedule)):
        raise ValueError(
            f"D={D} replicas with schedule={str(plan.schedule)!r} is not supported under DDP: its split input/weight "
            "backward bypasses DDP's gradient sync; use one of GPipe, 1F1B, Interleaved1F1B, LoopedBFS with D > 1, "
            "or shard the replicas with fsdp= (FSDP2 reduces a split backward's gradients)"
        )


def reader_batch(source: DataSource, readers: int, m: int, D: int = 1) -> tuple[int, int]:
    """``(global batch, each reader's batch)`` of step 0's data, where ``readers`` (``D * fsdp``) processes read equal
    slices of it; ``readers`` and then ``m`` must divide them."""
    global_batch = int(source.batch(0)[0].shape[0])
    what = f"D={D}" if readers == D else f"D*fsdp={readers}"
    if global_batch % readers:
        divisors = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
        raise ValueError(
            f"{what} does not divide the global batch size {global_batch} of data (each replica and FSDP shard reads "
            f"an equal slice); use a {what.split('=')[0]} whose value is in {divisors}"
        )
    batch_size = global_batch // readers
    if batch_size % m:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        where = (
            f"the batch size {batch_size} of data"
            if readers == 1
            else f"each {'replica' if readers == D else 'FSDP shard'}'s batch {batch_size} "
            f"(global batch {global_batch} / {what})"
        )
        raise ValueError(f"m={m} does not divide {where}; use an m in {divisors}")
    return global_batch, batch_size
