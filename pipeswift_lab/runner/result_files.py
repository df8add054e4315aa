"""A :class:`~pipeswift_lab.runner.result.RunResult` kept on disk: :func:`save_result` and :func:`load_result`.

``result.save(DIR)`` writes one directory; ``load_result(DIR)`` reads it back without running any code
(JSON, CSV, and tensors through ``torch.load(..., weights_only=True)``; nothing is unpickled)::

    DIR/result.json       format and version, every scalar field (schedule, P, v, m, steps, status, ...),
                          step_ms and losses, the JCT terms, meta, the timeline's source and meta,
                          each table's columns and dtypes, and every other file's size and SHA-256
    DIR/state.pt          the final parameters and buffers ({name: tensor}, ``torch.save``; a tied weight's
                          names share one tensor)
    DIR/timeline.csv      the measured Timeline's rows (absent for a run with instrument=False)
    DIR/ranks.csv, checkpoints.csv, segments.csv, rebalances.csv   the tables of the same names

Every file is checked against its size and SHA-256 before it is read; a missing, changed or unreadable file raises
:class:`ResultFileError` naming it. What reads back differently: ``meta`` holds JSON values (lists where the run had
tuples, except ``state_keys``, ``bounds``, ``stage_to_rank``, ``step_start_ms`` and ``assembly_phases``, restored as
the run had them; ``meta["job"]``, the job's options, a dict), and a table cell holding an empty string reads back
as missing.

:func:`load_result` also reads the output directory of a ``torchrun ... -m pipeswift_lab.runner SPEC --out DIR`` run
(its ``result.pt`` and the copy of the spec, which is unpickled: load such a directory only when you trust it, and
``save`` the result to keep it in this format).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from ..core.jct import JCT
from .manifests import read_manifest_json, sha256_of
from .result import RunResult
from .run_files import RESULT_FILE

if TYPE_CHECKING:
    from .spec import RunSpec

__all__ = ["FORMAT", "RESULT_JSON", "ResultFileError", "TABLES", "load_result", "save_result", "to_json"]

#: The manifest's ``format`` value.
FORMAT = "pipeswift_lab.run_result"
#: Format versions this module writes and reads.
VERSION = 1
#: The manifest: every scalar, meta, the tables' schemas and the other files' checksums.
RESULT_JSON = "result.json"
#: The final state's file.
STATE_FILE = "state.pt"
#: The tables kept as CSV files (``<name>.csv``), each a RunResult field of that name.
TABLES = ("ranks", "checkpoints", "segments", "rebalances")
#: The RunResult fields kept as they are in ``result.json``.
_SCALARS = (
    "schedule",
    "P",
    "v",
    "m",
    "steps",
    "backend",
    "device_type",
    "instrumented",
    "status",
    "first_step",
    "checkpoint",
    "restarts",
    "steps_redone",
    "recovery_s",
    "restore_s",
    "D",
)
#: meta entries restored as tuples (the rest of meta reads back as JSON values).
_META_TUPLES = ("state_keys", "stage_to_rank", "step_start_ms")


class ResultFileError(ValueError):
    """A saved result that cannot be read: a file missing, changed since it was saved, or not of this format."""


def to_json(value: Any) -> Any:
    """``value`` with only JSON types: dicts with string keys, lists for tuples, Python numbers for numpy ones, a
    dataclass as the dict of its fields, a DataFrame as its records, a path as a string, anything else as its
    ``str``. Returns the converted value."""
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if value is None or type(value) in (bool, int, float, str):
        return value
    for kind in (bool, int, float, str):  # subclasses: numpy's float64, torch's TorchVersion
        if isinstance(value, kind):
            return kind(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, pd.DataFrame):
        return to_json(value.to_dict("records"))
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if hasattr(value, "tolist"):  # numpy scalars and arrays, tensors, Series
        return to_json(value.tolist())
    return str(value)


# --------------------------------------------------------------------------- save


def save_result(result: RunResult, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Write ``result`` into the directory ``path`` (made with its parents) in the layout of this module; return it.

    ``path`` must not exist or be empty; with ``overwrite=True`` an earlier saved result there is replaced (any
    other non-empty directory is refused). The files are written into a hidden sibling directory first and moved
    into place when complete, so a failed save leaves no half-written result.
    """
    if not isinstance(result, RunResult):
        raise TypeError(f"result must be a RunResult; got {type(result).__name__}")
    target = Path(path)
    if target.exists():
        if not target.is_dir():
            raise FileExistsError(f"{str(target)!r} exists and is not a directory; save a result into a directory")
        if any(target.iterdir()):
            if not (target / RESULT_JSON).is_file():
                raise FileExistsError(f"{str(target)!r} is a non-empty directory that holds no saved result")
            if not overwrite:
                raise FileExistsError(
                    f"{str(target)!r} already holds a saved result; give overwrite=True to replace it"
                )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write(result, tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write(result: RunResult, folder: Path) -> None:
    """Every file of ``result`` into ``folder``, ``result.json`` last."""
    torch.save(dict(result._state), folder / STATE_FILE)
    tables = {name: _write_table(getattr(result, name), folder / f"{name}.csv") for name in TABLES}
    timeline = None
    if result.timeline is not None:
        timeline = {
            "source": result.timeline.source,
            "meta": to_json(result.timeline.meta),
            "table": _write_table(result.timeline.df, folder / "timeline.csv"),
        }
    files = sorted(p.name for p in folder.iterdir())
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "torch_version": str(torch.__version__),
        "fields": {name: to_json(getattr(result, name)) for name in _SCALARS},
        "skipped_steps": list(result.skipped_steps),
        "step_ms": list(result.step_ms),
        "losses": list(result.losses),
        "jct": to_json(result.jct),
        "meta": to_json(result.meta),
        "timeline": timeline,
        "tables": tables,
        "files": {
            name: {"bytes": (folder / name).stat().st_size, "sha256": sha256_of(folder / name)} for name in files
        },
    }
    (folder / RESULT_JSON).write_text(json.dumps(manifest, indent=1) + "\n")


def _encoding(column: pd.Series) -> str:
    """How a column is written: ``number`` (int, float, bool), ``str`` (a string dtype: empty is missing),
    ``text`` (an object column of strings only) or ``json`` (any other object column: one JSON value per cell)."""
    if pd.api.types.is_bool_dtype(column.dtype) or pd.api.types.is_numeric_dtype(column.dtype):
        return "number"
    if isinstance(column.dtype, pd.StringDtype):
        return "str"
    if column.dtype == object and all(isinstance(x, str) for x in column):
        return "text"
    return "json"


def _write_table(df: pd.DataFrame, path: Path) -> dict[str, Any]:
    """Write ``df`` as CSV (no index); return its schema: ``file``, ``columns`` with their ``dtype`` and encoding."""
    columns = []
    out = {}
    for name in df.columns:
        col = df[name]
        encoding = _encoding(col)
        tuples = False
        if encoding == "json":
            tuples = any(isinstance(x, tuple) for x in col)
            col = pd.Series([json.dumps(to_json(x)) for x in col], dtype=object)
        out[str(name)] = col.reset_index(drop=True)
        columns.append({"name": str(name), "dtype": str(df[name].dtype), "encoding": encoding, "tuples": tuples})
    if columns:
        pd.DataFrame(out).to_csv(path, index=False)
    else:
        path.write_text("")
    return {"file": path.name, "rows": len(df), "columns": columns}


# --------------------------------------------------------------------------- load


def load_result(path: str | os.PathLike[str], spec: RunSpec | None = None) -> RunResult:
    """The :class:`RunResult` saved in the directory ``path`` (by ``RunResult.save``), or the result of a
    ``torchrun ... -m pipeswift_lab.runner SPEC --out DIR`` run when ``path`` is such a ``DIR``.

    A saved result is read from JSON, CSV and ``torch.load(..., weights_only=True)`` only, each file checked
    against the size and SHA-256 ``result.json`` lists; raises :class:`ResultFileError` naming the file that is
    missing, changed or unreadable. A torchrun directory is read by
    :func:`~pipeswift_lab.runner.assembly.read_run_dir` (``spec`` defaults to the copy of the spec the runner left
    there, which is unpickled).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike; got {type(path).__name__}")
    folder = Path(path)
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is not a directory"
        raise ResultFileError(f"{str(folder)!r} {what}: give the directory result.save(path) wrote")
    if not (folder / RESULT_JSON).exists():
        from .assembly import read_run_dir

        if (folder / RESULT_FILE).is_file():
            return read_run_dir(folder, spec)
        raise ResultFileError(
            f"{str(folder / RESULT_JSON)!r} is missing: {str(folder)!r} holds no saved result (result.save(path) "
            f"writes one) and no {RESULT_FILE} of a torchrun run"
        )
    manifest = _read_manifest(folder / RESULT_JSON)
    _verify(folder, manifest)
    timeline = None
    if manifest["timeline"] is not None:
        from ..simulation.timeline import Timeline

        info = manifest["timeline"]
        timeline = Timeline(_read_table(folder, info["table"]), source=info["source"], meta=info["meta"])
    fields = manifest["fields"]
    return RunResult(
        timeline=timeline,
        step_ms=tuple(float(x) for x in manifest["step_ms"]),
        losses=tuple(float(x) for x in manifest["losses"]),
        jct=JCT(**manifest["jct"]),
        ranks=_read_table(folder, manifest["tables"]["ranks"]),
        meta=_meta(manifest["meta"]),
        _state=_read_state(folder / STATE_FILE),
        checkpoints=_read_table(folder, manifest["tables"]["checkpoints"]),
        segments=_read_table(folder, manifest["tables"]["segments"]),
        rebalances=_read_table(folder, manifest["tables"]["rebalances"]),
        skipped_steps=tuple(int(x) for x in manifest["skipped_steps"]),
        **fields,
    )


def _read_manifest(path: Path) -> dict[str, Any]:
    manifest = read_manifest_json(path, FORMAT, ResultFileError, "a saved pipeswift_lab RunResult")
    if manifest.get("version") != VERSION:
        raise ResultFileError(
            f"{str(path)!r} is of format version {manifest.get('version')}; this pipeswift_lab reads version {VERSION}"
        )
    needed = ("fields", "step_ms", "losses", "skipped_steps", "jct", "meta", "timeline", "tables", "files")
    missing = [k for k in needed if k not in manifest] + [t for t in TABLES if t not in manifest.get("tables", {})]
    if missing:
        raise ResultFileError(f"{str(path)!r} lacks {missing}: it was changed or cut short")
    unknown = set(manifest["fields"]) - set(_SCALARS)
    if unknown:
        raise ResultFileError(f"{str(path)!r} names fields a RunResult does not have: {sorted(unknown)}")
    return manifest


def _verify(folder: Path, manifest: dict[str, Any]) -> None:
    """Every file the manifest lists is there with its size and SHA-256, and every file read is listed."""
    listed = manifest["files"]
    needed = [STATE_FILE] + [manifest["tables"][t]["file"] for t in TABLES]
    if manifest["timeline"] is not None:
        needed.append(manifest["timeline"]["table"]["file"])
    for name in sorted(set(listed) | set(needed)):
        file = folder / name
        if name not in listed:
            raise ResultFileError(f"{str(file)!r} is not listed in {RESULT_JSON}: the saved result was changed")
        if not file.is_file():
            raise ResultFileError(f"{str(file)!r} is missing: the saved result is incomplete")
        if file.stat().st_size != listed[name]["bytes"] or sha256_of(file) != listed[name]["sha256"]:
            raise ResultFileError(
                f"{str(file)!r} does not match its size and SHA-256 in {RESULT_JSON}: it was changed after the save"
            )


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # any unpickling failure names the file
        raise ResultFileError(f"{str(path)!r} cannot be loaded with weights_only=True: {exc}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ResultFileError(f"{str(path)!r} does not hold a {{name: tensor}} state dict")
    return dict(state)


def _read_table(folder: Path, schema: dict[str, Any]) -> pd.DataFrame:
    """The table ``schema`` describes, from its CSV file, with the dtypes and cell types it was saved with."""
    path = folder / schema["file"]
    columns = schema["columns"]
    if not columns:
        return pd.DataFrame()
    parse = {c["name"]: (c["dtype"] if c["encoding"] == "number" else str) for c in columns}
    try:
        raw = pd.read_csv(path, dtype=parse, keep_default_na=False, na_values={c["name"]: [""] for c in columns})
    except (ValueError, TypeError, OSError) as exc:
        raise ResultFileError(f"{str(path)!r} cannot be read as the table {RESULT_JSON} describes: {exc}") from None
    if list(raw.columns) != [c["name"] for c in columns] or len(raw) != schema["rows"]:
        raise ResultFileError(f"{str(path)!r} does not have the columns and rows {RESULT_JSON} lists")
    out = {}
    for c in columns:
        col = raw[c["name"]]
        if c["encoding"] == "json":
            values = [_tuples(json.loads(x)) if c["tuples"] else json.loads(x) for x in col.fillna("null")]
            out[c["name"]] = pd.Series(values, dtype=object)
        elif c["encoding"] == "text":
            out[c["name"]] = pd.Series(col.fillna("").tolist(), dtype=object)
        else:
            out[c["name"]] = col.astype(c["dtype"])
    return pd.DataFrame(out)


def _tuples(value: Any) -> Any:
    """JSON lists back as tuples, nested."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    return value


def _meta(meta: dict[str, Any]) -> dict[str, Any]:
    """``meta`` as read from JSON, with the entries a RunResult's code keys on restored as the run had them."""
    out = dict(meta)
    for key in _META_TUPLES:
        if isinstance(out.get(key), list):
            out[key] = tuple(out[key])
    if isinstance(out.get("bounds"), list):
        out["bounds"] = _tuples(out["bounds"])
    if isinstance(out.get("assembly_phases"), list):
        out["assembly_phases"] = [tuple(x) for x in out["assembly_phases"]]
    return out
