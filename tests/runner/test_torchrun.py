"""The same run from a spec file: ``torchrun ... -m pipeswift_lab.runner SPEC`` and cold ``subprocess`` workers.

Both start fresh interpreters (torch imported on every rank), so this module takes longer than
the others: one torchrun job and one ``Launch(start_method="subprocess")`` run.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pandas.testing import assert_frame_equal
from torch import nn

from pipeswift_lab import Launch
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.runner import load_result, load_spec, run

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it

ROOT = Path(__file__).resolve().parents[2]


class Affine(nn.Module):
    """Defined in this test module, so the saved spec carries it by value."""

    def __init__(self, n, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(n, n, generator=g) / n**0.5)

    def forward(self, x):
        return torch.sin(x @ self.weight)


def setup():
    model = nn.Sequential(*[Affine(6, s) for s in range(4)])
    g = torch.Generator().manual_seed(5)
    batch = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
    part = Partition.from_bounds(
        Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[1.0] * 4), [(0, 2), (2, 4)], schedule="1F1B"
    )
    return model, batch, part


def assert_close_states(a, b):
    assert list(a) == list(b)
    for key in a:
        assert ((a[key] - b[key]).norm() / b[key].norm()).item() <= 1e-6, key


@pytest.fixture(scope="module")
def notebook_run(tmp_path_factory):
    model, batch, part = setup()
    spec_path = tmp_path_factory.mktemp("spec") / "job.pkl"
    result = run(
        model,
        batch,
        nn.functional.mse_loss,
        part,
        4,
        steps=2,
        progress=False,
        launch=Launch(timeout_s=120, save_spec=spec_path),
    )
    return result, spec_path


def test_torchrun_runs_the_saved_spec_like_the_notebook(notebook_run, tmp_path):
    result, spec_path = notebook_run
    assert load_spec(spec_path).plan.schedule == "1F1B"
    out = tmp_path / "out"
    launcher = (
        [shutil.which("torchrun")] if shutil.which("torchrun") else [sys.executable, "-m", "torch.distributed.run"]
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        launcher
        + ["--standalone", "--nproc-per-node", "2", "-m", "pipeswift_lab.runner", str(spec_path), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RunResult 1F1B P=2 m=4" in proc.stdout and "load_result" in proc.stdout
    again = load_result(out)
    assert again.meta["launched_by"] == "torchrun"
    assert_close_states(again.state_dict(), result.state_dict())
    assert again.losses == pytest.approx(result.losses, rel=1e-6)
    assert again.jct.assembly_s > 0 and again.jct.training_s > 0
    assert len(again.timeline.df) == len(result.timeline.df)
    assert_no_gloo_threads_after_teardown(out, ranks=2)
    # kept as JSON, CSV and weights-only tensors: it loads without the pickled spec
    kept = load_result(again.save(tmp_path / "kept"))
    assert kept.meta["launched_by"] == "torchrun" and kept.jct == again.jct and kept.step_ms == again.step_ms
    assert_frame_equal(kept.timeline.df, again.timeline.df, check_exact=True)
    assert_frame_equal(kept.ranks, again.ranks, check_exact=True)
    assert all(torch.equal(a, b) for a, b in zip(kept.state_dict().values(), again.state_dict().values()))


def assert_no_gloo_threads_after_teardown(out, ranks):
    """Every rank's process group and its C++ threads are gone before exit. See [Note: the process group outlives its
    destroy]."""
    import json

    from pipeswift_lab.runner.rank.worker import GLOO_THREADS

    for rank in range(ranks):
        left = json.loads((Path(out) / f"rank{rank}.done").read_text())["threads_after_teardown"]
        assert not [name for name in left if name.startswith(GLOO_THREADS)], (rank, left)


def test_cold_subprocess_workers_give_the_same_run(notebook_run):
    result, _ = notebook_run
    model, batch, part = setup()
    cold = run(
        model,
        batch,
        nn.functional.mse_loss,
        part,
        4,
        steps=2,
        progress=False,
        launch=Launch(timeout_s=120, start_method="subprocess"),
    )
    assert_close_states(cold.state_dict(), result.state_dict())
    assert cold.losses == pytest.approx(result.losses, rel=1e-6)
    # a cold start imports torch on every rank: the phases show it
    phases = dict(zip(cold.assembly_phases["phase"], cold.assembly_phases["seconds"]))
    assert phases["processes started -> runner entered (python, torch and the spec's model code loaded)"] > 0.2
