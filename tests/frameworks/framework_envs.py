"""Where the frameworks' own environments are: the folders ``.ci/run`` builds them in, once they are ready."""

import os
import time
from pathlib import Path

import pytest


def framework_env(variable: str, what: str, wait_s: float = 1500.0, unset: str = ".ci/run builds one") -> Path:
    """The folder ``.ci/run`` builds a framework's environment in (named by the environment variable ``variable``),
    once it is ready; skips, saying why, where there is none (``unset``: where one comes from) or its build failed."""
    folder = os.environ.get(variable)
    if not folder:
        pytest.skip(f"{what}: no environment (${variable} unset; {unset})")
    path = Path(folder)
    deadline = time.monotonic() + wait_s
    while not (path / "ready").exists() and not (path / "failed").exists() and time.monotonic() < deadline:
        time.sleep(2)
    if not (path / "ready").exists():
        log = (path / "build.log").read_text(errors="replace")[-600:] if (path / "build.log").exists() else ""
        pytest.skip(f"{what}: its environment did not build in {path}: {log.strip() or 'timed out'}")
    return path
