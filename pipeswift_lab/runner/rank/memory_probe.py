"""Measuring one rank's memory while it trains: the tensor-level peak of a step and the process's high-water.

Two measures, kept apart because they answer different questions:

* **tensor level** (``measured_peak_bytes``) — the most bytes of tensor storage alive at once
  during one step: parameters, buffers, gradients, optimizer state, saved activations, the
  schedule's send and receive buffers and every transient an operator allocates. On CUDA it is
  ``torch.cuda.max_memory_allocated`` over all steps (the caching allocator counts it for free).
  On CPU it is :class:`~pipeswift_lab.core.live_bytes.LiveTensorBytes`, whose baseline is every
  tensor the garbage collector reaches when it starts. It runs for one step, the *probed* step:
  the second of the run (the first after the optimizer has built its state), since a Python call
  per operator costs tens of percent of that step (``benchmarks/bench_memory.py`` reports it).
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

from ...core.live_bytes import LiveTensorBytes, live_tensors

__all__ = ["MemoryProbe", "probed_step", "resident_bytes"]


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


class MemoryProbe:
    """One rank's memory measure: ``start()`` just before the first step, ``step(n)`` around each step's work
    (schedule, flags, update), ``report()`` at the end (a dict for the rank's payload)."""

    def __init__(self, device: torch.device, probe_step: int | None, enabled: bool = True) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.probe_step = probe_step if enabled else None
        self.enabled = enabled
        self.tracker: LiveTensorBytes | None = None
        self.baseline_rss: int | None = None
        self.high_water_reset = False
        self.state_bytes: dict[str, int] = {}

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
        """Around one step's work: on CPU the probed step runs under :class:`LiveTensorBytes`."""
        if self.cuda or step != self.probe_step:
            yield
            return
        tracker = LiveTensorBytes()
        tracker.adopt(live_tensors())
        with tracker:
            yield
        self.tracker = tracker

    def note_state(self, modules: list[torch.nn.Module], optimizer: torch.optim.Optimizer) -> None:
        """Record the bytes of this rank's parameters, buffers, gradients and optimizer state (call with the
        gradients present: after the schedule, before ``zero_grad``), for the probed step only."""
        if not self.enabled or self.state_bytes:
            return
        params = {p.untyped_storage().data_ptr(): p for mod in modules for p in mod.parameters()}
        grads = {p.grad.untyped_storage().data_ptr(): p.grad for p in params.values() if p.grad is not None}
        buffers = {b.untyped_storage().data_ptr(): b for mod in modules for b in mod.buffers()}
        states = {
            t.untyped_storage().data_ptr(): t
            for s in optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        }
        self.state_bytes = {
            "param_bytes": sum(t.untyped_storage().nbytes() for t in params.values()),
            "grad_bytes": sum(t.untyped_storage().nbytes() for t in grads.values()),
            "buffer_bytes": sum(t.untyped_storage().nbytes() for t in buffers.values()),
            "optimizer_bytes": sum(t.untyped_storage().nbytes() for t in states.values()),
        }

    def report(self) -> dict[str, Any]:
        """What was measured: ``measured_peak_bytes`` and ``resident_peak_bytes`` (CPU) or ``reserved_peak_bytes``
        (CUDA), the state bytes, and ``probed_step`` (CPU)."""
        if not self.enabled:
            return {}
        out: dict[str, Any] = {f"measured_{k}": v for k, v in self.state_bytes.items()}
        if self.cuda:  # pragma: no cover - needs a GPU
            torch.cuda.synchronize(self.device)
            out["measured_peak_bytes"] = int(torch.cuda.max_memory_allocated(self.device))
            out["reserved_peak_bytes"] = int(torch.cuda.max_memory_reserved(self.device))
            out["measure"] = "cuda max_memory_allocated (all steps)"
            return out
        out["measured_peak_bytes"] = self.tracker.peak_bytes if self.tracker is not None else float("nan")
        out["probed_step"] = self.probe_step if self.tracker is not None else None
        rss = resident_bytes()
        if rss is not None and self.baseline_rss is not None and self.high_water_reset:
            out["resident_peak_bytes"] = max(0, rss[1] - self.baseline_rss)
        else:
            out["resident_peak_bytes"] = float("nan")
        out["measure"] = f"live tensor storages (step {out['probed_step']}); resident high-water (all steps)"
        return out
