"""What the run's own optimizer keeps and allocates, measured on small tensors before launch.

The memory model needs an optimizer's state per parameter byte and the temporaries of its
step (:class:`~pipeswift_lab.core.memory_model.OptimizerMemory`); they depend on the class
and on its implementation (torch's Adam keeps two states; its single-tensor loop allocates
two temporaries the size of the tensor it updates, its ``foreach`` path one the size of all
the parameters at once, its ``fused`` kernel none). :func:`measure_optimizer_memory` builds
the user's optimizer twice, over four tensors of ``N`` elements and over one of ``4N``, steps
each twice and counts, with
:class:`~pipeswift_lab.core.live_bytes.LiveTensorBytes`, the state it keeps and the most its
second step allocates at once. Temporaries of ``a`` times the largest tensor plus ``b`` times
all of them give the two equations that fix ``a`` and ``b``. (torch's single-tensor Adam comes
out near ``a = 5/3, b = 1/3``: the quotient of the tensor updated before stays alive in the
loop while the next one's two are made.) It costs milliseconds: ``run`` builds the optimizer in
this process anyway, to check the factory, and that pays torch's one-time import of
``torch._dynamo``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..core.live_bytes import LiveTensorBytes
from ..core.memory_model import OptimizerMemory

__all__ = ["measure_optimizer_memory"]


def measure_optimizer_memory(
    factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], device: torch.device | str = "cpu"
) -> OptimizerMemory:
    """The :class:`~pipeswift_lab.core.memory_model.OptimizerMemory` of the optimizers ``factory`` makes, measured
    on ``device`` (a CUDA device measures the implementation torch picks there)."""
    device = torch.device(device)
    many_states, many = _step_memory(factory, device, [_N] * 4)
    _, one = _step_memory(factory, device, [4 * _N])
    # many = a*N + b*4N and one = a*4N + b*4N, for temporaries of a x the largest tensor + b x all of them
    per_largest = max(0.0, (one - many) / (3 * _N))
    per_total = max(0.0, (many - per_largest * _N) / (4 * _N))
    return OptimizerMemory(states=many_states, per_largest=per_largest, per_total=per_total, name=_name(factory))


_N = 1024


def _name(factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]) -> str:
    optimizer = factory([torch.nn.Parameter(torch.zeros(1))])
    defaults = optimizer.defaults
    flavour = "fused" if defaults.get("fused") else "foreach" if defaults.get("foreach") else ""
    return type(optimizer).__name__ + (f" ({flavour})" if flavour else "")


def _step_memory(
    factory: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], device: torch.device, sizes: list[int]
) -> tuple[float, float]:
    """The optimizer over parameters of ``sizes`` elements: ``(bytes of state per parameter byte, the most its second
    step allocates at once, in elements of the parameters' dtype)``."""
    params = [torch.nn.Parameter(torch.zeros(n, device=device)) for n in sizes]
    optimizer = factory(params)
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    optimizer.step()  # builds the state
    element = params[0].element_size()
    state = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    }
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        optimizer.step()
        torch.cuda.synchronize(device)
        extra = torch.cuda.max_memory_allocated(device) - before
    else:
        tracker = LiveTensorBytes()
        held = [t for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
        tracker.adopt([*params, *(p.grad for p in params if p.grad is not None), *held])
        before = tracker.live_bytes
        with tracker:
            optimizer.step()
        extra = tracker.peak_bytes - before
    return sum(state.values()) / (sum(sizes) * element), extra / element
