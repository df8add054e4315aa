"""Timing every compute action a torch pipeline schedule executes, at a cost of two clock reads.

torch's schedules run every action through three ``PipelineStage`` methods:
``forward_one_chunk`` (``F``), ``backward_one_chunk`` (``B`` with ``full_backward=True``,
``I`` input-grad with ``full_backward=False``) and ``backward_weight_one_chunk`` (``W``).
:class:`ActionRecorder` wraps those methods on the stage *instances* (torch's classes are
untouched) and appends ``(step, kind, stage, microbatch, start, end)`` to a list.

* CPU: ``time.perf_counter_ns`` before and after the call.
* CUDA: a ``torch.cuda.Event`` pair per action, resolved after the step (one synchronize per
  step) against an event recorded at the step start, so kernels are timed where they run.

The last stage's ``F`` is extended to cover the loss, which torch computes right after that
forward (``_maybe_compute_loss``): it is compute the rank does, not idle time.

An FSDP2 stage (``run(..., fsdp=)``) gathers its parameters at the start of every step, timed as ``UNSHARD``
(:meth:`ActionRecorder.unshard`), and reduce-scatters its gradients after the last backward, in torch's
``perform_reduce_grad``, timed as ``REDUCE_GRAD``. Tensor parallelism's collectives run inside the ``F``, ``B``,
``I`` and ``W`` actions that call them; where the stages hold tensor-parallel DTensors each is timed as a
``TP_ALL_REDUCE``, ``TP_ALL_GATHER``, ``TP_REDUCE_SCATTER`` or ``TP_ALL_TO_ALL`` row of the action's stage and
micro-batch, from its issue to the end of its wait, nested in the action (:mod:`.tp_comm`).

Every row carries the bytes it moved (:meth:`ActionRecorder.rows` with ``with_bytes``): a collective's whole buffer
(a DDP step's gradient buckets; an FSDP2 stage's unsharded parameters, as gathered for ``UNSHARD`` and as stored for
``REDUCE_GRAD``, :func:`unsharded_bytes`; a tensor-parallel collective's input, or an all-gather's output); 0 for
compute.

With data-parallel replicas (a stage module wrapped in ``DistributedDataParallel``), a DDP
communication hook (``register_comm_hook``, torch's own ``allreduce_hook`` inside) stamps each
gradient bucket's all-reduce from its launch to its completion; a step's buckets make one
``REDUCE_GRAD`` action per stage (torch's name for the cross-micro-batch gradient reduction),
from the first bucket's launch to the last one's end. It overlaps the last backward, which
launches buckets as their gradients become ready, and includes waiting for the slower replica.

Clock alignment: every rank turns its ``perf_counter_ns`` stamps into wall-clock nanoseconds
(``time.time_ns``) through one offset measured at start-up (:func:`wall_offset_ns`). On one
machine all ranks read the same clock, so their timelines line up exactly; across machines
they line up as well as the hosts' clocks are synchronized (NTP, typically < 1 ms).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ...core.vocabulary import TP_KINDS
from ..run_files import KINDS
from .tp_comm import TPCommTimer, install, tp_group_name

#: The codes of the recorded kinds, in the order of :data:`~pipeswift_lab.runner.run_files.KINDS`.
_F, _B, _I, _W, _R, _U = range(6)
#: Codes of the compute kinds (what a stage's busy time sums).
COMPUTE_CODES = (_F, _B, _I, _W)
#: Codes of tensor parallelism's collective kinds, by kind.
TP_CODES = {kind: KINDS.index(kind) for kind in TP_KINDS}


def wall_offset_ns(samples: int = 7) -> int:
    """``time.time_ns() - time.perf_counter_ns()``, from the tightest of ``samples`` bracketed reads."""
    best: tuple[int, int] | None = None
    for _ in range(samples):
        a = time.perf_counter_ns()
        wall = time.time_ns()
        b = time.perf_counter_ns()
        if best is None or b - a < best[0]:
            best = (b - a, wall - (a + b) // 2)
    if best is None:
        raise ValueError(f"samples={samples} must be at least 1")
    return best[1]


class ActionRecorder:
    """Wraps the stages of one rank and records their compute actions (and, for DDP-wrapped stage modules, their
    gradient all-reduce as ``REDUCE_GRAD``), step by step.

    ``enabled=False`` leaves the stages untouched (the baseline of the overhead benchmark).
    ``rows()`` returns the records as an int64 tensor ``[n, 6]``: step, kind code, stage,
    micro-batch, start and end in wall-clock ns (``[n, 7]`` with ``with_bytes``: and the bytes moved).
    Where the stages hold tensor-parallel DTensors, their collectives are recorded inside the actions
    (:mod:`.tp_comm`; :attr:`tp` is its timer, None otherwise).
    """

    def __init__(self, stages: list[Any], schedule: Any, device: torch.device | str, enabled: bool = True) -> None:
        self.enabled = enabled
        self.cuda = torch.device(device).type == "cuda"
        self.step = 0
        self._records: list[tuple[int, int, int, int, int, int, int]] = []  # ... start, end, bytes
        self._pending: list[tuple[Any, ...]] = []  # CUDA: (step, kind, stage, mb, start_event, end_event, bytes)
        self._offset = wall_offset_ns()
        self._step_event: Any = None  # CUDA: the event recorded at the step start
        self._step_host_ns = 0
        self._reduce_spans: dict[
            tuple[int, int], list[Any]
        ] = {}  # (step, stage) -> [first bucket launch, bucket ends, micro-batch, bytes]
        self._backward_mb: dict[int, int] = {}  # stage -> the micro-batch of its backward now running
        self.tp: TPCommTimer | None = None
        if not enabled:
            return
        group = tp_group_name(
            [m for m in (getattr(s, "submod", None) for s in stages) if isinstance(m, torch.nn.Module)]
        )
        if group is not None:
            self.tp = TPCommTimer(self._stamp, self._add_tp, group)
            install(self.tp)
        for stage in stages:
            self._wrap(stage)
            self._watch_reduce(stage)
            self._watch_reduce_scatter(stage)
        self._wrap_loss(schedule)

    # --- clocks -------------------------------------------------------------------------
    def now_ns(self) -> int:
        """Wall-clock ns from ``perf_counter_ns`` and the start-up offset."""
        return time.perf_counter_ns() + self._offset

    def start_step(self, step: int) -> int:
        """Mark the start of ``step``; returns its wall-clock start in ns (CUDA: after a synchronize)."""
        self.step = step
        if self.cuda:  # pragma: no cover - needs a GPU
            torch.cuda.synchronize()
            self._step_event = torch.cuda.Event(enable_timing=True)
            self._step_event.record()
        self._step_host_ns = self.now_ns()
        return self._step_host_ns

    def end_step(self) -> int:
        """Mark the end of the current step; returns its wall-clock end in ns (CUDA: resolves the events)."""
        for (step, stage), (t0, ends, mb, nbytes) in self._reduce_spans.items():
            if ends:  # DDP waits for every bucket inside the last backward, so each span has ended
                # CUDA: buckets finish in launch order on one stream, so the last callback's event ends the span
                self._add(_R, stage, mb, t0, ends[-1] if self.cuda else max(ends), step=step, nbytes=nbytes)
        self._reduce_spans.clear()
        if self.cuda:  # pragma: no cover - needs a GPU
            torch.cuda.synchronize()
            base = self._step_event
            for step, kind, stage, mb, ev0, ev1, nbytes in self._pending:
                start = self._step_host_ns + int(base.elapsed_time(ev0) * 1e6)
                end = self._step_host_ns + int(base.elapsed_time(ev1) * 1e6)
                self._records.append((step, kind, stage, mb, start, end, nbytes))
            self._pending.clear()
        return self.now_ns()

    # --- wrapping ---------------------------------------------------------------------------
    def _stamp(self) -> Any:
        if self.cuda:  # pragma: no cover - needs a GPU
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter_ns()

    def _add(self, kind: int, stage: int, mb: int, t0: Any, t1: Any, step: int | None = None, nbytes: int = 0) -> None:
        step = self.step if step is None else step
        if self.cuda:  # pragma: no cover - needs a GPU
            self._pending.append((step, kind, stage, mb, t0, t1, nbytes))
        else:
            self._records.append((step, kind, stage, mb, t0 + self._offset, t1 + self._offset, nbytes))

    def _add_tp(self, kind: str, stage: int, mb: int, t0: Any, t1: Any, nbytes: int) -> None:
        self._add(TP_CODES[kind], stage, mb, t0, t1, nbytes=nbytes)

    def _timed(self, code: int, index: int, mb: int, call: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``call`` as the action ``code`` of stage ``index`` on micro-batch ``mb``, timed with its
        tensor-parallel collectives."""
        tp = self.tp
        if tp is not None:
            tp.begin(index, mb)
        t0 = self._stamp()
        try:
            out = call(*args, **kwargs)
        finally:
            t1 = self._stamp()
            if tp is not None:
                tp.finish(t1)
        self._add(code, index, mb, t0, t1)
        return out

    def _wrap(self, stage: Any) -> None:
        index = stage.stage_index
        forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk
        timed = self._timed

        def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            return timed(_F, index, fwd_chunk_id, forward, fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(
            bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
        ) -> Any:
            self._backward_mb[index] = bwd_chunk_id
            code = _B if full_backward else _I
            return timed(
                code,
                index,
                bwd_chunk_id,
                backward,
                bwd_chunk_id,
                loss=loss,
                full_backward=full_backward,
                last_backward=last_backward,
            )

        def backward_weight_one_chunk(bwd_chunk_id: int, last_backward: bool = False) -> Any:
            return timed(_W, index, bwd_chunk_id, weight, bwd_chunk_id, last_backward=last_backward)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

    def _watch_reduce(self, stage: Any) -> None:
        """Time the gradient all-reduce of a DDP-wrapped stage module through a comm hook (no-op otherwise)."""
        from torch.nn.parallel import DistributedDataParallel

        ddp = getattr(stage, "submod", None)
        if not isinstance(ddp, DistributedDataParallel):
            return
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        index, stamp, spans = stage.stage_index, self._stamp, self._reduce_spans

        # unannotated on purpose: DDP's register_comm_hook compares the annotations of `bucket` and of the return
        # with dist.GradBucket and Future[Tensor] by identity, and postponed (string) annotations never match
        def _timed_allreduce(group, bucket):
            key = (self.step, index)
            if key not in spans:
                spans[key] = [stamp(), [], self._backward_mb.get(index, 0), 0]
            spans[key][3] += bucket.buffer().numel() * bucket.buffer().element_size()
            ends = spans[key][1]

            def finished(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
                ends.append(stamp())  # list.append is atomic: gloo may complete buckets on two threads at once
                return fut.value()

            return allreduce_hook(group, bucket).then(finished)

        ddp.register_comm_hook(ddp.process_group, _timed_allreduce)

    def _watch_reduce_scatter(self, stage: Any) -> None:
        """Time an FSDP2 stage's gradient reduce-scatter, which torch runs in ``perform_reduce_grad`` after the
        step's last backward, as ``REDUCE_GRAD`` (no-op for other stages)."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(getattr(stage, "submod", None), FSDPModule):
            return
        reduce, index, stamp = stage.perform_reduce_grad, stage.stage_index, self._stamp
        nbytes = unsharded_bytes(stage.submod)

        def perform_reduce_grad(*args: Any, **kwargs: Any) -> Any:
            t0 = stamp()
            out = reduce(*args, **kwargs)
            self._add(_R, index, self._backward_mb.get(index, 0), t0, stamp(), nbytes=nbytes)
            return out

        stage.perform_reduce_grad = perform_reduce_grad

    def unshard(self, stages: list[Any]) -> None:
        """Gather every FSDP2 stage's parameters now (:func:`~pipeswift_lab.runner.stages.sharding.unshard`), each
        timed as an ``UNSHARD`` action when recording."""
        from ..stages.sharding import unshard

        for stage in stages:
            t0 = self._stamp() if self.enabled else None
            if unshard(stage.submod) and t0 is not None:
                self._add(_U, stage.stage_index, 0, t0, self._stamp(), nbytes=unsharded_bytes(stage.submod))

    def _wrap_loss(self, schedule: Any) -> None:
        compute = schedule._maybe_compute_loss
        pending, records, stamp = self._pending, self._records, self._stamp

        def _maybe_compute_loss(
            stage: Any, output: Any, target_mbs: Any, mb_index: int, *args: Any, **kwargs: Any
        ) -> Any:
            out = compute(stage, output, target_mbs, mb_index, *args, **kwargs)
            if stage.is_last:
                rows = pending if self.cuda else records
                if rows and rows[-1][1] == _F and rows[-1][2] == stage.stage_index and rows[-1][3] == mb_index:
                    end = stamp() if self.cuda else stamp() + self._offset
                    rows[-1] = rows[-1][:5] + (end,) + rows[-1][6:]
            return out

        schedule._maybe_compute_loss = _maybe_compute_loss

    def rows(self, with_bytes: bool = False) -> torch.Tensor:
        """The records so far as an int64 tensor ``[n, 6]`` (step, kind code, stage, microbatch, start_ns, end_ns);
        ``[n, 7]`` with ``with_bytes``, the last column the bytes each moved (0 for compute)."""
        width = 7 if with_bytes else 6
        if not self._records:
            return torch.zeros((0, width), dtype=torch.int64)
        return torch.tensor(self._records, dtype=torch.int64)[:, :width]


def unsharded_bytes(module: torch.nn.Module) -> int:
    """The bytes of ``module``'s parameters as FSDP2 gathers them on this process: each DTensor parameter's local
    shard times the ranks it is sharded over outside the tensor-parallel dimension (FSDP's ``Shard`` or, over a
    tensor-parallel cut of the same dim, ``_StridedShard``; a shard padded to divide evenly counts padded, as the
    collective moves it), in its dtype now; a plain parameter whole."""
    from torch.distributed.tensor import DTensor

    total = 0
    for param in module.parameters():
        if isinstance(param, DTensor):
            mesh, local = param.device_mesh, param.to_local()
            names = mesh.mesh_dim_names or ("",) * mesh.ndim
            ways = 1
            for dim, (name, placement) in enumerate(zip(names, param.placements)):
                if name != "tp" and not (placement.is_replicate() or placement.is_partial()):  # Shard, _StridedShard
                    ways *= mesh.size(dim)
            total += local.numel() * local.element_size() * ways
        else:
            total += param.numel() * param.element_size()
    return int(total)


__all__ = ["ActionRecorder", "COMPUTE_CODES", "TP_CODES", "unsharded_bytes", "wall_offset_ns"]
