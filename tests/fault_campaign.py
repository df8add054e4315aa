"""A fault campaign: short real jobs under faults drawn at random, and the checks every trial must pass.

Used by ``benchmarks/bench_faults.py`` (100+ trials) and ``tests/runner/test_fault_campaign.py``
(one trial of each kind). A trial runs a 6-step, two-rank 1F1B job with dropout (so restoring
RNG states matters) and one fault; ``trial()`` returns one row: the fault, where it struck, the
outcome and each check. No save a trial aims at is skipped (a periodic save due while the last one
is written is): a kill finds every save due before it committed (``checkpoint_pacing.AwaitSaves``),
and the kill and corruption trials save once before the final save (an attempt's first save is
never skipped; a later one may be on a loaded machine when the steps left are few); a disk fault's
job reads through ``AwaitSaves`` too, has more steps after its faulty save, and ends there. The
checks (every one must hold in every trial):

* ``ended_well`` — the run completed, was preempted, or raised a ``RunError`` of the expected reason;
* ``named_right`` — a ``RunError`` names the rank, step and cause the fault had;
* ``bitwise`` — a run that completed (after its restarts or resume) ends with parameters equal,
  bit for bit, to the uninterrupted run's;
* ``redo_within_interval`` — steps trained twice are at most the checkpoint interval;
* ``no_corrupt_load`` — a corrupted checkpoint is refused and never resumed from;
* ``no_process_left`` — no worker outlives the trial;
* ``no_run_dir_left`` — no temporary run directory remains (a killed caller's is removed by the next run's clean-up).
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import torch
from checkpoint_pacing import AwaitSaves
from torch import nn

from pipeswift_lab import Checkpointing, Faults, Launch
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.runner import (
    CheckpointError,
    RunError,
    latest_checkpoint,
    load_checkpoint,
    run,
    signal_at,
    write_fault,
)
from pipeswift_lab.runner.job import clean_stale_run_dirs

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY, M, P = 6, 2, 4, 2
#: The interval of the trials that need a save committed before their fault: one periodic save (3) before the final
#: one, the attempt's first, which is never skipped (a later one may be on a loaded machine: due when the steps left
#: take less time than a starved background write).
EVERY_ONCE = STEPS // 2
#: The hang trial's ``timeout_s`` (unless ``campaign(hang_timeout_s=)`` says otherwise): its rank sleeps for an hour, so
#: the trial lasts about this long.
HANG_TIMEOUT_S = 8
PART = Partition.from_bounds(Profile.synthetic(fwd_ms=[1.0] * 5, bwd_ms=[2.0] * 5), [(0, 2), (2, 5)], schedule="1F1B")
KINDS = (
    "kill_rank",
    "kill_rank_restart",
    "preempt_caller",
    "hang",
    "nonfinite",
    "raise_in_loss",
    "raise_in_data",
    "corrupt_checkpoint",
    "disk_fault",
    "kill_caller",
)
CHECKS = (
    "ended_well",
    "named_right",
    "bitwise",
    "redo_within_interval",
    "no_corrupt_load",
    "no_process_left",
    "no_run_dir_left",
)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Dropout(0.1), nn.Linear(12, 3))


def batch(step: int):
    return torch.randn(8, 6), torch.randn(8, 3)


class NanAt:
    """Data whose targets hold a NaN at ``step``."""

    def __init__(self, step: int):
        self.step = step

    def __call__(self, step: int):
        x, y = batch(step)
        if step == self.step:
            y[0, 0] = float("nan")
        return x, y


class RaiseAt:
    """Data that raises at ``step`` in a worker (the caller's checks before launch read step 0 only)."""

    def __init__(self, step: int):
        self.step = step

    def __call__(self, step: int):
        if step == self.step and "RANK" in os.environ:
            raise KeyError(f"no batch for step {step} (deliberate)")
        return batch(step)


class TouchAt:
    """Data that creates ``marker`` when a worker fetches ``step``, then takes a second: a signal sent then lands in
    that step."""

    def __init__(self, step: int, marker: str):
        self.step, self.marker = step, marker

    def __call__(self, step: int):
        if step == self.step and "RANK" in os.environ:
            Path(self.marker).touch()
            time.sleep(1.0)
        return batch(step)


class LossRaisingAt:
    """MSE, except that in a worker it raises on its first call of ``step`` (``M`` calls a step)."""

    def __init__(self, step: int):
        self.step, self.calls = step, 0

    def __call__(self, output, target):
        self.calls += "RANK" in os.environ
        if self.calls == self.step * M + 1:
            raise ArithmeticError(f"loss diverged at step {self.step} (deliberate)")
        return nn.functional.mse_loss(output, target)


class HangAt(nn.Module):
    """Identity that sleeps an hour on rank 1 from its forward of ``step`` on (``M`` forwards a step)."""

    def __init__(self, step: int):
        super().__init__()
        self.step, self.calls = step, 0

    def forward(self, x):
        if os.environ.get("RANK") == "1":
            self.calls += 1
            if self.calls > self.step * M:
                time.sleep(3600)
        return x


def go(data=batch, loss_fn=nn.functional.mse_loss, net=None, **kw):
    return run(
        net if net is not None else model(),
        data,
        loss_fn,
        PART,
        M,
        steps=kw.pop("steps", STEPS),
        progress=False,
        launch=kw.pop("launch", Launch(timeout_s=120)),
        **kw,
    )


def reference():
    """The uninterrupted run's final parameters."""
    return go().state_dict()


def _bitwise(a, b) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _descendants() -> list[int]:
    """Live descendants of this process, leaving out multiprocessing's fork server and resource tracker."""
    import psutil

    return [
        p.pid
        for p in psutil.Process().children(recursive=True)
        if p.status() != psutil.STATUS_ZOMBIE
        and not any(x in " ".join(p.cmdline()) for x in ("forkserver", "resource_tracker"))
    ]


def _settled(predicate, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > end:
            return False
        time.sleep(0.1)
    return True


def _run_dirs(owner: int) -> list[Path]:
    out = []
    for path in Path(tempfile.gettempdir()).glob("pipeswift_run_*"):
        try:
            if (path / "owner.pid").read_text() == str(owner):
                out.append(path)
        except OSError:
            continue
    return out


KILL_CALLER_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1])
    import fault_campaign as fc
    if __name__ == "__main__":
        fc.go(data=fc.TouchAt(int(sys.argv[2]), sys.argv[3]), launch=fc.Launch(timeout_s=600))
""")


def trial(kind: str, rng: random.Random, want: dict, workdir: Path, hang_timeout_s: float = HANG_TIMEOUT_S) -> dict:
    """One trial of ``kind`` with its fault drawn from ``rng``; returns the row of outcome and checks. A hang trial's
    job runs with ``timeout_s=hang_timeout_s`` (most of that trial's time)."""
    step = rng.randrange(1, STEPS)
    rank = rng.randrange(P)
    row = {
        "kind": kind,
        "step": step,
        "rank": rank,
        "outcome": "",
        "named_right": True,
        "bitwise": True,
        "redo_within_interval": True,
        "no_corrupt_load": True,
        "detail": "",
    }
    expect, result, err = None, None, None
    ck = workdir / "ck"
    try:
        if kind == "kill_rank":
            expect = ("died", rank)
            go(data=signal_at(batch, step=step, rank=rank, sig="SIGKILL"))
        elif kind == "kill_rank_restart":
            result = go(  # the kill finds every save due before its step committed: at most one interval is redone
                data=AwaitSaves(signal_at(batch, step=step, rank=rank, sig="SIGKILL"), str(ck), EVERY_ONCE),
                checkpoint=Checkpointing(ck, every=EVERY_ONCE),
                faults=Faults(max_restarts=1),
            )
            row["redo_within_interval"] = result.restarts == 1 and result.steps_redone <= EVERY_ONCE
            row["outcome"] = f"restarted, {result.status}"
        elif kind == "preempt_caller":
            marker = workdir / "marker"
            threading.Thread(
                target=lambda: _settled(marker.exists, 60) and os.kill(os.getpid(), signal.SIGTERM), daemon=True
            ).start()
            first = go(data=TouchAt(step, str(marker)), checkpoint=ck)
            if first.status != "preempted":
                raise AssertionError(f"status {first.status} after SIGTERM")
            saved = latest_checkpoint(ck).step  # the preemption's own save, at the step it stopped
            result = (
                go(resume_from=ck) if saved < STEPS else first
            )  # a notice in the last step leaves nothing to resume
            row["redo_within_interval"] = saved == len(first.step_ms) and result.first_step in (
                0,
                saved,
            )  # nothing trained twice
            row["outcome"] = f"preempted, resumed: {result.status}" if saved < STEPS else "preempted at the last step"
            result = dataclasses.replace(result, status="completed") if saved == STEPS else result
        elif kind == "hang":
            expect = ("hung", 1)
            go(
                net=nn.Sequential(nn.Linear(6, 12), nn.Tanh(), HangAt(step), nn.Linear(12, 12), nn.Linear(12, 3)),
                launch=Launch(timeout_s=hang_timeout_s),
            )
        elif kind == "nonfinite":
            expect = ("nonfinite", 1)
            go(data=NanAt(step))
        elif kind == "raise_in_loss":
            expect = ("raised", 1)
            go(loss_fn=LossRaisingAt(step))
        elif kind == "raise_in_data":
            expect = ("raised", None)  # every rank holding data raises: either may be named
            go(data=RaiseAt(step))
        elif kind == "corrupt_checkpoint":
            go(checkpoint=Checkpointing(ck, every=EVERY_ONCE, keep=3))  # saves 3 and 6 (final): neither is skipped
            newest = latest_checkpoint(ck)
            files = sorted(newest.path.glob("rank-*.bin"))
            victim = files[rng.randrange(len(files))]
            data = bytearray(victim.read_bytes())
            data[rng.randrange(len(data))] ^= 0xFF
            victim.write_bytes(bytes(data))
            try:
                load_checkpoint(newest.path)
                row["no_corrupt_load"] = False
            except CheckpointError:
                pass
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                fallback = latest_checkpoint(ck)
                row["no_corrupt_load"] &= fallback is not None and fallback.step < newest.step
                result = go(resume_from=ck)
            row["no_corrupt_load"] &= result.first_step == fallback.step
            row["redo_within_interval"] = newest.step - result.first_step <= EVERY_ONCE
            row["step"] = newest.step
            row["outcome"] = f"resumed from {fallback.step}: {result.status}"
        elif kind == "disk_fault":
            step = rng.choice(range(EVERY, STEPS, EVERY))
            row["step"] = step
            expect = ("raised", rank)
            with write_fault(step=step, rank=rank, error=rng.choice(("ENOSPC", "EROFS"))):
                # the save before the faulty one has ended when it falls due, and the faulty rank's write before the
                # next step; steps left after it keep it from being skipped for the end being near (the run ends there)
                data = AwaitSaves(batch, str(ck), EVERY)
                go(data=data, checkpoint=Checkpointing(ck, every=EVERY), steps=10 * STEPS)
        elif kind == "kill_caller":
            marker = workdir / "marker"
            caller = subprocess.Popen(
                [sys.executable, "-c", KILL_CALLER_SCRIPT, str(ROOT / "tests"), str(step), str(marker)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd=workdir,
            )
            started = _settled(marker.exists, 120)
            caller.kill()
            caller.wait()
            row["outcome"] = "caller killed" if started else "caller never reached its step"
            import psutil

            row["no_process_left"] = _settled(
                lambda: (
                    not [
                        p for p in psutil.process_iter(["cmdline"]) if str(workdir) in " ".join(p.info["cmdline"] or [])
                    ]
                ),
                15,
            )
            clean_stale_run_dirs()
            row["no_run_dir_left"] = not _run_dirs(caller.pid)
            row["ended_well"] = started
            return row
        else:
            raise ValueError(f"kind={kind!r}: use one of {KINDS}")
    except RunError as exc:
        err = exc
    if not row["outcome"]:
        row["outcome"] = (
            f"RunError({err.reason})" if err is not None else (result.status if result is not None else "completed")
        )
    if expect is None:
        row["ended_well"] = err is None
        row["detail"] = str(err)[:200] if err is not None else ""
    else:
        reason, at_rank = expect
        row["ended_well"] = err is not None and err.reason == reason
        if err is not None:
            # a background write's failure surfaces at the step loop's next check, a step or so after its save
            at_step = err.step == row["step"] or (kind == "disk_fault" and err.step in (row["step"], row["step"] + 1))
            row["named_right"] = at_step and (at_rank is None or err.rank == at_rank) and _names_cause(kind, err)
            row["detail"] = f"rank {err.rank}, step {err.step}: {str(err).splitlines()[0][:160]}"
        if kind == "disk_fault":
            kept = latest_checkpoint(ck)
            row["no_corrupt_load"] = (kept.step if kept else 0) == row["step"] - EVERY
    if result is not None and result.status == "completed":
        row["bitwise"] = _bitwise(result.state_dict(), want)
    row["no_process_left"] = _settled(lambda: not _descendants(), 10)
    row["no_run_dir_left"] = not _run_dirs(os.getpid())
    return row


def _names_cause(kind: str, err: RunError) -> bool:
    text = str(err)
    return {
        "kill_rank": "SIGKILL" in text,
        "hang": "did not finish within timeout_s" in text,
        "nonfinite": "not finite" in text,
        "raise_in_loss": "loss diverged" in text,
        "raise_in_data": "no batch for step" in text,
        "disk_fault": ("No space left on device" in text or "Read-only file system" in text),
    }.get(kind, True)


def campaign(trials: int, seed: int = 0, progress: bool = True, hang_timeout_s: float = HANG_TIMEOUT_S):
    """``trials`` trials, kinds in turn (each kind ``trials / len(KINDS)`` times), faults drawn with ``seed``, a hang
    stopped after ``hang_timeout_s``; returns the rows."""
    import pandas as pd
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    want = reference()
    rows = []
    for i in tqdm(range(trials), desc="fault campaign", disable=not progress):
        kind = KINDS[i % len(KINDS)]
        began = time.monotonic()
        with tempfile.TemporaryDirectory() as workdir:
            try:
                rows.append(trial(kind, rng, want, Path(workdir), hang_timeout_s))
            except Exception as exc:  # a trial that breaks the harness is a failed trial, not the end of the campaign
                rows.append(
                    {
                        "kind": kind,
                        "outcome": f"harness: {type(exc).__name__}",
                        "detail": str(exc)[:300],
                        **{check: False for check in CHECKS},
                    }
                )
        rows[-1]["seconds"] = time.monotonic() - began  # printed by the benchmark, never asserted: load moves it
    return pd.DataFrame(rows)


def summary(rows):
    """Per fault kind: trials, outcomes, how many trials passed each check, and the median and largest seconds a
    trial took (a hang's: its ``timeout_s`` of ``HANG_TIMEOUT_S``, then the diagnosis and clean-up)."""
    table = rows.groupby("kind", sort=False).agg(
        trials=("kind", "size"),
        outcomes=("outcome", lambda s: ", ".join(sorted(set(s)))),
        **{check: (check, "sum") for check in CHECKS},
        median_s=("seconds", "median"),
        max_s=("seconds", "max"),
    )
    return table.reset_index()
