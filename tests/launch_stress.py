"""Cold launches under load, for the stress test (tests/runner/test_launch_stress.py) and benchmarks/bench_launch.py.

A cold launch starts fresh interpreters that import torch, as ``torchrun`` does on a cluster:
``run(..., launch=Launch(start_method="subprocess"))``, or two ``torchrun`` agents as two nodes of one replica
each. :func:`busy_core` keeps one core busy meanwhile, which is how the exit abort showed (see
[Note: the process group outlives its destroy] in ``pipeswift_lab/runner/rank/worker.py``).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from pipeswift_lab import Launch
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.runner import RunError, run

ROOT = Path(__file__).resolve().parents[1]
#: What a worker prints when it aborts at exit.
ABORT_MARKERS = ("terminate called", "Fatal Python error: Aborted", "SIGABRT", "Signal 6")


class Affine(nn.Module):
    """A small layer defined here, so a saved spec carries it by value."""

    def __init__(self, n: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(n, n, generator=g) / n**0.5)

    def forward(self, x):
        return torch.sin(x @ self.weight)


def _spin() -> None:
    while True:
        pass


@contextmanager
def busy_core():
    """Keep one core busy (a spinning process) for the duration of the block."""
    spinner = multiprocessing.get_context("spawn").Process(target=_spin, daemon=True)
    spinner.start()
    try:
        yield spinner.pid
    finally:
        spinner.kill()
        spinner.join()


def job(D: int = 1):
    """``(model, batch, partition, m)`` of the small two-stage job every launch runs."""
    model = nn.Sequential(*[Affine(6, s) for s in range(4)])
    g = torch.Generator().manual_seed(5)
    batch = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    part = Partition.from_bounds(
        Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[1.0] * 4), [(0, 2), (2, 4)], schedule="1F1B"
    )
    return model, batch, part, 2


def cold_run() -> dict:
    """One ``run(..., launch=Launch(start_method="subprocess"))``; returns ``{"ok", "abort", "error"}``."""
    model, batch, part, m = job()
    try:
        run(
            model,
            batch,
            nn.functional.mse_loss,
            part,
            m,
            steps=2,
            progress=False,
            launch=Launch(timeout_s=180, start_method="subprocess"),
        )
        return {"ok": True, "abort": False, "error": ""}
    except RunError as exc:
        text = f"{exc}\n{exc.traceback}"
        return {"ok": False, "abort": any(marker in text for marker in ABORT_MARKERS), "error": str(exc)[:300]}


def save_spec(path: Path, D: int) -> Path:
    """Save the job's spec for ``torchrun`` (through a local run, which also gives the reference result)."""
    model, batch, part, m = job(D)
    run(
        model,
        batch,
        nn.functional.mse_loss,
        part,
        m,
        steps=2,
        progress=False,
        launch=Launch(timeout_s=180, save_spec=path),
        D=D,
    )
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_node_launch(spec_path: Path, nproc: int = 2) -> dict:
    """Two ``torchrun`` agents (static rendezvous on loopback), ``nproc`` ranks each; returns ``{"ok", "abort",
    "error"}``."""
    launcher = (
        [shutil.which("torchrun")] if shutil.which("torchrun") else [sys.executable, "-m", "torch.distributed.run"]
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    port = _free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [
            subprocess.Popen(
                launcher
                + [
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    str(nproc),
                    "--node-rank",
                    str(node),
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    str(port),
                    "-m",
                    "pipeswift_lab.runner",
                    str(spec_path),
                    "--out",
                    out,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for node in (0, 1)
        ]
        outputs = []
        try:
            for proc in procs:
                outputs.append(proc.communicate(timeout=240))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    text = "\n".join(out + err for out, err in outputs)
    ok = all(proc.returncode == 0 for proc in procs)
    return {"ok": ok, "abort": any(marker in text for marker in ABORT_MARKERS), "error": "" if ok else text[-1500:]}
