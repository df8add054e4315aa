"""A model whose tensors report the device a rank runs on, with no storage behind them: what a stage is traced with.

A graph traced on one device keeps that device's choices. A forward that branches on
``x.device.type`` (transformers' mixture-of-experts layers take a float histogram input on
``cpu`` and an int one elsewhere), on ``x.is_cuda`` or on a device it reads from a tensor keeps
the branch taken while tracing, and devices it passes to factories (``torch.arange(n,
device=x.device)``) are burned into the graph. Traced on ``meta``, such a graph fails or differs
on the rank. So the runner traces a stage with torch's fake tensors
(``torch._subclasses.fake_tensor.FakeTensorMode``): each parameter, buffer and input is a fake
tensor *on the rank's device* (``cpu`` or ``cuda:{local_rank}``), which has a shape, a dtype and
a device and no memory. The traced stages then hold fake tensors; :func:`fake_to_meta` turns them
into meta tensors, which the rank makes and fills as any meta structure
(:func:`~pipeswift_lab.core.meta_device.materialize`).

See "Tracing on one device and running on another" in docs/development.md's traps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["fake_to_meta", "faked_on", "is_fake", "trace_device"]


def trace_device(device_type: str, indices: tuple[int, ...] | None) -> torch.device:
    """The device a run's first rank computes on (``cuda:{index}`` or ``cpu``): the device its stages are traced
    on."""
    if device_type == "cuda":
        return torch.device("cuda", indices[0] if indices else 0)
    return torch.device(device_type)


def is_fake(t: Any) -> bool:
    """Whether ``t`` is one of torch's fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _swap_tensors(
    model: nn.Module,
    make: Callable[[torch.Tensor], torch.Tensor],
    which: Callable[[torch.Tensor], bool] = lambda t: True,
) -> list[tuple[dict, str, Any]]:
    """Replace every parameter and buffer of ``model`` that is ``which`` by ``make(tensor)`` (a parameter stays a
    parameter with its ``requires_grad``; a tensor held under several names is made once, so ties stay); return
    ``(table, name, original)`` of each, to put back."""
    made: dict[int, Any] = {}
    undo: list[tuple[dict, str, Any]] = []
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is None or not which(t):
                    continue
                if id(t) not in made:
                    new = make(t.detach())
                    if isinstance(t, nn.Parameter):
                        new = nn.Parameter(new, requires_grad=t.requires_grad)
                    made[id(t)] = new
                undo.append((table, name, t))
                table[name] = made[id(t)]
    return undo


@contextmanager
def faked_on(
    modules: nn.Module | Sequence[nn.Module], device: torch.device, *, run: bool = False
) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """Within the block every parameter and buffer of ``modules`` (a model, or several sharing one mode) is a fake
    tensor on ``device`` (same shape, dtype, strides, ties and ``requires_grad``), all of one ``FakeTensorMode``;
    yields ``lift(tensor)``, which turns an input (real or meta) into a fake tensor of that mode on ``device``.
    Afterwards the modules hold their own tensors again, whatever the block raised.

    Nothing is allocated: a model of any size, real or on the meta device, can be traced for any device this way.
    For a trace the mode is not entered (torch's tracers find it from the fake inputs); ``run=True`` enters it, so
    that a forward called in the block makes its own tensors fake too, and takes the real tensors it holds
    elsewhere. It also runs the forward as torch's tracer does, with ``torch.compiler.is_compiling()`` true: a
    library then takes the kernels it takes in a trace (transformers' experts skip ``grouped_mm`` on a CPU in
    float32, whose fake kernel accepts bfloat16 alone), so the shapes seen are those of the traced graph."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # a value read in a run (``.item()``, ``.tolist()``) becomes a symbol, as in torch.export, instead of an error
    mode = FakeTensorMode(allow_non_fake_inputs=run, shape_env=ShapeEnv() if run else None)
    device = torch.device(device)

    def lift(t: torch.Tensor) -> torch.Tensor:
        with mode:
            return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)

    undo = [
        u for module in ([modules] if isinstance(modules, nn.Module) else modules) for u in _swap_tensors(module, lift)
    ]
    try:
        with mode if run else contextlib.nullcontext(), _as_traced() if run else contextlib.nullcontext():
            yield lift
    finally:
        for table, name, original in reversed(undo):
            table[name] = original


def _as_traced() -> contextlib.AbstractContextManager[Any]:
    """The block runs with ``torch.compiler.is_compiling()`` true, as in a ``torch.export`` trace."""
    session = getattr(torch.compiler, "_compile_session_context", None)
    return session() if session is not None else contextlib.nullcontext()


def fake_to_meta(module: nn.Module) -> None:
    """Replace every fake parameter and buffer of ``module`` (a stage traced under :func:`faked_on`) by a meta
    tensor of its shape and dtype, ties kept.

    Raises ``ValueError`` naming the attribute when a graph holds a fake tensor that is neither a parameter nor a
    buffer (a constant the forward made while it was traced): no checkpoint or init can give it a value."""
    _swap_tensors(module, _meta_like, is_fake)
    for name, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if is_fake(value):
                raise ValueError(
                    f"the traced stage holds a tensor constant {name + '.' if name else ''}{attr} that the forward "
                    "made while it was traced; its values are not known on the rank. Make it a buffer of its module, "
                    'or pass split="manual" to run(): each stage is then a copy of the model run eagerly'
                )


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
