"""Checkpoints of a pipeline run: one file per rank, written in the background, committed atomically.

Layout under a checkpoint root (``run(..., checkpoint=ROOT)``)::

    ROOT/step-00000012/          one directory per checkpoint, named by the steps done
        rank-00000.bin, ...          each rank's parameters, optimizer state and RNG states, packed
                                     (:mod:`~pipeswift_lab.runner.checkpoint_files`)
        .metadata                    DCP's index of every tensor: name, shape, dtype, file, offset
        manifest.json                written last: the run's shape (P, v, m, schedule, stage bounds,
                                     layer names, ...), where each rank's keys lie, a SHA-256 per file

State is keyed by the *full model's* names (DCP's flattened state dicts, as torchtitan does for
pipeline stages), so a checkpoint written by P ranks loads into any other partition: on another
partition each rank asks DCP for the keys of its own layers (through a ``StorageReader`` over the
rank files); on the same one it reads its own file directly
(:mod:`~pipeswift_lab.runner.rank.state_files`). A tied weight is stored once, under its first
name; the manifest's ``aliases`` give its other names back.

Every save goes into a hidden sibling ``ROOT/.tmp-step-...``; each rank fsyncs its file, and only
when every rank has, rank 0 writes ``.metadata`` and the manifest with every file's checksum,
fsyncs them, renames the directory to ``step-...`` and fsyncs the root. A save killed part-way
leaves a ``.tmp-`` directory that is never loaded and is removed by the next commit. On load, a
checkpoint whose files do not match their checksums is skipped with a warning naming the file,
and the previous complete one is used. Checkpoints of format version 1 (DCP's own files) still load.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
import uuid
import warnings
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    import torch

from ..core.checks import state_mismatch
from ..core.display import html_card, text_card
from .checkpoint_files import MODEL, dcp_metadata, flat_file_reader
from .manifests import read_manifest_json, sha256_of

MANIFEST = "manifest.json"
FORMAT = "pipeswift_lab.checkpoint"
VERSION = 2
#: Format versions this module reads: 1 (DCP's ``FileSystemWriter`` files), 2 (one packed file per rank).
READABLE_VERSIONS = (1, 2)
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_TMP_PREFIX = ".tmp-step-"
_TMP_STEP = re.compile(r"^\.tmp-step-(\d{8})-(.+)$")


def step_dir_name(step: int) -> str:
    """``step-00000012``: the directory name of the checkpoint taken after ``step`` steps."""
    return f"step-{int(step):08d}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, unreadable, incomplete, corrupt or of another model."""


@dataclass(frozen=True, repr=False)
class Checkpoint:
    """One complete checkpoint directory: its manifest, its files and the state they hold.

    * ``path`` — the ``step-*`` directory; ``step`` — the training steps done when it was taken;
    * ``manifest`` — the parsed ``manifest.json`` (run shape, optimizer class, files and checksums);
    * :meth:`state_dict` — the full model's parameters and buffers (keys and order of
      ``model.state_dict()``), read without any process group;
    * :meth:`load_into` — copy that state into a model (strict);
    * ``df`` — one row per file: ``name``, ``bytes``, ``sha_ok``.
    """

    path: Path
    manifest: dict[str, Any] = field(compare=False)

    @property
    def step(self) -> int:
        """Training steps done when the checkpoint was taken."""
        return int(self.manifest["step"])

    @property
    def df(self) -> pd.DataFrame:
        """One row per file the manifest lists: ``name``, ``bytes``, ``sha_ok`` (the SHA-256 recomputed now)."""
        rows = []
        for name, info in sorted(self.manifest["files"].items()):
            path = self.path / name
            ok = path.is_file() and path.stat().st_size == info["bytes"] and sha256_of(path) == info["sha256"]
            rows.append({"name": name, "bytes": int(info["bytes"]), "sha_ok": bool(ok)})
        return pd.DataFrame(rows, columns=["name", "bytes", "sha_ok"])

    @property
    def bytes(self) -> int:
        """Total bytes of the checkpoint's files."""
        return int(sum(info["bytes"] for info in self.manifest["files"].values()))

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """``{model key: shape}`` of every model tensor in the checkpoint, from DCP's metadata."""
        from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

        metadata = FileSystemReader(str(self.path)).read_metadata()
        prefix = MODEL + "."
        return {
            k[len(prefix) :]: tuple(m.size)
            for k, m in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)
        }

    def state_dict(self) -> OrderedDict[str, torch.Tensor]:
        """The full model's state (CPU tensors), keyed and ordered like the saved model's ``state_dict()``."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

        metadata = FileSystemReader(str(self.path)).read_metadata()
        prefix = MODEL + "."
        model = {}
        for key, meta in metadata.state_dict_metadata.items():
            if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata):
                model[key[len(prefix) :]] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        with warnings.catch_warnings():  # DCP notes that it loads in one process: that is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({MODEL: model}, storage_reader=storage_reader(self), no_dist=True)
        order = self.manifest.get("state_keys") or list(model)
        aliases = self.manifest.get("aliases") or {}
        return OrderedDict((k, model[aliases.get(k, k)]) for k in order if aliases.get(k, k) in model)

    @property
    def ranks(self) -> list[dict[str, Any]]:
        """Per rank that wrote it (format 2): ``rank``, ``pp_rank``, ``replica``, ``file`` and where its keys lie."""
        return list(self.manifest.get("ranks") or [])

    def load_into(self, model: torch.nn.Module) -> torch.nn.Module:
        """Copy the checkpoint's model state into ``model`` (strict) and return it.

        Raises :class:`CheckpointError` listing the names and shapes that differ when ``model``
        is not the model the checkpoint was taken of.
        """
        check_same_model(self, model)
        model.load_state_dict(self.state_dict())
        return model

    def _summary(self) -> dict[str, Any]:
        m = self.manifest
        return {
            "step": self.step,
            "of_steps": m.get("steps"),
            "P": m.get("P"),
            "v": m.get("v"),
            "m": m.get("m"),
            "schedule": m.get("schedule"),
            "optimizer": m.get("optimizer"),
            "files": len(m["files"]),
            "bytes": self.bytes,
            "kind": m.get("kind"),
            "path": str(self.path),
        }

    def _repr_html_(self) -> str:
        return html_card(f"Checkpoint at step {self.step}", self._summary(), self.df)

    def __str__(self) -> str:
        return text_card(f"Checkpoint step {self.step}", self._summary())

    __repr__ = __str__


def storage_reader(checkpoint: Checkpoint) -> Any:
    """The DCP ``StorageReader`` for ``checkpoint``'s files: rank files (format 2) or DCP's own (format 1)."""
    if int(checkpoint.manifest["version"]) == 1:
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(str(checkpoint.path))
    return flat_file_reader(checkpoint.path)


def read_manifest(path: Path) -> dict[str, Any]:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{str(path)!r} has no {MANIFEST}: it is not a complete pipeswift_lab checkpoint")
    manifest = read_manifest_json(manifest_path, FORMAT, CheckpointError, "a pipeswift_lab checkpoint manifest")
    if manifest.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{str(manifest_path)!r} is a checkpoint of format version {manifest.get('version')}; "
            f"this pipeswift_lab reads versions {list(READABLE_VERSIONS)}"
        )
    for key in ("step", "files"):
        if key not in manifest:
            raise CheckpointError(f"the manifest {str(manifest_path)!r} lacks {key!r}")
    return manifest


def verify(path: str | os.PathLike[str]) -> Checkpoint:
    """Read ``path``'s manifest and check every file against its size and SHA-256.

    Returns the :class:`Checkpoint`; raises :class:`CheckpointError` naming the first file
    that is missing or does not match.
    """
    path = Path(path)
    manifest = read_manifest(path)
    names = sorted(manifest["files"])
    for name in names:
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {str(path)!r}: file {name} listed in the manifest is missing")
    with ThreadPoolExecutor(max_workers=min(8, len(names) or 1)) as pool:  # hashlib releases the GIL: one core each
        digests = list(pool.map(lambda name: sha256_of(path / name), names))
    for name, digest in zip(names, digests):
        info = manifest["files"][name]
        if (path / name).stat().st_size != info["bytes"] or digest != info["sha256"]:
            raise CheckpointError(
                f"checkpoint {str(path)!r}: file {name} does not match its SHA-256 in the manifest (corrupt or changed)"
            )
    return Checkpoint(path, manifest)


def _step_dirs(root: Path) -> list[Path]:
    """``step-*`` directories under ``root``, newest (most steps) first."""
    if not root.is_dir():
        return []
    found = [(int(mt.group(1)), p) for p in root.iterdir() if p.is_dir() and (mt := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def _run_id_of(path: Path) -> str | None:
    try:
        return json.loads((path / MANIFEST).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def latest_checkpoint(root: str | os.PathLike[str], *, run_id: str | None = None) -> Checkpoint | None:
    """The newest complete, intact checkpoint under ``root`` (a checkpoint root), or ``None``.

    Directories without a manifest (never committed) are passed over; one whose files do not
    match their checksums is skipped with a ``UserWarning`` naming the file, and the previous
    complete one is returned. ``run_id`` keeps only the checkpoints one ``run()`` call wrote
    (its manifest's ``run_id``), so a restart never picks up another job's checkpoint.
    """
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"checkpoint root {str(root)!r} is not a directory")
    for path in _step_dirs(root):
        if not (path / MANIFEST).is_file() or (run_id is not None and _run_id_of(path) != run_id):
            continue
        try:
            return verify(path)
        except CheckpointError as exc:
            warnings.warn(f"skipping {exc}; using the previous complete checkpoint", UserWarning, stacklevel=2)
    return None


def complete_checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """The ``step-*`` directories under ``root`` that hold a manifest, newest first (not verified)."""
    return [p for p in _step_dirs(Path(root)) if (p / MANIFEST).is_file()]


def load_checkpoint(path: str | os.PathLike[str] | Checkpoint) -> Checkpoint:
    """The checkpoint at ``path``: a ``step-*`` directory, a checkpoint root (its newest complete checkpoint), or a
    :class:`Checkpoint` (``latest_checkpoint(root)``'s answer), whose directory is read and checked again.

    Returns the :class:`Checkpoint`. Raises :class:`CheckpointError` (a ``ValueError``) when ``path`` is ``None``
    (what ``latest_checkpoint`` returns when a root holds no complete checkpoint), does not exist, holds no
    complete checkpoint, or its manifest is missing, unreadable or does not match the files.
    """
    if path is None:
        raise CheckpointError(
            "load_checkpoint(None): there is no checkpoint to load (latest_checkpoint(root) returns None when root "
            "holds no complete checkpoint); give a step-* directory, a checkpoint root or a Checkpoint"
        )
    if isinstance(path, Checkpoint):
        path = path.path
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str, an os.PathLike or a Checkpoint; got {type(path).__name__}")
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {str(path)!r} is not a directory")
    if _STEP_DIR.match(path.name) or (path / MANIFEST).exists():
        return verify(path)
    found = latest_checkpoint(path)
    if found is None:
        names = sorted(p.name for p in path.iterdir())[:5]
        raise CheckpointError(
            f"{str(path)!r} holds no complete checkpoint (no step-*/{MANIFEST}); it contains {names or 'nothing'}"
        )
    return found


def check_same_model(checkpoint: Checkpoint, model: torch.nn.Module) -> None:
    """Raise :class:`CheckpointError` listing the state names and shapes in which ``model`` and ``checkpoint``
    differ (the model's non-persistent buffers, such as a rotary table, may be in the checkpoint or not)."""
    saved = checkpoint.tensor_shapes()
    for alias, canonical in (checkpoint.manifest.get("aliases") or {}).items():
        if canonical in saved:
            saved[alias] = saved[canonical]
    own = {k: tuple(t.shape) for k, t in model.state_dict().items() if hasattr(t, "shape")}
    loose = {n for n, _ in model.named_buffers()} - set(own)  # a traced stage saves a non-persistent buffer too
    missing = sorted(set(own) - set(saved))
    extra = sorted(set(saved) - set(own) - loose)
    shapes = {k: (own[k], saved[k]) for k in sorted(set(own) & set(saved)) if own[k] != saved[k]}
    parts = state_mismatch(missing, extra, shapes, "the checkpoint")
    if parts:
        raise CheckpointError(f"checkpoint {str(checkpoint.path)!r} is of another model; " + "; ".join(parts))


def new_tmp_dir(root: Path, step: int, tag: str | None = None) -> Path:
    """A hidden sibling ``ROOT/.tmp-step-00000012-<tag>`` to save into (not created); ``tag`` defaults to a fresh
    random id. Every rank of a run derives the same name from the run's id and attempt, with no message."""
    return Path(root) / f"{_TMP_PREFIX}{int(step):08d}-{tag or uuid.uuid4().hex[:8]}"


def commit(
    tmp_dir: Path, manifest: dict[str, Any], records: list[dict[str, Any]], keep: int, live: str | None = None
) -> Path:
    """Make the save in ``tmp_dir`` a checkpoint: ``.metadata``, manifest last, fsync, rename, retention.

    ``records`` are every rank's :func:`~pipeswift_lab.runner.checkpoint_files.write_rank_file` results with
    ``rank``, ``pp_rank``, ``replica`` and ``file``. Writes DCP's ``.metadata`` and ``manifest.json`` (each file's
    size and SHA-256, where each rank's keys lie), fsyncs them and the directory, renames ``tmp_dir`` to
    ``step-NNNNNNNN`` (replacing an older save of the same step), fsyncs the root, then removes all but the ``keep``
    newest checkpoints of the run and any ``.tmp-`` directory a killed save left behind (but not a later save of
    the writer tagged ``live``, which other ranks may be writing already). Returns the checkpoint's path.
    """
    import pickle

    tmp_dir, root = Path(tmp_dir), Path(tmp_dir).parent
    files = {r["file"]: {"bytes": int(r["bytes"]), "sha256": r["sha256"]} for r in records}
    meta = tmp_dir / ".metadata"
    encoded = pickle.dumps(dcp_metadata(records))
    _write_synced(meta, encoded)
    files[meta.name] = {"bytes": len(encoded), "sha256": hashlib.sha256(encoded).hexdigest()}
    on_disk = {p.name for p in tmp_dir.iterdir() if p.is_file()}
    unlisted = sorted(on_disk - set(files))
    if unlisted:
        raise RuntimeError(f"checkpoint save left files no rank reported: {unlisted}")
    ranks = [
        {k: r[k] for k in ("rank", "pp_rank", "replica", "file", "tensors", "objects")}
        for r in sorted(records, key=lambda r: r["rank"])
    ]
    manifest = {
        **manifest,
        "format": FORMAT,
        "version": VERSION,
        "files": files,
        "ranks": ranks,
        "created_unix": time.time(),
    }
    _write_synced(tmp_dir / (MANIFEST + ".tmp"), json.dumps(manifest, indent=1, sort_keys=True).encode())
    os.replace(tmp_dir / (MANIFEST + ".tmp"), tmp_dir / MANIFEST)
    _fsync_dir(tmp_dir)
    final = root / step_dir_name(manifest["step"])
    if final.exists():  # a branch re-saving a step another run of this root saved: the new one replaces it
        _discard(final)
    os.replace(tmp_dir, final)
    _fsync_dir(root)
    _retain(root, keep, manifest.get("run_id"), int(manifest["step"]), live)
    return final


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _discard(path: Path) -> None:
    """Remove a checkpoint directory so that no kill part-way leaves a half-deleted ``step-*``: rename, then delete."""
    trash = path.parent / f"{_TMP_PREFIX}trash-{path.name}-{uuid.uuid4().hex[:8]}"
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _retain(root: Path, keep: int, run_id: str | None, step: int = 0, live: str | None = None) -> None:
    """Keep the ``keep`` newest checkpoints of this run (``run_id``); remove its older ones and stale ``.tmp-``
    directories: all but those of a save later than ``step`` tagged ``live``."""
    own = [p for p in complete_checkpoints(root) if _run_id_of(p) == run_id]
    for old in own[keep:]:
        _discard(old)
    for stale in root.glob(_TMP_PREFIX + "*"):
        if live is not None and (found := _TMP_STEP.match(stale.name)):
            if found.group(2) == live and int(found.group(1)) > step:
                continue
        shutil.rmtree(stale, ignore_errors=True)


__all__ = [
    "check_same_model",
    "Checkpoint",
    "CheckpointError",
    "commit",
    "complete_checkpoints",
    "FORMAT",
    "latest_checkpoint",
    "load_checkpoint",
    "MANIFEST",
    "new_tmp_dir",
    "read_manifest",
    "READABLE_VERSIONS",
    "sha256_of",
    "step_dir_name",
    "storage_reader",
    "verify",
    "VERSION",
]
