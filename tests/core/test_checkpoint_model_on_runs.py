"""CheckpointModel.calibrate on real runs: an asynchronous run teaches a stall shorter than its writes, a
synchronous one a stall that is the whole save."""

import pytest
import torch
from torch import nn

from pipeswift_lab import Checkpointing
from pipeswift_lab.core.costs import CheckpointModel
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.runner import run

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it

PROFILE = Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4)
TWO = Partition.from_bounds(PROFILE, [(0, 2), (2, 4)], schedule="1F1B")


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Linear(64, 4))


def batch(step):
    return torch.randn(8, 64), torch.randn(8, 4)


def saved_run(root, **kwargs):
    """A 5-step run with a checkpoint due after every step (and the final one)."""
    result = run(
        model(), batch, nn.functional.mse_loss, TWO, 2, steps=5, checkpoint=Checkpointing(root, every=1, **kwargs),
        progress=False,
    )  # fmt: skip
    return result, result.checkpoints[result.checkpoints["status"] == "committed"]


def test_an_asynchronous_run_calibrates_a_stall_that_is_its_staging_copy(tmp_path):
    result, saves = saved_run(tmp_path)
    assert (saves["mode"] == "async").any() and (saves["kind"] == "final").sum() == 1
    with pytest.warns(UserWarning, match="nothing was restored"):
        model = CheckpointModel.calibrate(result)
    assert model.asynchronous
    state = saves["largest_rank_state_bytes"].iloc[0]
    assert (saves["largest_rank_state_bytes"] == state).all()  # one shard size: each cost is taken as latency
    stalls = saves.loc[saves["mode"] == "async", "blocking_ms"]
    assert model.stall_s(state) == pytest.approx(stalls.median() / 1e3, rel=1e-9)
    # a periodic save stalls for its staging copy only (a whole save also writes, fsyncs and checksums the file; by
    # how much longer is a timing against a timing: benchmarks/bench_checkpoint.py)
    background = saves[saves["mode"] == "async"]
    assert (background["blocking_ms"] == background["staging_ms"]).all()
    assert model.min_interval_s(state) == model.save_s(state)
    assert model.interval_s(state, 3600.0) >= model.save_s(state)


def test_a_synchronous_run_calibrates_a_stall_that_is_the_whole_save(tmp_path):
    result, saves = saved_run(tmp_path, asynchronous=False)
    assert (saves["mode"] == "sync").all() and len(saves) == 5  # none skipped
    with pytest.warns(UserWarning, match="nothing was restored"):
        model = CheckpointModel.calibrate(result)
    assert not model.asynchronous
    size = saves["largest_rank_bytes"].iloc[0]
    assert model.stall_s(size) == model.save_s(size) == pytest.approx(saves["blocking_ms"].median() / 1e3, rel=1e-9)
    assert model.min_interval_s(size) == 0.0
    assert model.teardown_s == pytest.approx(result.jct.cleanup_s - saves["blocking_ms"].iloc[-1] / 1e3, rel=1e-9)
