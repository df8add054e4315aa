"""Manifests: the JSON files that say what a saved folder is (its ``format``) and list its files by size and SHA-256.

A checkpoint (:mod:`.checkpoint`) and a saved RunResult (:mod:`.result_files`) each write one; both read it back
with :func:`read_manifest_json` and check their files with :func:`sha256_of`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

__all__ = ["read_manifest_json", "sha256_of"]


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    """The hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_manifest_json(path: Path, fmt: str, error: type[Exception], what: str) -> dict[str, Any]:
    """The JSON object in ``path``, whose ``format`` must be ``fmt``; raises ``error`` naming the file when it cannot
    be read as JSON or is not ``what`` (e.g. ``"a pipeswift_lab checkpoint manifest"``)."""
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise error(f"{str(path)!r} cannot be read as JSON: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt:
        raise error(f"{str(path)!r} is not {what} (no format {fmt!r})")
    return manifest
