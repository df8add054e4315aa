"""torchtitan 0.2.2 and earlier: a configuration as a TOML ``JobConfig``, and such a file read back.

The same fields as :mod:`.torchtitan`'s, in tables (``torchtitan/config/job_config.py``, 0.2.2): ``[model]`` ``name``
and ``flavor``, ``[training]``, ``[parallelism]`` and ``[activation_checkpoint]`` ``mode`` (``"none"``, ``"full"`` or
``"selective"``, the default). The output layer is named ``output`` there.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


from .target import ExportTarget, ImportedConfig
from .torchtitan import even_stages, imported, nearest, values

__all__ = ["even_stages", "nearest", "read", "write"]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def write(target: ExportTarget) -> str:
    """The TOML ``JobConfig`` of ``target`` for torchtitan 0.2.2 and earlier."""
    v = values(target, head="output")
    model = v["model"]
    sections: dict[str, dict[str, Any]] = {
        "model": {"name": model["name"], "flavor": model["flavor"]},
        "training": v["training"],
        "parallelism": v["parallelism"],
        "activation_checkpoint": v["activation_checkpoint"],
    }
    if v["schedule_csv"]["text"]:
        sections["parallelism"]["pipeline_parallel_schedule_csv"] = "pipeswift_schedule.csv"
    lines = [f"# torchtitan (0.2.2 and earlier) configuration of the plan {target.label}, written by pipeswift_lab"]
    lines.append(f"# torchrun --nproc-per-node {target.world} -m torchtitan.train --job.config_file THIS_FILE")
    if model["note"]:
        lines.append(f"# NOTE: {model['note']}")
    if v["schedule_csv"]["text"]:
        lines.append("# pipeswift_schedule.csv (beside the run's working folder) holds the order:")
        lines += [f"#   {row}" for row in v["schedule_csv"]["text"].splitlines()]
    for name, table in sections.items():
        lines += ["", f"[{name}]", *(f"{k} = {_toml_value(val)}" for k, val in table.items())]
    return "\n".join(lines) + "\n"


def read(source: str | Path, world: int | None = None) -> ImportedConfig:
    """A torchtitan TOML ``JobConfig`` (a path or its text) as an :class:`ImportedConfig`; ``world`` as in
    :func:`.torchtitan.read`. A schedule CSV it names is read relative to the file's folder."""
    text, folder = str(source), None
    if isinstance(source, Path) or ("\n" not in text and Path(text).exists()):
        folder = Path(text).parent
        text = Path(text).read_text(encoding="utf-8")
    try:
        tables = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"the torchtitan TOML does not parse: {error}") from None
    found: dict[str, Any] = {**tables.get("training", {}), **tables.get("parallelism", {})}
    found.update({f"compile.{k}": v for k, v in tables.get("compile", {}).items()})
    found["activation_checkpoint"] = tables.get("activation_checkpoint", {}).get("mode", "selective")
    found["flavor"] = tables.get("model", {}).get("flavor")
    csv = found.get("pipeline_parallel_schedule_csv")
    if csv and folder is not None and (folder / csv).is_file():
        found["schedule_csv_text"] = (folder / csv).read_text(encoding="utf-8")
    return imported(found, "torchtitan-toml", world)
