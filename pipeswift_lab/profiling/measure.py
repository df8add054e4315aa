"""Per-layer profiles: what each unit of a model costs in time and memory per micro-batch.

Every plan in the lab starts from measured per-layer costs. The practitioners' recipe
(GPipe, Huang et al., NeurIPS 2019; PipeDream, Narayanan et al., SOSP 2019; torchgpipe's
``balance_by_time``, Kim et al., 2020) is to fix the micro-batch size, measure each layer's
forward and backward time and memory on a representative batch, and cut stages by
cumulative cost. :func:`profile` measures one training step (forward, loss, backward) of a
model, :func:`profile_step` any training step a function runs, and both return a
:class:`Profile`. How units are timed in place is described in
:mod:`pipeswift_lab.profiling.hooks`.
"""

from __future__ import annotations

import copy
import json
import math
import numbers
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from torch import nn

from ..core.checks import check_int, check_time, nonnegative_column
from ..core.display import first_line, html_card, noise_note, noise_warning, text_card
from .hooks import LayerRecorder, current_unit, iter_tensors, make_clock, shapes
from .units import locate_failure, model_device, move_to_device, preserved_state, select_units

#: Per-layer columns of :attr:`Profile.df`, in order.
COLUMNS = (
    "layer", "name", "type", "calls", "fwd_ms", "bwd_ms", "total_ms", "fwd_ms_iqr", "bwd_ms_iqr",
    "params", "param_bytes", "activation_bytes", "output_bytes", "peak_bytes",
)  # fmt: skip
#: Columns every Profile table has (``calls`` and ``wgrad_ms`` are optional).
REQUIRED_COLUMNS = tuple(c for c in COLUMNS if c != "calls")
_TIME_COLUMNS = ("fwd_ms", "bwd_ms", "fwd_ms_iqr", "bwd_ms_iqr", "wgrad_ms")
_COUNT_COLUMNS = ("calls", "params", "param_bytes", "activation_bytes", "output_bytes")
_CSV_HEADER = "# pipeswift_lab.Profile "


def _check_columns(df) -> None:
    """Refuse per-layer values a Profile cannot hold: the layer times must be finite numbers >= 0;
    spreads, ``wgrad_ms`` and byte/parameter counts numbers >= 0 (NaN where unknown)."""
    for col in ("fwd_ms", "bwd_ms", "total_ms") + _TIME_COLUMNS[2:] + _COUNT_COLUMNS:
        if col not in df.columns:
            continue
        required = col in ("fwd_ms", "bwd_ms", "total_ms")
        _, bad = nonnegative_column(df[col], allow_missing=not required)
        if bad:
            i, value = bad
            name = df["name"].iloc[i] if "name" in df.columns else i
            what = "a finite number >= 0 (ms)" if required else "a number >= 0, or empty/NaN where unknown"
            raise ValueError(f"df[{col!r}] of layer {i} ({name!r}) is {value!r}; each value must be {what}")


@dataclass(frozen=True, eq=False)
class Profile:
    """Measured (or synthetic) per-layer costs of one micro-batch.

    ``df`` has one row per layer in execution order: ``layer`` (0..L-1), ``name``, ``type``,
    ``calls`` (forward calls per step), ``fwd_ms``, ``bwd_ms`` (medians over the repeats),
    ``total_ms`` (their sum), ``fwd_ms_iqr``, ``bwd_ms_iqr`` (interquartile ranges),
    ``params``, ``param_bytes``, ``activation_bytes`` (bytes saved for backward: what a stage
    holds per in-flight micro-batch), ``output_bytes`` (what crosses a stage boundary after
    this layer) and ``peak_bytes`` (CUDA only; NaN otherwise). ``meta`` holds the device,
    dtype, batch shape, torch version, repeats, warmup and the measured whole-step times
    (``step_ms_samples``).
    """

    df: pd.DataFrame
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.df, pd.DataFrame):
            raise TypeError(f"df must be a pandas DataFrame; got {type(self.df).__name__}")
        missing = [c for c in REQUIRED_COLUMNS if c not in self.df.columns]
        if missing:
            raise ValueError(f"df is missing the Profile columns {missing}; it has {list(self.df.columns)}")
        if len(self.df) == 0:
            raise ValueError("df has no rows; a Profile needs at least one layer")
        if self.df["layer"].tolist() != list(range(len(self.df))):
            raise ValueError(f"df['layer'] must be 0..{len(self.df) - 1} in order; got {self.df['layer'].tolist()}")
        if not isinstance(self.meta, dict):
            raise TypeError(f"meta must be a dict; got {type(self.meta).__name__}")
        _check_columns(self.df)
        object.__setattr__(self, "meta", dict(self.meta))

    # -- sizes and totals -------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        """Number of layers (rows of ``df``)."""
        return len(self.df)

    @property
    def layer_names(self) -> tuple[str, ...]:
        """Layer names in order."""
        return tuple(self.df["name"])

    @property
    def total_ms(self) -> float:
        """Sum of the layers' forward plus backward medians, in ms per micro-batch."""
        return float(self.df["total_ms"].sum())

    @property
    def step_samples_ms(self) -> list[float]:
        """The measured whole-step times, one per repeat (empty for a synthetic profile)."""
        return [float(x) for x in self.meta.get("step_ms_samples", [])]

    @property
    def step_ms(self) -> float:
        """Median measured whole step in ms (NaN when nothing was measured)."""
        samples = self.step_samples_ms
        return float(np.median(samples)) if samples else float("nan")

    @property
    def coverage(self) -> float:
        """``total_ms`` over the median measured step: the share of the step the layers explain.

        Below 1, the step spends time outside the layers (loss, glue code between them,
        optimizer in a custom step, framework overhead). NaN for a synthetic profile.
        """
        step = self.step_ms
        return self.total_ms / step if step > 0 else float("nan")

    @property
    def cv(self) -> float:
        """Run-to-run coefficient of variation of the whole step (sample std over mean); NaN below 2 repeats."""
        samples = self.step_samples_ms
        if len(samples) < 2:
            return float("nan")
        mean = float(np.mean(samples))
        return float(np.std(samples, ddof=1) / mean) if mean > 0 else float("nan")

    # -- construction -------------------------------------------------------------------
    @classmethod
    def synthetic(cls, fwd_ms, bwd_ms, meta: dict | None = None, **columns) -> Profile:
        """A Profile from given per-layer times, for what-if studies without a model.

        ``fwd_ms`` and ``bwd_ms`` are sequences of non-negative finite ms, one per layer.
        ``columns`` sets any other per-layer column (a sequence of the same length, or one
        value for every layer), e.g. ``param_bytes``, ``activation_bytes``, ``output_bytes``,
        ``wgrad_ms`` (the weight-gradient part of ``bwd_ms``), ``name`` or ``type``.
        Defaults: names ``layer_0``…, type ``"synthetic"``, one call, zero spreads, zero
        parameters and bytes, NaN peak. Returns the Profile; its ``coverage`` and ``cv`` are NaN.
        """
        fwd = _time_list("fwd_ms", fwd_ms)
        bwd = _time_list("bwd_ms", bwd_ms)
        if len(fwd) != len(bwd):
            raise ValueError(
                f"fwd_ms has {len(fwd)} layers but bwd_ms has {len(bwd)}; give one value per layer in both"
            )
        n = len(fwd)
        for forbidden in ("layer", "total_ms"):
            if forbidden in columns:
                raise ValueError(f"{forbidden} is derived (layer = 0..L-1, total_ms = fwd_ms + bwd_ms); do not pass it")
        data = {
            "layer": list(range(n)), "name": [f"layer_{i}" for i in range(n)], "type": ["synthetic"] * n,
            "calls": [1] * n, "fwd_ms": fwd, "bwd_ms": bwd, "total_ms": [f + b for f, b in zip(fwd, bwd)],
            "fwd_ms_iqr": [0.0] * n, "bwd_ms_iqr": [0.0] * n, "params": [0] * n, "param_bytes": [0] * n,
            "activation_bytes": [0] * n, "output_bytes": [0] * n, "peak_bytes": [float("nan")] * n,
        }  # fmt: skip
        for name, values in columns.items():
            if isinstance(values, (str, numbers.Number)):
                values = [values] * n
            values = list(values)
            if len(values) != n:
                raise ValueError(
                    f"{name} has {len(values)} values but the profile has {n} layers (len(fwd_ms)); give one per layer"
                )
            data[name] = _column_values(name, values)
        if "wgrad_ms" in data:
            for i, (w, b) in enumerate(zip(data["wgrad_ms"], bwd)):
                if w > b:
                    raise ValueError(
                        f"wgrad_ms[{i}]={w} exceeds bwd_ms[{i}]={b}; the weight-gradient part is inside the backward"
                    )
        names = data["name"]
        if len(set(names)) != n or any(not isinstance(s, str) or not s for s in names):
            raise ValueError(f"name must be distinct non-empty strings; got {names}")
        df = pd.DataFrame(data)
        df = df[list(COLUMNS) + [c for c in df.columns if c not in COLUMNS]]
        return cls(df, {"source": "synthetic", **(meta or {})})

    # -- persistence --------------------------------------------------------------------
    def to_csv(self, path) -> None:
        """Write ``df`` as CSV, preceded by one ``# pipeswift_lab.Profile {meta as JSON}`` line."""
        try:
            header = json.dumps({"meta": self.meta}, sort_keys=True)
        except TypeError as exc:
            raise ValueError(f"meta must be JSON-serializable to save a Profile: {exc}") from exc
        with open(path, "w", newline="", encoding="utf-8") as f:
            f.write(_CSV_HEADER + header + "\n")
            self.df.to_csv(f, index=False)

    @classmethod
    def read_csv(cls, path) -> Profile:
        """Read a Profile written by :meth:`to_csv`; returns it with its ``meta``."""
        with open(path, encoding="utf-8", newline="") as f:
            first = f.readline()
            if not first.startswith(_CSV_HEADER):
                raise ValueError(
                    f"path={str(path)!r} is not a Profile CSV: its first line must start with {_CSV_HEADER.strip()!r} (written by Profile.to_csv)"
                )
            meta = json.loads(first[len(_CSV_HEADER) :])["meta"]
            df = pd.read_csv(
                f, dtype={"name": str, "type": str}, keep_default_na=False, na_values=[""], float_precision="round_trip"
            )
        return cls(df, meta)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Profile):
            return NotImplemented
        return self.meta == other.meta and list(self.df.columns) == list(other.df.columns) and self.df.equals(other.df)

    __hash__ = None

    # -- display ------------------------------------------------------------------------
    def _summary(self) -> dict:
        heaviest = self.df.loc[self.df["total_ms"].idxmax(), "name"] if self.total_ms > 0 else "-"
        summary = {
            "layers": self.n_layers, "device": self.meta.get("device", "-"),
            "batch_shape": self.meta.get("batch_shape", "-"), "total_ms": self.total_ms,
            "step_ms": self.step_ms, "coverage": self.coverage, "cv": self.cv,
            "heaviest": heaviest, "repeats": self.meta.get("repeats", "-"),
        }  # fmt: skip
        return summary

    def _title(self) -> str:
        return f"Profile of {self.meta.get('model', 'a model')} ({self.meta.get('source', 'measured')})"

    def _repr_html_(self) -> str:
        return html_card(self._title(), self._summary(), self.df) + noise_warning(self.cv, "the profiled step")

    def __repr__(self) -> str:
        note = noise_note(self.cv, "the profiled step")
        return text_card(self._title(), self._summary()) + (f"\n  {note}" if note else "")

    def plot(self, ax=None):
        """Stacked forward/backward bars per layer, activation and parameter memory on a twin axis.

        Returns the matplotlib Axes with the bars.
        """
        from ..core.plot import KIND_COLORS, get_ax

        n = self.n_layers
        ax = get_ax(ax, figsize=(max(6.0, 0.45 * n + 2.5), 3.5))
        x = np.arange(n)
        fwd, bwd = self.df["fwd_ms"].to_numpy(float), self.df["bwd_ms"].to_numpy(float)
        ax.bar(x, fwd, color=KIND_COLORS["F"], label="forward")
        ax.bar(x, bwd, bottom=fwd, color=KIND_COLORS["B"], label="backward")
        ax.set_xticks(x, list(self.layer_names), rotation=45 if n > 4 else 0, ha="right" if n > 4 else "center")
        ax.set_ylabel("ms per micro-batch")
        ax.set_xlabel("layer")
        mem = ax.twinx()
        mem.plot(
            x, self.df["activation_bytes"].to_numpy(float) / 2**20, "o-", color="0.25", label="activations saved (MiB)"
        )
        mem.plot(x, self.df["param_bytes"].to_numpy(float) / 2**20, "s--", color="0.6", label="parameters (MiB)")
        mem.set_ylabel("MiB")
        mem.set_ylim(bottom=0)
        mem.grid(False)
        handles = ax.get_legend_handles_labels()[0] + mem.get_legend_handles_labels()[0]
        labels = ax.get_legend_handles_labels()[1] + mem.get_legend_handles_labels()[1]
        ax.legend(
            handles,
            labels,
            loc="upper center",
            bbox_to_anchor=(0.5, -0.32 if n > 4 else -0.2),
            ncols=2,
            fontsize="small",
            frameon=False,
        )
        title = f"{self.meta.get('model', 'profile')}: {self.total_ms:.3g} ms in layers"
        if not math.isnan(self.coverage):
            title += f", coverage {self.coverage:.0%}"
        ax.set_title(title)
        return ax


def _time_list(name, values) -> list[float]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise TypeError(f"{name} must be a sequence of ms per layer; got {type(values).__name__} {values!r}")
    values = list(values)
    if not values:
        raise ValueError(f"{name}=[] is invalid; give at least one layer")
    return [check_time(f"{name}[{i}]", v) for i, v in enumerate(values)]


def _column_values(name: str, values: list) -> list:
    if name in _TIME_COLUMNS:
        return [check_time(f"{name}[{i}]", v) for i, v in enumerate(values)]
    if name in _COUNT_COLUMNS:
        out = []
        for i, v in enumerate(values):
            v = check_time(f"{name}[{i}]", v)
            if v != int(v):
                raise ValueError(f"{name}[{i}]={v} is invalid; {name} counts whole units and must be an integer")
            out.append(int(v))
        return out
    if name == "peak_bytes":
        return [
            float("nan") if isinstance(v, float) and math.isnan(v) else check_time(f"{name}[{i}]", v)
            for i, v in enumerate(values)
        ]
    return values


# -- measuring -----------------------------------------------------------------------------
def _progress(total: int, desc: str, progress: bool):
    """A ``tqdm.auto`` bar over the steps; off with ``progress=False`` or the ``TQDM_DISABLE`` environment variable."""
    from ..core.progress import progress_bar

    return progress_bar(total=total, desc=desc, progress=progress, leave=False)


def _measure(model, units, device, run_step, warmup: int, repeats: int, progress: bool, desc: str):
    """Run ``run_step(recorder)`` ``warmup + repeats`` times under the hooks; return the kept StepRecords."""
    clock = make_clock(device)
    records = []
    with LayerRecorder(model, units, clock) as recorder, _progress(warmup + repeats, desc, progress) as bar:
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
            if i >= warmup:
                records.append(record)
            bar.update(1)
    return records


def _build(model, units, records, meta) -> Profile:
    order = records[0].first_call_order
    fwd = np.array([r.fwd_ms for r in records])
    bwd = np.array([r.bwd_ms for r in records])
    fwd_med, bwd_med = np.median(fwd, axis=0), np.median(bwd, axis=0)
    fwd_iqr = np.percentile(fwd, 75, axis=0) - np.percentile(fwd, 25, axis=0)
    bwd_iqr = np.percentile(bwd, 75, axis=0) - np.percentile(bwd, 25, axis=0)
    cuda = meta["device"].startswith("cuda")
    rows = []
    for layer, u in enumerate(order):
        name, module = units[u]
        params = list(module.parameters())
        rows.append({
            "layer": layer, "name": name, "type": type(module).__name__,
            "calls": int(max(r.calls[u] for r in records)),
            "fwd_ms": float(fwd_med[u]), "bwd_ms": float(bwd_med[u]), "total_ms": float(fwd_med[u] + bwd_med[u]),
            "fwd_ms_iqr": float(fwd_iqr[u]), "bwd_ms_iqr": float(bwd_iqr[u]),
            "params": int(sum(p.numel() for p in params)),
            "param_bytes": int(sum(p.numel() * p.element_size() for p in params)),
            "activation_bytes": int(max(r.activation_bytes[u] for r in records)),
            "output_bytes": int(max(r.output_bytes[u] for r in records)),
            "peak_bytes": float(np.nanmax([r.peak_bytes[u] for r in records])) if cuda else float("nan"),
        })  # fmt: skip
    first_float = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    meta = {
        "model": type(model).__name__,
        "dtype": str(first_float).removeprefix("torch.") if first_float is not None else "-",
        "batch_shape": records[0].batch_shape,
        "batch_size": records[0].batch_shape[0] if records[0].batch_shape else None,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "model_params": int(sum(p.numel() for p in model.parameters())),
        **meta,
        "step_ms_samples": [float(r.step_ms) for r in records],
    }
    return Profile(pd.DataFrame(rows, columns=list(COLUMNS)), meta)


def _loss_of(output, target, loss_fn):
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
                f"the model output has no floating-point tensor to sum into a loss (output shapes {shapes(output)}); pass loss_fn"
            )
        loss = sum(t.real.sum() if t.is_complex() else t.sum() for t in floats)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        got = f"shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a scalar tensor; it returned {got}")
    if not loss.requires_grad:
        raise ValueError(
            "the loss does not depend on any trainable parameter (it has no grad_fn); check requires_grad and torch.no_grad()"
        )
    return loss


def profile(
    model,
    *sample_args,
    target=None,
    loss_fn=None,
    layers=None,
    warmup=3,
    repeats=10,
    device=None,
    progress=True,
    sample_kwargs=None,
) -> Profile:
    """Profile one training step of ``model`` per layer; return a :class:`Profile`.

    Each repeat runs ``model(*sample_args, **sample_kwargs)``, the loss and the backward,
    with every unit timed in place (see :mod:`pipeswift_lab.profiling.hooks`): ``layers=None``
    takes the children of an ``nn.Sequential``; otherwise give submodule names or dotted
    glob patterns (``"blocks.*"``; ``*`` stays within one name segment). The loss is
    ``loss_fn(output, target)``, ``loss_fn(output)`` without a target, and the sum of all
    floating-point outputs without ``loss_fn`` (a backward with a gradient of ones).
    ``sample_kwargs`` are keyword arguments for ``model.forward``. Sample tensors are moved
    to ``device`` (default: where the parameters are); a model on another device is
    profiled as a copy moved there. The model runs in training mode
    during the steps and comes back exactly as it was: training flags, parameters,
    gradients, buffers, hooks, ``requires_grad`` and the random state.

    ``warmup`` steps are discarded, ``repeats`` kept: times are medians with interquartile
    ranges; ``coverage`` and ``cv`` compare the layers with the measured whole step.
    Returns the Profile of one micro-batch of the given batch.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    repeats = check_int("repeats", repeats, minimum=1)
    warmup = check_int("warmup", warmup, minimum=0)
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False; got {progress!r}")
    sample_kwargs = {} if sample_kwargs is None else sample_kwargs
    if not isinstance(sample_kwargs, dict):
        raise TypeError(
            f"sample_kwargs must be a dict of keyword arguments for model.forward; got {type(sample_kwargs).__name__}"
        )
    if not sample_args and not sample_kwargs:
        raise ValueError(
            "profile needs a sample input: profile(model, x) runs model(x); give one representative micro-batch"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, e.g. loss_fn(output, target); got {type(loss_fn).__name__}")
    if target is not None and loss_fn is None:
        raise ValueError("target was given without loss_fn; pass loss_fn=... so the loss is loss_fn(output, target)")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"model ({type(model).__name__}) has no trainable parameters (none with requires_grad=True); there is no backward to profile"
        )
    units = select_units(model, layers)
    home = model_device(model)
    device = home if device is None else torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    make_clock(device)  # refuse unsupported devices before running anything
    if device != home:
        target_model = copy.deepcopy(model).to(device)
        names = [n for n, _ in units]
        lookup = dict(target_model.named_modules())
        units = [(n, lookup[n]) for n in names]
    else:
        target_model = model
    args = move_to_device(sample_args, device)
    kwargs = move_to_device(sample_kwargs, device)
    target = move_to_device(target, device)
    params = list(target_model.parameters())

    def run_step(recorder):
        for p in params:
            p.grad = None
        try:
            output = target_model(*args, **kwargs)
        except Exception as exc:
            unit = current_unit(recorder)
            where = locate_failure(target_model, exc)
            unit_text = (
                f" in unit {units[unit][0]!r}" if unit is not None and f"layer {units[unit][0]!r} " not in where else ""
            )
            raise ValueError(
                f"the sample does not fit the model: {type(exc).__name__}{unit_text} at {where}; "
                f"sample shapes {shapes(args)}{' and ' + str({k: shapes(v) for k, v in kwargs.items()}) if kwargs else ''}: {first_line(exc)}"
            ) from exc
        loss = _loss_of(output, target, loss_fn)
        loss.backward()

    loss_name = "sum of outputs" if loss_fn is None else getattr(loss_fn, "__name__", type(loss_fn).__name__)
    with preserved_state(target_model, device):
        target_model.train()
        records = _measure(
            target_model, units, device, run_step, warmup, repeats, progress, f"profiling {type(model).__name__}"
        )
    meta = {
        "source": "profile", "device": str(device), "timer": make_clock(device).kind,
        "loss": loss_name, "repeats": repeats, "warmup": warmup,
    }  # fmt: skip
    return _build(target_model, units, records, meta)


def profile_step(model, step, *, layers=None, warmup=3, repeats=10, progress=True) -> Profile:
    """Profile whatever training step ``step()`` runs, attributing its time to ``model``'s layers.

    ``step`` is a callable with no arguments (its own loss, optimizer, anything) that calls
    ``model``; it runs ``warmup + repeats`` times, for real (an optimizer step in it does
    update the model). Units and their timing are as in :func:`profile`; the whole step is
    the call of ``step``, so ``coverage`` shows the share spent outside the layers. This is
    what the ``%%pipeswift_profile`` cell magic runs. Returns the :class:`Profile`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if not callable(step):
        raise TypeError(
            f"step must be a callable with no arguments that runs one training step; got {type(step).__name__}"
        )
    repeats = check_int("repeats", repeats, minimum=1)
    warmup = check_int("warmup", warmup, minimum=0)
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False; got {progress!r}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"model ({type(model).__name__}) has no trainable parameters (none with requires_grad=True); there is no backward to profile"
        )
    units = select_units(model, layers)
    device = model_device(model)
    records = _measure(
        model,
        units,
        device,
        lambda recorder: step(),
        warmup,
        repeats,
        progress,
        f"profiling {type(model).__name__} step",
    )
    meta = {
        "source": "step",
        "device": str(device),
        "timer": make_clock(device).kind,
        "loss": "step",
        "repeats": repeats,
        "warmup": warmup,
    }
    return _build(model, units, records, meta)
