"""A plan handed to the framework users train with, and their own configuration priced beside it: what
:meth:`Plan.export <pipeswift_lab.planning.result.Plan.export>`, :meth:`Plan.price
<pipeswift_lab.planning.result.Plan.price>` and :meth:`Plan.compare <pipeswift_lab.planning.result.Plan.compare>` do.

The frameworks' own terms live in :mod:`pipeswift_lab.frameworks`; here a planned configuration becomes an
:class:`~pipeswift_lab.frameworks.target.ExportTarget` (its split as the profile's layer names, the model's shape),
the nearest configuration a framework can express is priced with the plan's own inputs (:mod:`.pricing`), and an
:class:`~pipeswift_lab.frameworks.target.ImportedConfig` is priced as written.
"""

from __future__ import annotations

import json
import shlex
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Protocol

import pandas as pd

from ..core.display import hours
from ..core.jct import TERMS
from ..core.schedule import Schedule
from ..core.transformer_spec import TransformerSpec
from ..frameworks import ExportTarget, ExportWarning, ImportedConfig, check_framework, even_stage_modules
from ..frameworks import exporter as framework_module
from ..frameworks.names import bounds_of_stages
from .planned_config import PlannedConfig
from .pricing import Row, as_series, bounds_of, price_row
from .search import Evaluator
from .strategies import HOLDING

if TYPE_CHECKING:
    from .inputs import PlanInputs


class Plan(Protocol):
    """What the hand-off reads of a :class:`~pipeswift_lab.planning.result.Plan`."""

    @property
    def checked(self) -> PlanInputs | None: ...
    @property
    def best(self) -> PlannedConfig: ...
    @property
    def inputs(self) -> dict[str, Any]: ...


__all__ = ["compare", "export", "price", "priced_row"]

#: The columns of :meth:`Plan.compare`, after ``label``.
COMPARE_COLUMNS = (
    *("gpus", "P", "D", "fsdp", "tp", "v", "m", "microbatch_size", "global_batch", "steps"),
    *(*TERMS, "total_s", "step_ms", "bubble_ratio", "peak_mem_bytes", "fits"),
)


@dataclass(frozen=True)
class _Written:
    """A configuration as a framework writes it, in the fields :func:`~.pricing.price_row` reads."""

    P: int
    D: int
    fsdp: int
    tp: int
    m: int
    microbatch_size: int
    v: int
    schedule: Any
    recompute: str
    stage_bounds: str
    precision: str | None = None


def _inputs(plan: Plan) -> PlanInputs:
    if plan.checked is None:
        raise ValueError(
            "this Plan holds no checked inputs (Plan.checked is None: loaded or built by hand); plan again"
        )
    return plan.checked


def _layers(plan: Plan) -> pd.DataFrame:
    """The profile's layers (its smallest micro-batch size's table)."""
    inputs = _inputs(plan)
    return inputs.costs.table(inputs.costs.sizes[0])


def layer_names(plan: Plan) -> list[str]:
    """The profile's layer names, in order."""
    return [str(n) for n in _layers(plan)["name"]]


def _written(plan: Plan, config: PlannedConfig | ImportedConfig) -> _Written:
    """``config``'s fields, an imported one's split mapped onto the profile's layers."""
    if isinstance(config, ImportedConfig):
        table = _layers(plan)
        names = [str(n) for n in table["name"]]
        params = [float(x) for x in table["param_bytes"]] if "param_bytes" in table else []
        types = [str(t) for t in table["type"]] if "type" in table else []
        stages = config.stage_modules or even_stage_modules(config, names, params, types)
        bounds = bounds_of_stages(config.framework, names, stages) if stages else ""
        _check_seq_len(plan, config)
        return _Written(
            config.P, config.D, config.fsdp, config.tp, config.m, config.microbatch_size, config.v,
            config.schedule, config.recompute, bounds, config.precision,
        )  # fmt: skip
    return _Written(
        config.P, config.D, config.fsdp, config.tp, config.m, config.microbatch_size, config.v,
        config.schedule, config.recompute, config.stage_bounds,
    )  # fmt: skip


def _check_seq_len(plan: Plan, config: ImportedConfig) -> None:
    """Warn where an imported configuration trains at another sequence length than the profile was taken at: it is
    priced at the profile's."""
    profiled = _profiled_seq_len(plan)
    if config.seq_len is not None and profiled is not None and config.seq_len != profiled:
        warnings.warn(
            f"the {config.framework} configuration trains at seq_len={config.seq_len}; it is priced at the "
            f"profile's {profiled} tokens a sequence (profile at {config.seq_len} to price it there)",
            UserWarning,
            stacklevel=4,
        )


def priced_row(plan: Plan, config: PlannedConfig | ImportedConfig | _Written) -> Row:
    """The plan's row for ``config`` priced as written (:func:`~.pricing.price_row`), in its own precision where it
    names one."""
    inputs = _inputs(plan)
    written = config if isinstance(config, _Written) else _written(plan, config)
    return price_row(inputs, Evaluator(inputs), written, precision=written.precision)


def price(plan: Plan, config: PlannedConfig | ImportedConfig) -> PlannedConfig:
    """``config`` priced by ``plan``: a :class:`PlannedConfig` with its JCT terms, step and peak, its split in
    ``stage_bounds``."""
    return PlannedConfig.from_row(as_series(priced_row(plan, config)))


def compare(plan: Plan, imported: ImportedConfig | PlannedConfig) -> pd.DataFrame:
    """``imported`` beside the plan's best: one row each (``"plan's best"``, ``"yours"``) and their difference
    (``"yours - best"``), with the JCT terms, the step, the peak memory per GPU and whether it fits the plan's cap."""
    best = plan.best
    planned = priced_row(plan, best)  # its fits, steps and batch; its terms as the plan predicted them (a move's too)
    planned.update({t: getattr(best, t) for t in (*TERMS, "step_ms", "bubble_ratio", "peak_mem_bytes")})
    planned["total_s"] = best.total_s
    rows = {"plan's best": planned, "yours": priced_row(plan, imported)}
    labels = {"plan's best": plan.best.label, "yours": getattr(imported, "label", "")}
    table = pd.DataFrame(
        [{"label": labels[k], **{c: row.get(c) for c in COMPARE_COLUMNS}} for k, row in rows.items()],
        index=list(rows),
    )
    numeric = [c for c in COMPARE_COLUMNS if c != "fits"]
    diff = table.loc["yours", numeric].astype(float) - table.loc["plan's best", numeric].astype(float)
    table.loc["yours - best"] = {"label": "", **diff.to_dict(), "fits": None}
    return table


def _spec(plan: Plan, model_config: Any, seq_len: int | None) -> tuple[TransformerSpec | None, str]:
    """The model's shape and type: ``model_config`` (a TransformerSpec or a Hugging Face config) or what the
    profile recorded (an analytic profile's spec, a Hugging Face model's config)."""
    if isinstance(model_config, TransformerSpec):
        spec = model_config
        return (spec if seq_len is None else _with_seq(spec, seq_len)), spec.name
    if model_config is not None:
        if isinstance(model_config, dict):
            model_config = SimpleNamespace(**model_config)
        kind = str(getattr(model_config, "model_type", "") or "")
        return TransformerSpec.from_config(model_config, seq_len=seq_len or _profiled_seq_len(plan)), kind
    meta = _inputs(plan).costs.metas[_inputs(plan).costs.sizes[0]]
    if isinstance(meta.get("spec"), dict):
        spec = TransformerSpec(**meta["spec"])
        return (spec if seq_len is None else _with_seq(spec, seq_len)), spec.name
    if isinstance(meta.get("model_config"), dict):
        return _spec(plan, meta["model_config"], seq_len)
    return None, ""


def _with_seq(spec: TransformerSpec, seq_len: int) -> TransformerSpec:
    from dataclasses import replace

    return replace(spec, seq_len=int(seq_len))


def _profiled_seq_len(plan: Plan) -> int | None:
    shape = _inputs(plan).costs.metas[_inputs(plan).costs.sizes[0]].get("batch_shape") or []
    return int(shape[1]) if len(shape) > 1 else None


def target_of(plan: Plan, config: PlannedConfig, model_config: Any = None, seq_len: int | None = None) -> ExportTarget:
    """``config`` in framework-neutral terms: its split (as priced) on the profile's layer names, the model's shape."""
    stage_bounds = config.stage_bounds or priced_row(plan, config)["stage_bounds"]
    spec, kind = _spec(plan, model_config, seq_len)
    return ExportTarget(
        P=config.P,
        v=config.v,
        D=config.D,
        fsdp=config.fsdp,
        tp=config.tp,
        m=config.m,
        microbatch_size=config.microbatch_size,
        schedule=config.schedule,
        bounds=bounds_of(stage_bounds),
        layer_names=tuple(layer_names(plan)),
        recompute=config.recompute_by_stage(),
        precision=plan.inputs.get("precision"),
        sequence_parallel=bool(plan.inputs.get("sequence_parallel")),
        spec=spec,
        model_type=kind,
        seq_len=seq_len or (spec.seq_len if spec is not None else _profiled_seq_len(plan)),
        steps=int(plan.inputs["steps"]),
        label=config.label,
        layer_params=tuple(float(x) for x in _layers(plan).get("param_bytes", [])),
        layer_types=tuple(str(t) for t in _layers(plan).get("type", [])),
    )


def export(
    plan: Plan,
    framework: str,
    config: PlannedConfig | None,
    model_config: Any = None,
    seq_len: int | None = None,
    path: str | Path | None = None,
    strict: bool = False,
) -> Any:
    """What :meth:`Plan.export <pipeswift_lab.planning.result.Plan.export>` returns (see there)."""
    name = check_framework(framework)
    config = plan.best if config is None else config
    target = target_of(plan, config, model_config, seq_len)
    module = framework_module(name)
    nearest, changes = module.nearest(target)
    if config.strategy not in HOLDING:  # a move: a framework's configuration holds one layout from start to end
        changes.insert(0, f"{config.strategy} {config.change} -> held from the start (a configuration is one layout)")
    if changes:
        written = _Written(
            nearest.P, nearest.D, nearest.fsdp, nearest.tp, nearest.m, nearest.microbatch_size, nearest.v,
            nearest.schedule, " ".join(f"{s}:{m}" for s, m in sorted(nearest.recompute.items())),
            " ".join(f"{a}-{e}" for a, e in nearest.bounds), nearest.precision,
        )  # fmt: skip
        row = priced_row(plan, written)
        fits = "" if row["fits"] else ", over the memory cap"
        message = (
            f"{name} cannot run {config.label} as planned: {'; '.join(changes)}. The nearest it can run is predicted "
            f"to take {hours(row['total_s'])} (step {row['step_ms']:.4g} ms, {row['peak_mem_bytes'] / 2**30:.3g} "
            f"GiB per GPU{fits}) against the plan's {hours(config.total_s)}"
        )
        if strict:
            raise ValueError(message + "; strict=False exports it")
        priced = PlannedConfig.from_row(as_series(row))
        warnings.warn(ExportWarning(message + "; that is what was exported", priced), stacklevel=3)
    out = module.write(nearest)
    if path is not None:
        Path(path).write_text(_as_text(out), encoding="utf-8")
        if name == "torchtitan-toml" and isinstance(nearest.schedule, Schedule):  # the order the TOML names, beside it
            Path(path).with_name("pipeswift_schedule.csv").write_text(nearest.schedule.to_csv(), encoding="utf-8")
    return out


def _as_text(out: Any) -> str:
    """What :func:`export` writes to a file: a torchtitan module or TOML as is, Megatron's arguments as one shell
    line, DeepSpeed's configuration as JSON."""
    if isinstance(out, str):
        return out
    if isinstance(out, list):
        return shlex.join(out) + "\n"
    return json.dumps(out, indent=2) + "\n"
