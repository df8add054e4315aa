"""Measuring one rank's memory while it trains: the tensor-level peak of a step and the process's high-water.

Two measures, kept apart because they answer different questions:

* **tensor level** (``measured_peak_bytes``) — the most bytes of tensor storage alive at once
  during one step: parameters, buffers, gradients, optimizer state, saved activations, the
  schedule's send and receive buffers and every transient an operator allocates. On CUDA it is
  ``torch.cuda.max_memory_allocated`` over all steps (the caching allocator counts it for free).
  On CPU it is :class:`~pipeswift_lab.core.live_bytes.LiveTensorBytes`, counting what a device
  would hold: the rank's stage modules, their optimizer state, torch's receive buffers and the
  step's batch (the first stage's inputs, the last stage's targets), a checkpoint's staging
  buffer, and everything an operator allocates during the step (not the rest of the process:
  the other steps' batches, the spec). It runs for one step, the *probed* step: the second of
  the run (the first after the optimizer has built its state), since a Python call per
  operator costs tens of percent of that step (``benchmarks/bench_memory.py`` reports it).
  The CPU measure also tells the peak apart by the memory model's terms
  (:data:`~pipeswift_lab.core.memory_model.MEMORY_TERMS`, ``measured_{term}_bytes``) and says
  during which action it came (``measured_peak_at``): what an operator allocates during a
  forward (and the loss) counts as activations, during a backward or the optimizer step as
  transient until it becomes a parameter's gradient (``grads``), a receive buffer's or a
  gradient sent to the stage before (``buffers``).
* **process level** — on CPU ``resident_peak_bytes``: the process's resident high-water
  (``VmHWM``) over all steps, above its resident size just before the first step (the
  high-water is reset there through ``/proc/self/clear_refs``); it adds the allocator's and the
  libraries' own memory and pages kept after a free. On CUDA ``reserved_peak_bytes``:
  ``torch.cuda.max_memory_reserved``, the caching allocator's segments. Reading either costs
  nothing per step.

Why not torch's ``MemTracker``: see :mod:`pipeswift_lab.core.live_bytes`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ...core.live_bytes import LiveTensorBytes, local_tensor
from ...core.memory_model import MEMORY_TERMS

__all__ = [
    "MMAP_THRESHOLD_BYTES",
    "MemoryProbe",
    "lifetime_high_water",
    "probed_step",
    "resident_bytes",
    "return_freed_memory",
    "STAGING",
]


def _by_storage(tensors: Iterator[torch.Tensor]) -> dict[int, torch.Tensor]:
    """``{storage address: tensor}`` of ``tensors``, each DTensor by its local shard (one entry per storage)."""
    out = {}
    for t in tensors:
        local = local_tensor(t)
        out[local.untyped_storage().data_ptr()] = local
    return out


def resident_bytes() -> tuple[int, int] | None:
    """``(VmRSS, VmHWM)`` of this process in bytes, from ``/proc/self/status``; None where there is no ``/proc``."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "VmHWM")))
    except OSError:
        return None
    try:
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (KeyError, ValueError, IndexError):
        return None


#: glibc's ``M_MMAP_THRESHOLD`` option of ``mallopt``, and the size from which a CPU rank maps each allocation.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 128 * 1024


def return_freed_memory() -> bool:
    """Make glibc map every allocation of :data:`MMAP_THRESHOLD_BYTES` or more on its own, so that freeing it gives
    the pages back; returns False where that cannot be set (not glibc).

    glibc raises its threshold to the size of the largest mapped block freed so far (up to 32 MiB): after the
    first step frees its gradients, the next step's come from the heap, which keeps freed memory resident. A CPU
    rank's resident peak was then about twice its weights and gradients (measured: 281 MB for a 134 MB stage in a
    plain torch job; 164 MB with the threshold fixed). A fixed threshold also turns off the raising."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False


def lifetime_high_water(assembly_high_water: int | None) -> int | None:
    """The process's resident high-water over its whole life: ``assembly_high_water`` (``VmHWM`` before the probe
    reset it) or the high-water since, whichever is higher; None without ``/proc``."""
    resident = resident_bytes()
    peaks = [x for x in (assembly_high_water, resident[1] if resident else None) if x is not None]
    return max(peaks) if peaks else None


def _reset_high_water() -> bool:
    """Reset ``VmHWM`` to the current resident size (Linux ``clear_refs`` value 5); False where that is not
    possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def probed_step(first_step: int, steps: int) -> int | None:
    """The step whose tensor-level peak is measured on CPU: the second one run (the optimizer's state exists from
    then on), the only one if one is run; None if none is."""
    if steps <= first_step:
        return None
    return first_step + 1 if steps - first_step > 1 else first_step


#: What the CPU measure counts a storage as, besides the memory model's terms: a checkpoint's staging buffer.
STAGING = "staging"


class MemoryProbe:
    """One rank's memory measure: ``watch()`` the stages once, ``start()`` just before the first step, ``step(n)``
    around each step's work (schedule, flags, update), ``report()`` at the end (a dict for the rank's payload)."""

    def __init__(self, device: torch.device, probe_step: int | None, enabled: bool = True) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.probe_step = probe_step if enabled else None
        self.enabled = enabled
        self.tracker: LiveTensorBytes | None = None
        self.baseline_rss: int | None = None
        self.high_water_reset = False
        self.state_bytes: dict[str, int] = {}
        self.stages: list[Any] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.staging: list[torch.Tensor] = []
        self.report_tracker: LiveTensorBytes | None = None
        self.before_backward: dict[str, int] | None = None

    def watch(self, stages: list[Any], schedule: Any, optimizer: torch.optim.Optimizer) -> None:
        """Wrap ``stages``' compute methods and ``schedule``'s loss so that the probed step counts what each action
        allocates under its term (forward and loss: activations; backward: transient, then grads and buffers)."""
        self.stages, self.optimizer = stages, optimizer
        if not self.enabled or self.cuda:
            return
        for stage in stages:
            self._wrap(stage)
        compute = schedule._maybe_compute_loss

        def _maybe_compute_loss(stage: Any, output: Any, target_mbs: Any, mb_index: int, *a: Any, **k: Any) -> Any:
            with self.during(f"loss stage {stage.stage_index} mb {mb_index}", "activations"):
                return compute(stage, output, target_mbs, mb_index, *a, **k)

        schedule._maybe_compute_loss = _maybe_compute_loss

    def _wrap(self, stage: Any) -> None:
        s = stage.stage_index
        forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk

        def forward_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
            with self.during(f"F stage {s} mb {mb}", "activations"):
                return forward(mb, *args, **kwargs)

        def backward_one_chunk(mb: int, *args: Any, full_backward: bool = True, **kwargs: Any) -> Any:
            kind = "B" if full_backward else "I"
            with self.during(f"{kind} stage {s} mb {mb}", "transient"):
                out = backward(mb, *args, full_backward=full_backward, **kwargs)
            self.settle()
            return out

        def backward_weight_one_chunk(mb: int, *args: Any, **kwargs: Any) -> Any:
            with self.during(f"W stage {s} mb {mb}", "transient"):
                out = weight(mb, *args, **kwargs)
            self.settle()
            return out

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk
        gradient_sends = stage.get_bwd_send_ops

        def get_bwd_send_ops(mb: int) -> Any:  # a gradient sent back lives until torch waits on its send
            ops = gradient_sends(mb)
            if self.tracker is not None:
                self.tracker.tag((op.tensor for op in ops if isinstance(op.tensor, torch.Tensor)), "buffers")
            return ops

        stage.get_bwd_send_ops = get_bwd_send_ops

    @contextlib.contextmanager
    def during(self, action: str, category: str = "transient") -> Iterator[None]:
        """Count what is allocated inside the block under ``category``, and name ``action`` if the peak comes there."""
        tracker = self.tracker
        if tracker is None:
            yield
            return
        if action[:1] in ("B", "I", "W") and self.before_backward is None:
            self.before_backward = dict(tracker.live_by)  # what the rank holds as its first backward starts
        before = (tracker.label, tracker.category)
        tracker.label, tracker.category = action, category
        try:
            yield
        finally:
            tracker.label, tracker.category = before

    def settle(self) -> None:
        """Count the gradients that exist now as what they are: a parameter's as ``grads``, a receive buffer's as
        ``buffers`` (call after each backward, and after the tied weights' gradients are summed)."""
        tracker = self.tracker
        if tracker is None:
            return
        tracker.tag((p.grad for stage in self.stages for p in stage.submod.parameters() if p.grad is not None), "grads")
        tracker.tag((b.grad for b in self._recv_buffers() if b.grad is not None), "buffers")

    def _recv_buffers(self) -> list[torch.Tensor]:
        """torch's receive buffers of this rank's stages: activations (per micro-batch) and output gradients."""
        out = []
        for stage in self.stages:
            activations, gradients = getattr(stage, "args_recv_info", {}), getattr(stage, "grad_recv_info", {})
            for infos in (*activations.values(), *gradients.values()):
                for info in infos if isinstance(infos, (tuple, list)) else ():
                    buffer = getattr(info, "buffer", None)
                    if isinstance(buffer, torch.Tensor):
                        out.append(buffer)
        return out

    def keep_staging(self, tensors: list[torch.Tensor]) -> None:
        """The checkpoint staging buffers this rank holds for the whole run (counted on CPU as ``staging``)."""
        self.staging = list(tensors)

    def start(self) -> None:
        """Reset the peak counters: CUDA's statistics, or the process's resident high-water."""
        if not self.enabled:
            return
        if self.cuda:  # pragma: no cover - needs a GPU
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        self.high_water_reset = _reset_high_water()
        rss = resident_bytes()
        self.baseline_rss = rss[0] if rss else None

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one step's work: on CPU the probed step runs under :class:`LiveTensorBytes`, which starts from what
        the rank holds for the whole run (its modules, optimizer state, receive and staging buffers)."""
        if self.cuda or step != self.probe_step:
            yield
            return
        tracker = LiveTensorBytes(category="transient")
        modules = [stage.submod for stage in self.stages]
        tracker.adopt((t for mod in modules for t in (*mod.parameters(), *mod.buffers())), "weights")
        if self.optimizer is not None:
            state = (t for st in self.optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor))
            tracker.adopt(state, "optimizer")
        tracker.adopt(self._recv_buffers(), "buffers")
        tracker.adopt(self.staging, STAGING)
        tracker.label = "between actions"
        tracker.reset_peak()
        self.tracker = tracker
        try:
            with tracker:
                yield
        finally:
            self.tracker = None
        self.report_tracker = tracker

    def note_batch(self, tensors: list[torch.Tensor]) -> None:
        """Count the step's batch this rank feeds (inputs on the first stage, targets on the last) as ``buffers``,
        each tensor its own bytes (a slice of a larger batch is what a device would hold a copy of)."""
        if self.tracker is not None:
            self.tracker.adopt(tensors, "buffers", own_bytes=True)

    def note_state(self, modules: list[torch.nn.Module], optimizer: torch.optim.Optimizer) -> None:
        """Record the bytes of this rank's parameters, buffers, gradients and optimizer state (call with the
        gradients present: after the schedule, before ``zero_grad``), for the probed step only."""
        if not self.enabled or self.state_bytes:
            return
        params = _by_storage(p for mod in modules for p in mod.parameters())
        grads = _by_storage(p.grad for p in params.values() if p.grad is not None)
        buffers = _by_storage(b for mod in modules for b in mod.buffers())
        states = _by_storage(
            t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        self.state_bytes = {
            "param_bytes": sum(t.untyped_storage().nbytes() for t in params.values()),
            "grad_bytes": sum(t.untyped_storage().nbytes() for t in grads.values()),
            "buffer_bytes": sum(t.untyped_storage().nbytes() for t in buffers.values()),
            "optimizer_bytes": sum(t.untyped_storage().nbytes() for t in states.values()),
        }

    def report(self) -> dict[str, Any]:
        """What was measured: ``measured_peak_bytes`` and ``resident_peak_bytes`` (CPU) or ``reserved_peak_bytes``
        (CUDA), the training state's bytes (``state_*_bytes``), on CPU the peak's terms (``measured_{term}_bytes``,
        ``measured_peak_at``), the terms as the first backward starts (``measured_{term}_before_backward_bytes``)
        and ``probed_step``."""
        if not self.enabled:
            return {}
        out: dict[str, Any] = {f"state_{k}": v for k, v in self.state_bytes.items()}
        if self.cuda:  # pragma: no cover - needs a GPU
            torch.cuda.synchronize(self.device)
            out["measured_peak_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
            out["reserved_peak_bytes"] = int(torch.cuda.max_memory_reserved(self.device))
            out["measure"] = "cuda max_memory_allocated (all steps)"
            return out
        tracker = self.report_tracker
        out["measured_peak_bytes"] = tracker.peak_bytes if tracker is not None else float("nan")
        out["probed_step"] = self.probe_step if tracker is not None else None
        if tracker is not None:
            for term in (*MEMORY_TERMS, STAGING):
                out[f"measured_{term}_bytes"] = tracker.peak_by.get(term, 0)
            out["measured_peak_at"] = tracker.peak_label
            for term in MEMORY_TERMS:
                out[f"measured_{term}_before_backward_bytes"] = (self.before_backward or {}).get(term, 0)
        rss = resident_bytes()
        if rss is not None and self.baseline_rss is not None and self.high_water_reset:
            out["resident_peak_bytes"] = max(0, rss[1] - self.baseline_rss)
        else:
            out["resident_peak_bytes"] = float("nan")
        out["measure"] = f"live tensor storages (step {out['probed_step']}); resident high-water (all steps)"
        return out
