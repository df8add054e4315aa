"""Jobs that live through a cluster: checkpoints, resume on any partition, preemption, crashes, NaNs.

Every run is real (gloo worker processes); faults are real signals sent to real workers from
inside the data callable at a known step (only in the first attempt, so a restart does not
repeat them). The tests that matter: an interrupted and resumed job ends bitwise equal to
an uninterrupted one on the same partition, and within 1e-5 on another.
"""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from checkpoint_pacing import AwaitSaves
from torch import nn

import pipeswift_lab as psl
from pipeswift_lab.core.costs import CheckpointModel
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.runner import CheckpointError, RunError, latest_checkpoint, run, write_fault
from pipeswift_lab.runner.job import clean_stale_run_dirs
from pipeswift_lab.runner.processes import alive, zombie

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it

PROFILE = Profile.synthetic(fwd_ms=[1.0] * 5, bwd_ms=[2.0] * 5)
TWO = Partition.from_bounds(PROFILE, [(0, 2), (2, 5)], schedule="1F1B")
THREE = Partition.from_bounds(PROFILE, [(0, 1), (1, 3), (3, 5)], schedule="1F1B")
STEPS = 8


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Dropout(0.1), nn.Linear(12, 3))


def plain():
    """The model without dropout: nothing in it draws random numbers."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 3))


def batch(step):
    return torch.randn(8, 6), torch.randn(8, 3)


def first_attempt(rank):
    return os.environ.get("RANK") == str(rank) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def sigkill_rank1_at_5(step):
    if step == 5 and first_attempt(1):
        os.kill(os.getpid(), signal.SIGKILL)
    return batch(step)


def sigterm_rank0_at_3(step):
    if step == 3 and first_attempt(0):
        os.kill(os.getpid(), signal.SIGTERM)
    return batch(step)


OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def go(data=batch, partition=TWO, steps=STEPS, optimizer="adam", **kw):
    return run(
        model(),
        data,
        nn.functional.mse_loss,
        partition,
        4,
        steps=steps,
        optimizer=OPTIMIZERS[optimizer],
        progress=False,
        **kw,
    )


def bitwise(a, b):
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module", params=sorted(OPTIMIZERS))
def reference(request):
    """An uninterrupted job (with dropout, so RNG restoring matters) and its optimizer name."""
    return request.param, go(optimizer=request.param)


def test_checkpointing_changes_nothing_and_keeps_the_newest(tmp_path, reference):
    name, ref = reference
    # one periodic save, the run's first, is never skipped; a second one (at 6 of 8 steps every 3) was, on a loaded
    # machine: due when the steps left take less time than a (starved) background write. The final one never is.
    result = go(optimizer=name, checkpoint=psl.Checkpointing(tmp_path, every=4, keep=1))
    assert bitwise(result.state_dict(), ref.state_dict())
    assert list(result.checkpoints["step"]) == [4, 8]
    assert list(result.checkpoints["kind"]) == ["periodic", "final"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000008"]  # the newest one kept, the older removed
    assert result.checkpoint == str(tmp_path / "step-00000008")
    table = result.checkpoints
    assert list(table["status"]) == ["committed"] * 2 and list(table["mode"]) == ["async", "waited"]
    assert (table["save_ms"] > 0).all() and (table["write_ms"] > 0).all() and (table["staging_ms"] > 0).all()
    background = table[table["mode"] == "async"]  # the step loop waited only for the copy, not for the write
    assert (background["blocking_ms"] == background["staging_ms"]).all()
    final = table.iloc[-1]  # the final save waits for its commit
    assert final["blocking_ms"] == final["save_ms"] >= final["write_ms"]
    assert result.jct.preemption_loss_s >= result.checkpoints["blocking_ms"].iloc[:1].sum() / 1e3
    assert result.jct.cleanup_s >= result.checkpoints["blocking_ms"].iloc[-1] / 1e3
    final = psl.load_checkpoint(tmp_path)
    assert bitwise(final.state_dict(), ref.state_dict())
    manifest = final.manifest
    for key in (
        "step",
        "P",
        "v",
        "m",
        "schedule",
        "microbatch_size",
        "bounds",
        "layer_names",
        "world_size",
        "torch_version",
        "optimizer",
        "rng_states",
        "files",
    ):
        assert key in manifest, key
    assert manifest["bounds"] == [[0, 2], [2, 5]] and manifest["layer_names"] == ["0", "1", "2", "3", "4"]


def test_preempted_by_sigterm_to_a_worker_then_resumed_is_bitwise_equal(tmp_path, reference):
    name, ref = reference
    first = go(data=sigterm_rank0_at_3, optimizer=name, checkpoint=tmp_path)
    assert first.status == "preempted"
    assert first.checkpoint == str(tmp_path / "step-00000004")  # step 3 finished on every rank, then all saved
    assert len(first.step_ms) == 4 and list(first.checkpoints["kind"]) == ["preempt"]
    second = go(optimizer=name, resume_from=tmp_path)
    assert second.status == "completed" and second.first_step == 4 and len(second.step_ms) == STEPS - 4
    assert list(second.df["step"]) == list(range(4, STEPS))
    assert second.meta["rng_restored"]
    assert second.restore_s > 0 and second.jct.preemption_loss_s >= second.restore_s
    assert bitwise(second.state_dict(), ref.state_dict())
    assert second.losses == ref.losses[4:]


def test_crash_restarts_from_the_newest_checkpoint_and_ends_bitwise_equal(tmp_path, reference):
    name, ref = reference
    # the kill at step 5 finds save 4 committed: the attempt's first save, never skipped (a later one may be on a
    # loaded machine, due when the steps left take less time than a starved background write)
    data = AwaitSaves(sigkill_rank1_at_5, tmp_path, every=4)
    result = go(
        data=data, optimizer=name, checkpoint=psl.Checkpointing(tmp_path, every=4), faults=psl.Faults(max_restarts=1)
    )
    assert result.status == "completed" and result.restarts == 1
    assert result.first_step == 4 and result.steps_redone == 1  # steps 0-4 done, checkpoint at 4, step 4 redone
    assert result.recovery_s > 0 and result.jct.preemption_loss_s >= result.recovery_s
    assert bitwise(result.state_dict(), ref.state_dict())


def test_resume_on_another_partition_without_randomness_is_within_1e5(tmp_path):
    adam = OPTIMIZERS["adam"]
    # the uninterrupted run saves at step 4 on its way (its first periodic save, never skipped; saving changes nothing,
    # bit for bit: the first test), and the other partition resumes from that save
    ref = run(
        plain(),
        batch,
        nn.functional.mse_loss,
        TWO,
        4,
        steps=STEPS,
        optimizer=adam,
        progress=False,
        checkpoint=psl.Checkpointing(tmp_path, every=4),
    )
    other = run(
        plain(),
        batch,
        nn.functional.mse_loss,
        THREE,
        4,
        steps=STEPS,
        optimizer=adam,
        progress=False,
        resume_from=tmp_path / "step-00000004",
    )
    assert (
        other.P == 3 and other.first_step == 4 and not other.meta["rng_restored"]
    )  # another partition: RNG not restored
    for key, want in ref.state_dict().items():
        err = ((other.state_dict()[key] - want).norm() / want.norm()).item()
        assert err <= 1e-5, (key, err)


MARKER_DATA = """
def marked(step):
    if step == 3 and "RANK" in os.environ:
        open(MARKER, "w").close()
    time.sleep(0.02)
    return torch.randn(8, 6), torch.randn(8, 3)
"""


def test_sigterm_to_the_caller_saves_and_returns_preempted(tmp_path):
    marker = tmp_path / "marker"
    namespace = {"os": os, "time": time, "torch": torch, "MARKER": str(marker)}
    exec(MARKER_DATA, namespace)

    def notice():
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=notice, daemon=True).start()
    before = signal.getsignal(signal.SIGTERM)
    # steps enough to outlast the notice on a loaded machine (20 ms each): the run ends at the preemption, not there
    result = go(data=namespace["marked"], steps=2000, checkpoint=tmp_path / "ck")
    assert signal.getsignal(signal.SIGTERM) is before  # the caller's handler is back
    assert result.status == "preempted" and 4 <= len(result.step_ms) < 2000
    assert latest_checkpoint(tmp_path / "ck").step == len(result.step_ms)


def test_a_killed_rank_is_named_with_its_signal():
    with pytest.raises(RunError) as info:
        go(data=sigkill_rank1_at_5)
    assert info.value.reason == "died" and info.value.rank == 1
    assert "killed by signal SIGKILL" in str(info.value)


def nan_at_3(step):
    x, y = batch(step)
    if step == 3:
        y[0, 0] = float("nan")
    return x, y


def test_nonfinite_loss_raises_naming_step_and_rank_and_keeps_the_last_good_checkpoint(tmp_path):
    with pytest.raises(RunError) as info:
        go(data=nan_at_3, checkpoint=psl.Checkpointing(tmp_path, every=2))
    err = info.value
    assert err.reason == "nonfinite" and err.rank == 1 and err.step == 3
    assert "step 3" in str(err) and "nan" in str(err) and "step-00000002" in str(err)
    assert latest_checkpoint(tmp_path).step == 2
    assert all(torch.isfinite(t).all() for t in err.result.state_dict().values())


@pytest.mark.parametrize("error, cause", [("ENOSPC", "No space left on device"), ("EROFS", "Read-only file system")])
def test_a_disk_that_fills_or_turns_read_only_during_a_save_is_named_and_the_last_checkpoint_stands(
    tmp_path, error, cause
):
    with write_fault(step=4, rank=1, error=error), pytest.raises(RunError) as info:
        # save 2 has ended before save 4 falls due, and rank 1's failed write before step 5; the steps left after
        # save 4 keep it from being skipped for the end being nearer than a (starved) background write
        go(data=AwaitSaves(batch, tmp_path, every=2), checkpoint=psl.Checkpointing(tmp_path, every=2), steps=60)
    err = info.value  # the background write's failure surfaces at the step loop's next check
    assert err.reason == "raised" and err.rank == 1 and err.step in (4, 5) and cause in str(err)
    assert "checkpoint of step 4" in str(err)
    assert latest_checkpoint(tmp_path).step == 2  # the failed save committed nothing
    resumed = go(resume_from=latest_checkpoint(tmp_path).path, steps=6)
    assert resumed.first_step == 2 and resumed.status == "completed"


def test_nonfinite_skip_drops_the_update_and_ignore_keeps_it():
    batches = [nan_at_3(step) for step in range(6)]
    sgd = OPTIMIZERS["sgd_momentum"]
    skipped = run(
        plain(),
        batches,
        nn.functional.mse_loss,
        TWO,
        4,
        steps=6,
        optimizer=sgd,
        progress=False,
        faults=psl.Faults(on_nonfinite="skip"),
    )
    assert skipped.skipped_steps == (3,)
    without = run(
        plain(), batches[:3] + batches[4:], nn.functional.mse_loss, TWO, 4, steps=5, optimizer=sgd, progress=False
    )
    assert bitwise(skipped.state_dict(), without.state_dict())
    ignored = go(data=nan_at_3, optimizer="sgd_momentum", faults=psl.Faults(on_nonfinite="ignore"))
    assert any(not torch.isfinite(t).all() for t in ignored.state_dict().values())


def test_auto_interval_uses_the_measured_save_time(tmp_path):
    result = go(steps=12, checkpoint=psl.Checkpointing(tmp_path, every="auto", keep=20, mtbf_s=0.4))
    table = result.checkpoints
    assert table["kind"].iloc[0] == "auto" and table["step"].iloc[0] == 1  # the first save measures C
    assert table["kind"].iloc[-1] == "final"
    interval = result.meta["checkpoint_interval_steps"]
    assert interval is not None and interval >= 1


def test_auto_interval_survives_a_crash_and_restart(tmp_path, reference):
    name, ref = reference
    result = go(
        data=sigkill_rank1_at_5,
        optimizer=name,
        checkpoint=psl.Checkpointing(tmp_path, every="auto", keep=20, mtbf_s=0.4),
        faults=psl.Faults(max_restarts=1),
    )
    assert result.restarts == 1 and bitwise(result.state_dict(), ref.state_dict())
    assert (result.checkpoints.groupby("attempt")["step"].min() >= 1).all()  # each attempt measured its own save time


def test_history_terms_add_up_on_a_synthetic_history():
    from pipeswift_lab.runner.assembly import history_terms

    ms = 1_000_000
    steps = [(0, s, s * 10 * ms, s * 10 * ms + 8 * ms) for s in range(5)]  # attempt 0: steps 0-4, 8 ms each
    steps += [(1, s, 100 * ms + (s - 2) * 10 * ms, 100 * ms + (s - 2) * 10 * ms + 8 * ms) for s in range(2, 6)]
    history = {
        "steps": steps,
        "attempts": {0: {"first_step": 0}, 1: {"first_step": 2}},
        "checkpoints": [{"attempt": 0, "step": 2, "end_ns": 45 * ms}],
    }  # a save that ended after step 4
    terms = history_terms(history)
    assert terms["restarts"] == 1 and terms["steps_redone"] == 3  # steps 2, 3, 4 trained again
    assert terms["redone_s"] == pytest.approx(3 * 8e-3)
    assert terms["recovery_s"] == pytest.approx(
        (100 - 48) * 1e-3
    )  # from the end of step 4 (48 ms), later than the save
    lost_json = {**history, "attempts": {0: {"first_step": 0}}, "checkpoints": []}  # attempt 1 never wrote its json
    assert history_terms(lost_json)["restarts"] == 1


def test_calibrated_checkpoint_model(tmp_path):
    saved = go(checkpoint=psl.Checkpointing(tmp_path, every=2, keep=10))
    resumed = go(steps=STEPS + 2, resume_from=tmp_path)
    model = CheckpointModel.calibrate([saved, resumed])
    stalls = pd.concat([saved.checkpoints, resumed.checkpoints])
    stalls = stalls[stalls["status"] == "committed"]  # on a loaded machine a save may be skipped: it cost nothing
    size = stalls["largest_rank_state_bytes"].iloc[0]
    assert (stalls["largest_rank_state_bytes"] == size).all()  # one shard size: the stall is taken as latency
    background = stalls[(stalls["status"] == "committed") & (stalls["mode"] == "async")]
    assert model.asynchronous and len(background) >= 1
    assert model.stall_s(size) == pytest.approx(background["blocking_ms"].median() / 1e3, rel=1e-9)
    assert (background["blocking_ms"] == background["staging_ms"]).all()  # the loop waits for the copy, not the write
    assert model.restore_s(resumed.meta["restore_bytes"]) == pytest.approx(resumed.restore_s, rel=1e-9)
    final = saved.checkpoints["blocking_ms"].iloc[-1] / 1e3
    assert model.teardown_s == pytest.approx(saved.jct.cleanup_s - final, rel=1e-9)  # the resumed run saved nothing
    with pytest.warns(UserWarning, match="nothing was restored"):
        CheckpointModel.calibrate([saved])
    with pytest.raises(ValueError, match="saved checkpoints"):
        CheckpointModel.calibrate([resumed])  # a run that saved nothing (it has no checkpoint=)


@pytest.mark.parametrize(
    "arguments, error, match",
    [
        (lambda d: {"checkpoint": psl.Checkpointing(d, every="auto")}, ValueError, "needs mtbf_s"),
        (lambda d: {"checkpoint": psl.Checkpointing(d, every="sometimes")}, ValueError, "every='sometimes'"),
        (lambda d: {"checkpoint": psl.Checkpointing(d, every=0)}, ValueError, "every=0"),
        (lambda d: {"checkpoint": psl.Checkpointing(d, keep=0)}, ValueError, "keep=0"),
        (lambda d: {"checkpoint": psl.Checkpointing(d, mtbf_s=3600.0)}, ValueError, "mtbf_s=3600 is used only"),
        (lambda d: {"checkpoint": 3}, TypeError, "checkpoint must be a directory"),
        (lambda d: {"faults": psl.Faults(max_restarts=1)}, ValueError, "needs checkpoint="),
        (lambda d: {"faults": psl.Faults(on_nonfinite="panic")}, ValueError, "on_nonfinite='panic'"),
        (lambda d: {"faults": psl.Faults(preempt_grace_s=0)}, ValueError, "preempt_grace_s"),
        (lambda d: {"faults": "restart"}, TypeError, "faults must be a pipeswift_lab.Faults or None"),
        (lambda d: {"resume_from": d.with_name("MISSING")}, CheckpointError, "does not exist"),
        (lambda d: {"checkpoint_dir": d, "keep": 3}, TypeError, r"checkpoint_dir= is now checkpoint=.*keep= is now"),
        (lambda d: {"max_restarts": 1}, TypeError, r"max_restarts= is now faults=psl.Faults\(max_restarts=...\)"),
    ],
)
def test_bad_job_arguments_fail_before_launch(tmp_path, arguments, error, match):
    with pytest.raises(error, match=match):
        go(**arguments(tmp_path / "X"))
    assert not (tmp_path / "X").exists()


def test_bad_resumes_fail_before_launch_and_touch_nothing(tmp_path):
    go(steps=4, checkpoint=tmp_path)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match="steps=4 is the job's total, but the checkpoint .* is already at step 4"):
        go(steps=4, resume_from=tmp_path)
    other = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 12), nn.Tanh(), nn.Linear(12, 3))
    with pytest.raises(CheckpointError, match=r"0\.weight \[10, 6\] in the model vs \[12, 6\] in the checkpoint"):
        run(other, batch, nn.functional.mse_loss, TWO, 4, steps=8, progress=False, resume_from=tmp_path)
    with pytest.raises(ValueError, match="torch.optim.adam.Adam optimizer, but optimizer makes a torch.optim.sgd.SGD"):
        go(steps=8, optimizer="sgd_momentum", resume_from=tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        go(resume_from=empty)
    empty.rmdir()
    with pytest.raises(ValueError, match="already holds checkpoints of an earlier run .*pass resume_from"):
        go(steps=8, checkpoint=tmp_path)
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


ORPHAN_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch
    from torch import nn
    import pipeswift_lab as psl
    from pipeswift_lab.partitioning.stages import Partition

    PIDS = sys.argv[1]

    def slow(step):
        if "RANK" in os.environ:  # a worker, not the caller's check before launch
            with open(os.path.join(PIDS, os.environ["RANK"]), "w") as f:
                f.write(str(os.getpid()))
        time.sleep(0.2)
        return torch.randn(8, 6), torch.randn(8, 3)

    if __name__ == "__main__":
        prof = psl.Profile.synthetic(fwd_ms=[1.0] * 3, bwd_ms=[1.0] * 3)
        part = Partition.from_bounds(prof, [(0, 1), (1, 3)], schedule="GPipe")
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        psl.run(model, slow, nn.functional.mse_loss, part, 2, steps=10_000, progress=False,
                launch=psl.Launch(timeout_s=600))
""")


def test_workers_die_with_their_caller(tmp_path, monkeypatch):
    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    script = tmp_path / "caller.py"
    script.write_text(ORPHAN_SCRIPT)
    # a temporary root of its own (short, for the sockets under it): another test worker's run() removes the run
    # directories of dead callers in the shared one, this one's included, before this test can look
    private_tmp = Path(tempfile.mkdtemp(prefix="psl_orphan_"))
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    caller = subprocess.Popen(
        [sys.executable, str(script), str(pids_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "TMPDIR": str(private_tmp)},
    )
    deadline = time.monotonic() + 120
    while len(list(pids_dir.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = [int(p.read_text()) for p in pids_dir.iterdir()]
    assert len(workers) == 2, "the workers never started"
    caller.kill()  # a kernel killed: no cleanup code runs in the caller
    caller.wait()
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers)
    stale = [p for p in Path(tempfile.gettempdir()).glob("pipeswift_run_*") if _owned_by(p, caller.pid)]
    assert stale, "the killed caller left its run directory (the next run() removes it)"
    removed = clean_stale_run_dirs()
    assert {str(p) for p in stale} <= set(removed)
    assert not any(p.exists() for p in stale)
    shutil.rmtree(private_tmp, ignore_errors=True)


def _owned_by(path, pid):
    try:
        return (path / "owner.pid").read_text() == str(pid)
    except OSError:
        return False


def _alive(pid):
    """Running (a zombie waiting for its reaper counts as gone)."""
    return alive(pid) and not zombie(pid)
