"""Measuring a model into a :class:`~pipeswift_lab.profiling.table.Profile`: what each unit costs per micro-batch.

:func:`profile` measures one training step (forward, loss, backward) of a model, :func:`profile_step` any training
step a function runs, and both return a :class:`Profile`. Each is a list of named steps: check the arguments, resolve
the units and the device, run the steps under the hooks, assemble the table. How units are timed in place is
described in :mod:`pipeswift_lab.profiling.hooks`; which submodules are units in :mod:`pipeswift_lab.profiling.units`.
"""

from __future__ import annotations

import contextlib
import copy
import gc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import nn

from ..core.checks import moved_keywords
from ..core.display import first_line
from ..core.recompute import RECOMPUTE_MODES
from .assemble import build_profile, run_meta, with_traced
from .clocks import make_clock
from .hooks import LayerRecorder, StepRecord, current_unit, iter_tensors, shapes, tensor_bytes
from .pipeline_settings import training_settings
from .profile_request import ProfileRequest, check_model, check_repeats, check_trainable
from .recompute_costs import recompute_columns
from .table import Profile
from .tp_columns import TensorParallelColumns
from .traced_memory import traced_memory
from .unit_options import UnitByUnit, unit_by_unit_options
from .units import (
    AUTO,
    auto_announcement,
    locate_failure,
    model_device,
    move_to_device,
    preserved_state,
    select_units,
    units_in_run_order,
)
from .weight_pass import split_backward_columns

__all__ = ["profile", "profile_step"]

_Units = list[tuple[str, nn.Module]]


@moved_keywords(
    {name: f"unit_by_unit=psl.UnitByUnit({name}=...)" for name in ("repeated", "init", "seed", "memory_cap")}
)
def profile(
    model: nn.Module,
    *sample_args: Any,
    target: Any = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    layers: str | Sequence[str] | None = None,
    warmup: int = 3,
    repeats: int = 10,
    device: torch.device | str | None = None,
    progress: bool = True,
    sample_kwargs: dict[str, Any] | None = None,
    recompute: bool = False,
    precision: str | None = None,
    unit_by_unit: bool | UnitByUnit | None = None,
    tp_plan: Mapping[str, str] | None = None,
) -> Profile:
    """Profile one training step of ``model`` per layer; return a :class:`Profile` of one micro-batch of the batch.

    Each repeat runs ``model(*sample_args, **sample_kwargs)``, the loss and the backward,
    with every unit timed in place (see :mod:`pipeswift_lab.profiling.hooks`): ``layers=None``
    takes the children of an ``nn.Sequential``; ``layers="auto"`` takes the repeated blocks
    (the children of the longest ``nn.ModuleList`` / ``nn.ModuleDict`` / ``nn.Sequential`` of
    one block class, e.g. a transformer's decoder layers) and the modules with parameters
    around them (embeddings before; final norm and head after), prints one line saying what
    it chose, and raises ``ValueError`` on a model without repeated blocks (see
    :func:`pipeswift_lab.profiling.units.auto_units`); otherwise give submodule names or dotted
    glob patterns (``"blocks.*"``; ``*`` stays within one name segment). The loss is
    ``loss_fn(output, target)``, ``loss_fn(output)`` without a target, and the sum of all
    floating-point outputs without ``loss_fn`` (a backward with a gradient of ones).
    ``sample_kwargs`` are keyword arguments for ``model.forward``. Sample tensors are moved
    to ``device`` (default: where the parameters are); a model on another device is
    profiled as a copy moved there. The model runs in training mode
    during the steps, with a Hugging Face config's ``use_cache``, ``output_attentions`` and
    ``output_hidden_states`` off as the runner trains it (:mod:`.pipeline_settings`: a KV cache
    grown in a forward would also change what a recomputed layer computes again), and comes back
    exactly as it was: training flags, parameters, gradients, buffers, hooks, ``requires_grad``,
    the config and the random state.

    ``warmup`` steps are discarded, ``repeats`` kept: times are medians with interquartile
    ranges; ``coverage`` and ``cv`` compare the layers with the measured whole step.
    ``precision="bf16-mixed"`` runs the forward and the loss under ``torch.autocast`` in bf16, as
    ``run(..., precision="bf16-mixed")`` does (``meta["precision"]``). ``recompute=True`` measures
    the model twice more, its layers recomputed fully and selectively, and adds what each costs
    and keeps (:mod:`pipeswift_lab.profiling.recompute_costs`).

    A model built on the meta device (``with torch.device("meta"): ...``), or any model with
    ``unit_by_unit=True`` or a :class:`~pipeswift_lab.UnitByUnit` record (``repeated``, ``init``, ``seed``,
    ``memory_cap``), is profiled one unit at a time (:mod:`pipeswift_lab.profiling.unit_by_unit`): each unit is
    made on ``device`` (default ``"cpu"``), initialized as ``run`` initializes, timed on the previous unit's
    output, and freed; the device's peak is the largest unit with its activations.

    A model with a tensor-parallel plan (``tp_plan={module glob: style}``, else the model's own: a Hugging Face
    model's ``tp_plan``, the reference models') gets the :data:`~pipeswift_lab.profiling.table.TP_COLUMNS`
    (what each layer's parameters, activations, compute and communication become under the plan) and
    ``meta["tp_plan"]`` / ``meta["tp_divides"]``, from one forward on fake tensors
    (:mod:`pipeswift_lab.profiling.tp_columns`); ``tp_plan={}`` leaves them out. A given plan with an unknown style
    or a glob that matches no module raises ``ValueError`` before anything runs.
    """
    from ..core.meta_device import is_meta_model

    request = ProfileRequest.checked(
        model, sample_args, sample_kwargs, target, loss_fn, warmup, repeats, progress, recompute, precision
    )
    auto = isinstance(layers, str) and layers == AUTO
    units = select_units(model, layers, announce=False)
    one_by_one = unit_by_unit_options(unit_by_unit, is_meta_model(model))
    tp = TensorParallelColumns.measured(
        model, units, tp_plan, (request.sample_args, request.sample_kwargs), device=device, precision=request.precision
    )
    if one_by_one is not None:
        from .unit_by_unit import profile_one_unit_at_a_time

        result = profile_one_unit_at_a_time(
            model, units, auto, sample_args, request.sample_kwargs, target=target, loss_fn=loss_fn, warmup=warmup,
            repeats=repeats, device=device, progress=request.progress, recompute=recompute,
            precision=request.precision, unit_options=one_by_one, profile_unit=_profile_unit,
        )  # fmt: skip
    else:
        result = _profile_in_place(model, units, auto, _resolve_device(model, device), request)
    return tp.added_to(result) if tp is not None else result


def _profile_unit(unit_model: nn.Module, *sample_args: Any, **options: Any) -> Profile:
    """:func:`profile` of one unit's copy, without the tensor-parallel columns (the whole model's forward gave
    them, and the copy's plan names modules it no longer holds)."""
    return profile(unit_model, *sample_args, tp_plan={}, **options)


def _profile_in_place(
    model: nn.Module, units: _Units, auto: bool, device: torch.device, request: ProfileRequest
) -> Profile:
    """Profile the whole model on ``device`` (a copy when it is elsewhere) and return the :class:`Profile`: the
    units put in run order (``layers="auto"``), the steps timed, the memory step taken (on the exported graph
    when the runner will trace the model), and the recomputation and split-backward columns added."""
    runnable, units = _on_device(model, units, device)
    args = move_to_device(request.sample_args, device)
    kwargs = move_to_device(request.sample_kwargs, device)
    with preserved_state(runnable, device), training_settings(runnable):
        runnable.train()
        if auto:  # the blocks and the modules around them, in the order they run
            units, left_out = units_in_run_order(units, lambda: runnable(*args, **kwargs))
            print(auto_announcement(runnable, units, left_out))
        step = _TrainingStep(
            model=runnable,
            units=units,
            args=args,
            kwargs=kwargs,
            target=move_to_device(request.target, device),
            loss_fn=request.loss_fn,
            precision=request.precision,
        )

        def measure(show: bool = request.progress) -> tuple[list[StepRecord], StepRecord | None]:
            return _measure(runnable, units, device, step, warmup=request.warmup, repeats=request.repeats,
                            progress=show, desc=_desc(model))  # fmt: skip

        records, graph = _with_exported_memory(measure(), step, device)
        extra = _extra_columns(step, records[0], request.recompute, lambda: measure(False))
    meta = _profile_meta(device, request, graph)
    return build_profile(runnable, units, records, meta, extra)


def _with_exported_memory(
    records: tuple[list[StepRecord], StepRecord | None], step: _TrainingStep, device: torch.device
) -> tuple[tuple[list[StepRecord], StepRecord | None], str]:
    """``(records, graph)``: the memory step replaced by what the exported graph keeps (``"torch.export"``) for a
    model the runner traces (anything but an ``nn.Sequential``), when the export succeeds; else as measured
    (``"eager"``)."""
    kept, memory = records
    if memory is None or isinstance(step.model, nn.Sequential):
        return records, "eager"
    traced = traced_memory(
        step.model, step.units, kept[0].first_call_order, step.args, step.kwargs, step.target,
        lambda o, t: _loss_of(o, t, step.loss_fn), autocast=device.type if step.precision == "bf16-mixed" else None,
    )  # fmt: skip
    if traced is None:
        return records, "eager"
    return (kept, with_traced(memory, traced)), "torch.export"


def _extra_columns(
    step: _TrainingStep,
    kept: list[StepRecord],
    recompute: bool,
    measure_again: Callable[[], tuple[list[StepRecord], StepRecord | None]],
) -> dict[str, list[float]]:
    """The columns beyond the timed ones: what recomputing each layer costs and keeps (``recompute=True``), and what
    a zero-bubble input-gradient pass keeps for its weight-gradient pass and what each takes."""
    extra: dict[str, list[float]] = {}
    modules = [m for _, m in step.units]
    if recompute:
        extra.update(recompute_columns(modules, kept, measure_again))
    with step._autocast():
        modes = RECOMPUTE_MODES if recompute else ()
        extra.update(split_backward_columns(step.units, lambda: step.model(*step.args, **step.kwargs), modes))
    return extra


def _profile_meta(device: torch.device, request: ProfileRequest, graph: str) -> dict[str, Any]:
    """What the profile says about how it was taken: the device, the loss, the repeats, the memory graph, the
    precision and the bytes of the sample and the target."""
    loss_fn = request.loss_fn
    loss_name = "sum of outputs" if loss_fn is None else getattr(loss_fn, "__name__", type(loss_fn).__name__)
    meta = run_meta("profile", device, loss=loss_name, warmup=request.warmup, repeats=request.repeats)
    meta["memory_graph"] = graph
    meta["precision"] = request.precision or "fp32"
    meta["input_bytes"] = sum(tensor_bytes(t) for t in iter_tensors((request.sample_args, request.sample_kwargs)))
    meta["target_bytes"] = sum(tensor_bytes(t) for t in iter_tensors(request.target))
    return meta


def profile_step(
    model: nn.Module,
    step: Callable[[], Any],
    *,
    layers: str | Sequence[str] | None = None,
    warmup: int = 3,
    repeats: int = 10,
    progress: bool = True,
) -> Profile:
    """Profile whatever training step ``step()`` runs, attributing its time to ``model``'s layers.

    ``step`` is a callable with no arguments (its own loss, optimizer, anything) that calls
    ``model``; it runs ``warmup + repeats`` times, for real (an optimizer step in it does
    update the model). Units and their timing are as in :func:`profile`; the whole step is
    the call of ``step``, so ``coverage`` shows the share spent outside the layers. This is
    what the ``%%pipeswift_profile`` cell magic runs. Returns the :class:`Profile`.
    """
    check_model(model)
    if not callable(step):
        raise TypeError(
            f"step must be a callable with no arguments that runs one training step; got {type(step).__name__}"
        )
    warmup, repeats, progress = check_repeats(warmup, repeats, progress)
    check_trainable(model)
    auto = isinstance(layers, str) and layers == AUTO
    units = select_units(model, layers, announce=False)
    device = model_device(model)

    def announce(record: StepRecord) -> None:  # the step really trains: its first call tells the order
        print(auto_announcement(model, [units[u] for u in record.first_call_order]))

    records = _measure(
        model,
        units,
        device,
        lambda recorder: step(),
        warmup=warmup,
        repeats=repeats,
        progress=progress,
        desc=f"{_desc(model)} step",
        memory=False,  # the user's step really trains: no extra step for memory
        on_first_step=announce if auto else None,
    )
    meta = run_meta("step", device, loss="step", warmup=warmup, repeats=repeats)
    return build_profile(model, units, records, meta)


# -- resolve -----------------------------------------------------------------------------------
def _resolve_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    """The device to profile on (default: the model's), with a CUDA index; refuse unsupported devices early."""
    resolved = model_device(model) if device is None else torch.device(device)
    if resolved.type == "cuda" and resolved.index is None and torch.cuda.is_available():
        resolved = torch.device("cuda", torch.cuda.current_device())
    make_clock(resolved)  # refuse unsupported devices before running anything
    return resolved


def _on_device(model: nn.Module, units: _Units, device: torch.device) -> tuple[nn.Module, _Units]:
    """``(model, units)`` on ``device``: the model itself if it is there, else a copy moved there."""
    if device == model_device(model):
        return model, units
    moved = copy.deepcopy(model).to(device)
    lookup = dict(moved.named_modules())
    return moved, [(name, lookup[name]) for name, _ in units]


def _desc(model: nn.Module) -> str:
    return f"profiling {type(model).__name__}"


# -- execute -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class _TrainingStep:
    """One training step of :func:`profile`: forward, loss, backward, called with the recorder that times it."""

    model: nn.Module
    """The model on the profiling device."""
    units: _Units
    """The timed units, to name the one a failing forward was in."""
    args: tuple[Any, ...]
    """Positional inputs of ``model.forward``, on the device."""
    kwargs: dict[str, Any]
    """Keyword inputs of ``model.forward``, on the device."""
    target: Any
    """The loss target (None: the loss takes the output alone)."""
    loss_fn: Callable[..., torch.Tensor] | None
    """The loss (None: the sum of the floating-point outputs)."""
    keep_grads: bool = False
    """Add to the gradients there are instead of starting from none (a pipeline stage's every backward but its
    first of a step)."""
    precision: str | None = None
    """``"bf16-mixed"``: the forward and the loss under ``torch.autocast`` in bf16."""

    def __call__(self, recorder: LayerRecorder) -> None:
        if not self.keep_grads:
            for p in self.model.parameters():
                p.grad = None
        with self._autocast():
            try:
                output = self.model(*self.args, **self.kwargs)
            except Exception as exc:
                raise ValueError(self._misfit(recorder, exc)) from exc
            recorder.before_loss(output)
            loss = _loss_of(output, self.target, self.loss_fn)
        recorder.before_backward()
        loss.backward()
        recorder.after_backward()

    def _autocast(self) -> Any:
        if self.precision != "bf16-mixed":
            return contextlib.nullcontext()
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        return torch.autocast(device.type, dtype=torch.bfloat16)

    def _misfit(self, recorder: LayerRecorder, exc: Exception) -> str:
        """Why the sample does not fit the model: the unit and layer that failed, and the sample's shapes."""
        unit = current_unit(recorder)
        where = locate_failure(self.model, exc)
        name = self.units[unit][0] if unit is not None else None
        unit_text = f" in unit {name!r}" if name is not None and f"layer {name!r} " not in where else ""
        keywords = f" and { ({k: shapes(v) for k, v in self.kwargs.items()}) }" if self.kwargs else ""
        return (
            f"the sample does not fit the model: {type(exc).__name__}{unit_text} at {where}; "
            f"sample shapes {shapes(self.args)}{keywords}: {first_line(exc)}"
        )


def _measure(
    model: nn.Module,
    units: _Units,
    device: torch.device,
    run_step: Callable[[LayerRecorder], Any],
    *,
    warmup: int,
    repeats: int,
    progress: bool,
    desc: str,
    memory: bool = True,
    on_first_step: Callable[[StepRecord], None] | None = None,
) -> tuple[list[StepRecord], StepRecord | None]:
    """Run ``run_step(recorder)`` ``warmup + repeats`` times under the hooks and, with ``memory``, once more,
    untimed, measuring memory; return the kept StepRecords and the memory step's (None without)."""
    from ..core.progress import progress_bar

    clock = make_clock(device)
    records = []
    with (
        LayerRecorder(model, units, clock) as recorder,
        progress_bar(total=warmup + repeats, desc=desc, progress=progress, leave=False) as bar,
    ):
        for i in range(warmup + repeats):
            recorder.begin_step()
            run_step(recorder)
            record = recorder.end_step()
            if i == 0:
                never = [units[u][0] for u in range(len(units)) if record.calls[u] == 0]
                if never:
                    raise ValueError(
                        f"layers {never} never ran in the step; remove them from layers (names or patterns)"
                    )
                if on_first_step is not None:
                    on_first_step(record)
            if i >= warmup:
                records.append(record)
            bar.update(1)
        return records, _memory_step(recorder, device, run_step) if memory else None


def _memory_step(recorder: LayerRecorder, device: torch.device, run_step: Callable[[LayerRecorder], Any]) -> StepRecord:
    """One more step, its memory measured unit by unit (CUDA's allocator statistics, or on CPU every storage the
    operators allocate, :mod:`pipeswift_lab.core.live_bytes`); its times are not kept. A profiled training step runs
    twice: from no gradients (each layer's weight gradients become ``.grad`` in its backward), then adding to them
    (each weight gradient a temporary, :attr:`StepRecord.accumulate_transient_bytes`).

    Garbage is collected first, once: a tensor held only by a reference cycle (what an earlier cell or test left
    behind) would be counted as alive before the step and freed when the collector next ran, inside some layer,
    whose kept bytes then come out negative and whose transient grows by the garbage's size. Once per profile, not
    per measure: a full collection of a process that has imported torch takes about 0.2 s here."""
    gc.collect()
    first = _measured_step(recorder, device, run_step)
    if not isinstance(run_step, _TrainingStep):
        return first
    again = _measured_step(recorder, device, replace(run_step, keep_grads=True))
    return replace(first, accumulate_transient_bytes=again.transient_bytes)


def _measured_step(
    recorder: LayerRecorder, device: torch.device, run_step: Callable[[LayerRecorder], Any]
) -> StepRecord:
    from ..core.live_bytes import LiveTensorBytes, live_tensors, memory_meter
    from .crossings import BEFORE

    # every storage, on CUDA too, to tell which unit allocated it; an in-place update of what exists allocates nothing
    tracker = LiveTensorBytes()
    tracker.adopt(live_tensors(), BEFORE)
    recorder.meter = memory_meter(device, tracker)
    recorder.tracker = tracker
    try:
        with tracker:
            recorder.begin_step()
            run_step(recorder)
            return replace(recorder.end_step(), live_peak_bytes=float(tracker.peak_bytes))
    finally:
        recorder.meter = None
        recorder.tracker = None


def _loss_of(output: Any, target: Any, loss_fn: Callable[..., torch.Tensor] | None) -> torch.Tensor:
    """The scalar loss of one step: ``loss_fn(output, target)``, ``loss_fn(output)``, or the sum of the outputs."""
    if loss_fn is not None:
        try:
            loss = loss_fn(output) if target is None else loss_fn(output, target)
        except Exception as exc:
            raise ValueError(
                f"loss_fn failed on the model output (shapes {shapes(output)}) and target (shapes {shapes(target)}): "
                f"{type(exc).__name__}: {first_line(exc)}"
            ) from exc
    else:
        floats = [t for t in iter_tensors(output) if t.is_floating_point() or t.is_complex()]
        if not floats:
            raise ValueError(
                f"the model output has no floating-point tensor to sum into a loss (output shapes {shapes(output)}); "
                "pass loss_fn"
            )
        loss = cast(torch.Tensor, sum(t.real.sum() if t.is_complex() else t.sum() for t in floats))
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar tensor; it returned {got}")
    if not loss.requires_grad:
        raise ValueError(
            "the loss does not depend on any trainable parameter (it has no grad_fn); "
            "check requires_grad and torch.no_grad()"
        )
    return loss
