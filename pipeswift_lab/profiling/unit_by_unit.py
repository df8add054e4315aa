"""Profiling a model that need not fit on the device: one unit at a time, made, timed on its real input, freed.

``profile(meta_model, sample, layers=...)`` (or ``unit_by_unit=True`` for a model with real tensors) builds each
unit as a one-unit pipeline stage would be built (an ``nn.Sequential``'s child; otherwise a copy of the model holding
only that unit, :func:`~pipeswift_lab.profiling.unit_copies.stage_copy`), makes its tensors on the device and fills
them as the runner initializes a stage (:mod:`~pipeswift_lab.core.meta_device`: timing does not depend on the
values), and
profiles it with :func:`~pipeswift_lab.profiling.measure.profile` on the output of the unit before it: the first
unit takes the sample, the last one the loss. The unit is then freed, so the device's peak is the largest unit
with its activations, not the model.

``repeated="once"`` times only the first block of each class of identical blocks (same type, same parameter names,
shapes and dtypes) and gives its times and measured bytes to the others; every unit keeps its own parameter
counts. An 80-block model then profiles in the time of a few units.

The rows are the units' rows, in order; the whole step's samples are the sums of the units' steps (each unit's step
includes the glue code its copy runs, so ``coverage`` shows what the cut adds). ``meta["live_peak_bytes"]`` is the
most tensor bytes the process held in any unit's memory step.
"""

from __future__ import annotations

import contextlib
import gc
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from ..core.meta_device import check_initializable, initial_values, is_meta_model, materialize, shape_pass
from ..core.progress import progress_bar
from .clocks import make_clock
from .pipeline_settings import model_config_of, training_settings
from .table import Profile
from .unit_copies import StageForward, stage_copy
from .unit_options import REPEATED, UnitByUnit
from .units import auto_announcement, move_to_device, units_in_run_order

__all__ = ["REPEATED", "profile_one_unit_at_a_time", "profile_unit_by_unit", "unit_signature"]


def unit_signature(module: nn.Module) -> tuple[Any, ...]:
    """What makes two units identical for ``repeated="once"``: type, and every tensor's name, shape and dtype."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return (type(module).__qualname__, tuple((n, tuple(t.shape), str(t.dtype)) for n, t in tensors))


def _unit_module(model: nn.Module, units: list[tuple[str, nn.Module]], i: int) -> nn.Module:
    """Unit ``i`` as a module of its own, still on the meta device (a copy: the caller's model is not changed)."""
    import copy

    if isinstance(model, nn.Sequential) and all(name in model._modules for name, _ in units):
        return nn.Sequential(OrderedDict([(units[i][0], copy.deepcopy(units[i][1]))]))
    module = stage_copy(model, [(name,) for name, _ in units], i)
    forward = module.__dict__.get("forward")
    if i == len(units) - 1 and isinstance(forward, StageForward):
        module.forward = forward.forward  # the loss takes the model's own output
    return module


def _fill(module: nn.Module, device: torch.device, seed: int, init: Any) -> None:
    """Make ``module``'s tensors on ``device`` and initialize them as a run does (seeded by each submodule's name)."""
    materialize(module, device, lambda keys: initial_values(module, keys, device, seed, init))


def _next_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """What unit ``module`` sends to the next one, detached: a tensor that wants a gradient, as a stage's input."""
    with torch.no_grad(), training_settings(module), torch.random.fork_rng():
        out = module(*args, **kwargs)
    if not isinstance(out, torch.Tensor):
        raise ValueError(
            f"a unit sends one tensor to the next; {type(module).__name__} returned {type(out).__name__} (profile "
            "one unit at a time needs a forward that carries one tensor from layer to layer)"
        )
    out = out.detach()
    return out.requires_grad_() if out.is_floating_point() else out


def profile_unit_by_unit(
    model: nn.Module,
    units: list[tuple[str, nn.Module]],
    sample_args: tuple[Any, ...],
    sample_kwargs: dict[str, Any],
    *,
    target: Any,
    loss_fn: Callable[..., torch.Tensor] | None,
    device: torch.device,
    warmup: int,
    repeats: int,
    progress: bool,
    precision: str | None,
    recompute: bool,
    repeated: str,
    seed: int,
    init: Any,
    memory_cap: int | None,
    profile_unit: Callable[..., Profile],
) -> Profile:
    """The :class:`Profile` of ``model``'s ``units`` (in run order), measured one unit at a time on ``device``.

    ``profile_unit`` is :func:`~pipeswift_lab.profiling.measure.profile`, which each unit goes through. Raises
    ``MemoryError`` naming the unit whose memory step held more tensor bytes than ``memory_cap``."""
    timed: dict[tuple[Any, ...], Profile] = {}
    rows: list[pd.DataFrame] = []
    parts: list[Profile] = []
    x: tuple[Any, ...] = sample_args
    last = len(units) - 1
    with progress_bar(
        total=len(units), desc=f"profiling {type(model).__name__} unit by unit", progress=progress
    ) as bar:
        for i, (name, _) in enumerate(units):
            module = _unit_module(model, units, i)
            signature = unit_signature(units[i][1]) if repeated == "once" and 0 < i < last else None
            if signature is not None and signature in timed:
                part = timed[signature]
            else:
                _fill(module, device, seed, init)
                part = profile_unit(
                    module,
                    *x,
                    target=target if i == last else None,
                    loss_fn=loss_fn if i == last else None,
                    layers=[name],
                    warmup=warmup,
                    repeats=repeats,
                    device=device,
                    progress=False,
                    sample_kwargs=sample_kwargs or None,
                    recompute=recompute,
                    precision=precision,
                )
                _check_cap(part, name, memory_cap)
                if signature is not None:
                    timed[signature] = part
                if i < last:
                    x = (_next_input(module, x, sample_kwargs),)
            row = part.df.iloc[[0]].copy()
            row["name"] = name
            row["params"] = sum(p.numel() for p in units[i][1].parameters())
            row["param_bytes"] = sum(p.numel() * p.element_size() for p in units[i][1].parameters())
            rows.append(row)
            parts.append(part)
            del module
            gc.collect()
            bar.update(1)
    return _merged(model, rows, parts, repeated)


def _check_cap(part: Profile, name: str, memory_cap: int | None) -> None:
    peak = part.meta.get("live_peak_bytes", float("nan"))
    if memory_cap is not None and peak == peak and peak > memory_cap:
        raise MemoryError(
            f"unit {name!r} held {peak / 2**20:.1f} MiB of tensors at its peak, above memory_cap="
            f"{memory_cap / 2**20:.1f} MiB: it does not fit even alone; profile with a smaller micro-batch or on a "
            "larger device"
        )


def _merged(model: nn.Module, rows: Sequence[pd.DataFrame], parts: Sequence[Profile], repeated: str) -> Profile:
    df = pd.concat(rows, ignore_index=True)
    df["layer"] = range(len(df))
    first, last = parts[0].meta, parts[-1].meta
    steps = np.sum([p.step_samples_ms for p in parts], axis=0)
    peaks = [p.meta.get("live_peak_bytes", float("nan")) for p in parts]
    meta = {
        **first,
        "model": type(model).__name__,
        "model_params": int(sum(p.numel() for p in model.parameters())),
        "model_config": model_config_of(model),
        "step_ms_samples": [float(s) for s in steps],
        "loss": last.get("loss"),
        "target_bytes": last.get("target_bytes"),
        "loss_activation_bytes": last.get("loss_activation_bytes"),
        "loss_transient_bytes": last.get("loss_transient_bytes"),
        "loss_retained_bytes": last.get("loss_retained_bytes"),
        "live_peak_bytes": float(np.nanmax(peaks)) if not all(p != p for p in peaks) else float("nan"),
        "unit_by_unit": True,
        "repeated": repeated,
        "timed_units": len({id(p) for p in parts}),
    }
    return Profile(df, meta)


def profile_one_unit_at_a_time(
    model: nn.Module,
    units: list[tuple[str, nn.Module]],
    auto: bool,
    sample_args: tuple[Any, ...],
    sample_kwargs: dict[str, Any],
    *,
    device: torch.device | str | None,
    unit_options: UnitByUnit,
    **options: Any,
) -> Profile:
    """:func:`~pipeswift_lab.profiling.measure.profile` one unit at a time (:func:`profile_unit_by_unit`), after
    checking its options and putting ``layers="auto"``'s units in run order (a forward on the meta device)."""
    init, memory_cap = unit_options.init, unit_options.memory_cap
    if is_meta_model(model) or init is not None:
        check_initializable(model, init)
    resolved = torch.device("cpu") if device is None else torch.device(device)
    make_clock(resolved)  # refuse unsupported devices (the meta device among them) before anything runs
    if auto:
        with training_settings(model), shape_pass(model, resolved) as lift:
            units, left_out = units_in_run_order(units, lambda: model(*(lift(a) for a in sample_args)))
        print(auto_announcement(model, units, left_out))
    args, kwargs = move_to_device(sample_args, resolved), move_to_device(sample_kwargs, resolved)
    target = move_to_device(options.pop("target"), resolved)
    with _capped(resolved, memory_cap):
        return profile_unit_by_unit(
            model, units, args, kwargs, target=target, device=resolved, repeated=unit_options.repeated,
            seed=unit_options.seed, init=init, memory_cap=memory_cap, **options,
        )  # fmt: skip


@contextlib.contextmanager
def _capped(device: torch.device, memory_cap: int | None) -> Any:
    """On CUDA, cap this process's allocations at ``memory_cap`` bytes for the block; on CPU the cap is checked unit
    by unit from the live-byte counter."""
    if memory_cap is None or device.type != "cuda":  # pragma: no branch
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory  # pragma: no cover - needs a GPU
    torch.cuda.set_per_process_memory_fraction(min(1.0, memory_cap / total), device)  # pragma: no cover
    try:  # pragma: no cover
        yield
    finally:  # pragma: no cover
        torch.cuda.set_per_process_memory_fraction(1.0, device)
