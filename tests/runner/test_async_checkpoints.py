"""Checkpoints written in the background: skipped saves, waits at the end and at a preemption, direct restores,
write failures.

Every run is real (gloo worker processes). A rehearsed slow disk (``slow_disk``: each rank file's write spread over
a known time) makes a background write outlast several steps, so which saves are skipped and where a
preemption lands are decided by the test, not by the machine's speed.
"""

import os
import signal

import pytest
import torch
from checkpoint_pacing import AwaitSaves
from torch import nn

from pipeswift_lab import Checkpointing
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.runner import RunError, latest_checkpoint, load_checkpoint, run, slow_disk, write_fault

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it

PROFILE = Profile.synthetic(fwd_ms=[1.0] * 5, bwd_ms=[2.0] * 5)
TWO = Partition.from_bounds(PROFILE, [(0, 2), (2, 5)], schedule="1F1B")
THREE = Partition.from_bounds(PROFILE, [(0, 1), (1, 3), (3, 5)], schedule="1F1B")


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Dropout(0.1), nn.Linear(12, 3))


def batch(step):
    return torch.randn(8, 6), torch.randn(8, 3)


def sigterm_rank0_at_4(step):
    if step == 4 and os.environ.get("RANK") == "0" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGTERM)
    return batch(step)


def go(data=batch, partition=TWO, steps=8, **kw):
    return run(
        model(),
        data,
        nn.functional.mse_loss,
        partition,
        4,
        steps=steps,
        optimizer=lambda params: torch.optim.Adam(params, lr=0.01),
        progress=False,
        **kw,
    )


def bitwise(a, b):
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference():
    return go()


def test_a_save_due_while_one_is_written_is_skipped_and_the_final_one_waits(tmp_path, reference):
    with slow_disk(0.6):  # each write outlasts several ~10 ms steps
        result = go(checkpoint=Checkpointing(tmp_path, every=1, keep=10))
    assert bitwise(result.state_dict(), reference.state_dict())  # staging a copy changes nothing
    table = result.checkpoints
    committed, skipped = table[table["status"] == "committed"], table[table["status"] == "skipped"]
    assert len(skipped) >= 2 and committed["step"].iloc[0] == 1
    assert (skipped["blocking_ms"] == 0).all() and skipped["path"].isna().all()
    final = committed.iloc[-1]
    assert final["kind"] == "final" and final["step"] == 8 and final["mode"] == "waited"
    assert final["blocking_ms"] >= 600  # it waited for its own slow write (and the one before it)
    background = committed[committed["mode"] == "async"]
    # the step loop waited only for the copy (the stall is the staging, whatever a busy core makes of it), the write
    # (slowed to 0.6 s) went on behind it
    assert (background["blocking_ms"] == background["staging_ms"]).all() and (background["save_ms"] >= 600).all()
    on_disk = sorted(int(p.name[5:]) for p in tmp_path.glob("step-*"))
    assert on_disk == sorted(committed["step"])  # every committed save and only those; no .tmp- left
    assert not list(tmp_path.glob(".tmp-*"))
    assert result.checkpoint == str(tmp_path / "step-00000008")
    saved = load_checkpoint(tmp_path).state_dict()
    assert bitwise(saved, reference.state_dict())


def test_synchronous_saves_wait_for_every_write(tmp_path):
    result = go(checkpoint=Checkpointing(tmp_path, every=2, asynchronous=False))
    table = result.checkpoints
    assert list(table["mode"]) == ["sync"] * 4 and list(table["status"]) == ["committed"] * 4
    assert (table["blocking_ms"] == table["save_ms"]).all() and (table["save_ms"] >= table["write_ms"]).all()


def test_a_preemption_during_a_background_write_waits_for_it_then_saves_its_own_step(tmp_path, reference):
    with slow_disk(0.8):
        result = go(data=sigterm_rank0_at_4, checkpoint=Checkpointing(tmp_path, every=3, keep=5))
    assert result.status == "preempted"
    table = result.checkpoints
    assert list(table["step"]) == [3, 5] and list(table["kind"]) == ["periodic", "preempt"]
    assert list(table["status"]) == ["committed", "committed"]  # the write in flight completed, then the stop saved
    assert latest_checkpoint(tmp_path).step == 5
    resumed = go(resume_from=tmp_path, checkpoint=tmp_path)
    assert resumed.first_step == 5 and bitwise(resumed.state_dict(), reference.state_dict())


def test_a_same_partition_restore_reads_its_own_file_and_another_goes_through_dcp(tmp_path, reference):
    go(checkpoint=tmp_path, steps=4)
    same = go(resume_from=tmp_path)
    assert same.meta["restore_read"] == "direct" and same.meta["rng_restored"]
    assert bitwise(same.state_dict(), reference.state_dict())
    assert same.meta["restore_bytes"] > 0
    other = go(resume_from=tmp_path, partition=THREE)  # its values: tests/runner/test_job.py, within 1e-5
    assert other.meta["restore_read"] == "dcp" and not other.meta["rng_restored"] and other.first_step == 4


def test_a_background_write_that_fails_is_named_with_its_step_and_path_and_the_last_checkpoint_stands(tmp_path):
    with write_fault(step=4, rank=1, error="ENOSPC"), pytest.raises(RunError) as info:
        # save 2 has ended before save 4 falls due, and rank 1's failed write before step 5; the steps left after
        # save 4 keep it from being skipped for the end being nearer than a (starved) background write
        go(data=AwaitSaves(batch, tmp_path, every=2), checkpoint=Checkpointing(tmp_path, every=2), steps=60)
    err, message = info.value, str(info.value)
    assert err.rank == 1 and err.step in (4, 5)  # noticed at the step loop's next check
    assert "No space left on device" in message and "checkpoint of step 4" in message
    assert str(tmp_path) in message and "previous checkpoint stands" in message
    assert latest_checkpoint(tmp_path).step == 2


def test_checkpoint_async_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match="Checkpointing.asynchronous must be True or False"):
        go(checkpoint=Checkpointing(tmp_path, every=2, asynchronous="yes"))
