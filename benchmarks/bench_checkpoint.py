"""What checkpoints cost on this machine, and whether a save killed part-way can ever be loaded.

On the reference GPT (default size, Adam, so the optimizer state is twice the parameters) at
P=2 on CPU ranks (gloo):

* **save throughput** — the largest rank's bytes over the slowest rank's DCP save time, median
  over every save of a run with ``checkpoint_every=1``, against writing the same number of bytes
  with plain file I/O (``write`` + ``fsync``) on the same disk: ``save_vs_plain``;
* **restore throughput** — the bytes the largest rank loaded over ``restore_s`` of a
  ``resume_from`` run, against reading the same bytes back with plain file I/O: ``restore_vs_plain``;
* **stall** — the median ``blocking_ms`` (the step loop stopped while saving) against the median step;
* **time to the first resumed step** — ``run(resume_from=...)`` launch to its first step
  (assembly + restore) against a fresh start's assembly (medians of 3, alternating);
* **kill-during-save trials** — SIGKILL of rank 1 at a random moment while a save is being
  written (a ``.tmp-`` directory exists), then ``latest_checkpoint`` of the root must verify and
  hold exactly the state an uninterrupted run saved at that step; the count of corrupt loads.

Run: ``python benchmarks/bench_checkpoint.py [--trials 50]`` (about three minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import pandas as pd
import torch


def plain_io(nbytes: int, directory: Path, repeats: int = 5) -> tuple[float, float]:
    """Median GB/s of writing (with fsync) and then reading ``nbytes`` with plain file I/O in ``directory``."""
    payload = os.urandom(nbytes)
    writes, reads = [], []
    for i in range(repeats):
        path = directory / f"plain-{i}.bin"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        writes.append(nbytes / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            f.read()
        reads.append(nbytes / (time.perf_counter() - t0) / 1e9)
        path.unlink()
    return statistics.median(writes), statistics.median(reads)


def _killer(root: Path, nth: int, delay_s: float, done: threading.Event, outcome: dict) -> None:
    """SIGKILL rank 1 of this process's running job ``delay_s`` after its ``nth`` save starts (a ``.tmp-`` directory
    appears)."""
    me = str(os.getpid())
    seen = set()
    while not done.is_set():
        seen.update(p.name for p in root.glob(".tmp-step-*")) if root.exists() else None
        if len(seen) >= nth:
            time.sleep(delay_s)
            for run_dir in Path(tempfile.gettempdir()).glob("pipeswift_run_*/segment*"):
                try:
                    if (run_dir / "owner.pid").read_text() == me:
                        os.kill(int((run_dir / "rank1.pid").read_text()), signal.SIGKILL)
                        outcome["killed"] = True
                        outcome["tmp_left"] = any(root.glob(".tmp-step-*"))
                        return
                except (OSError, ValueError):
                    continue
        time.sleep(0.001)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50, help="kill-during-save trials")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)

    from pipeswift_lab import latest_checkpoint, load_checkpoint, run
    from pipeswift_lab.models import reference
    from pipeswift_lab.partitioning.balance import partition
    from pipeswift_lab.profiling.table import Profile
    from pipeswift_lab.runner import RunError

    setup = reference("gpt")
    n_layers = len(setup.model)
    part = partition(Profile.synthetic(fwd_ms=[1.0] * n_layers, bwd_ms=[2.0] * n_layers), 2)
    adam = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731
    batch = (setup.inputs, setup.targets)
    common = dict(loss_fn=setup.loss_fn, partition=part, m=2, optimizer=adam, progress=False)
    work = Path(tempfile.mkdtemp(prefix="pipeswift_bench_ckpt_"))
    try:
        run(setup.model, batch, steps=2, **common)  # warm the fork server
        saved = run(
            setup.model,
            batch,
            steps=args.steps,
            checkpoint_dir=work / "every",
            checkpoint_every=1,
            keep=args.steps + 1,
            **common,
        )
        table = saved.checkpoints
        periodic = table[table["kind"] == "periodic"]
        largest = int(table["largest_rank_bytes"].max())
        write_plain, read_plain = plain_io(largest, work)
        save_GBps = statistics.median(periodic["largest_rank_bytes"] / (periodic["save_ms"] / 1e3) / 1e9)

        fresh_s, resume_s, restore_GBps = [], [], []
        for _ in range(3):
            fresh = run(setup.model, batch, steps=args.steps, **common)
            fresh_s.append(fresh.jct.assembly_s)
            resumed = run(setup.model, batch, steps=args.steps + 2, resume_from=work / "every", **common)
            resume_s.append(resumed.jct.assembly_s + resumed.restore_s)
            restore_GBps.append(resumed.meta["restore_bytes"] / resumed.restore_s / 1e9)

        rows = [
            {"metric": "checkpoint size (all ranks, MB)", "value": table["bytes"].iloc[0] / 1e6},
            {"metric": "largest rank's share (MB)", "value": largest / 1e6},
            {"metric": "save GB/s (largest rank, median)", "value": save_GBps},
            {"metric": "plain write+fsync GB/s", "value": write_plain},
            {"metric": "save_vs_plain", "value": save_GBps / write_plain},
            {"metric": "restore GB/s (largest rank, median)", "value": statistics.median(restore_GBps)},
            {"metric": "plain read GB/s", "value": read_plain},
            {"metric": "restore_vs_plain", "value": statistics.median(restore_GBps) / read_plain},
            {"metric": "median step (ms)", "value": saved.steady_step_ms},
            {"metric": "median save stall, blocking_ms", "value": periodic["blocking_ms"].median()},
            {"metric": "median DCP save, save_ms", "value": periodic["save_ms"].median()},
            {"metric": "fresh start: launch to first step (s, median of 3)", "value": statistics.median(fresh_s)},
            {"metric": "resume: launch to first step (s, median of 3)", "value": statistics.median(resume_s)},
        ]

        # kill-during-save trials against the states of the uninterrupted run saved at every step
        want = {ck.step: ck.state_dict() for ck in map(load_checkpoint, sorted((work / "every").glob("step-*")))}
        rng = random.Random(0)
        save_s = periodic["save_ms"].median() / 1e3
        corrupt, landed, loaded = 0, 0, 0
        for trial in range(args.trials):
            root = work / f"kill-{trial}"
            done, outcome = threading.Event(), {}
            nth = rng.randint(2, args.steps - 1)  # a later save, so that an earlier complete checkpoint exists
            killer = threading.Thread(
                target=_killer, args=(root, nth, rng.uniform(0, save_s), done, outcome), daemon=True
            )
            killer.start()
            try:
                run(
                    setup.model,
                    batch,
                    steps=args.steps,
                    checkpoint_dir=root,
                    checkpoint_every=1,
                    keep=2,
                    timeout_s=120,
                    **common,
                )
            except RunError:
                pass
            done.set()
            killer.join(5)
            landed += bool(outcome.get("tmp_left"))
            latest = latest_checkpoint(root)
            if latest is not None:
                loaded += 1
                state = latest.state_dict()
                ok = all(torch.equal(state[k], want[latest.step][k]) for k in want[latest.step])
                corrupt += not ok
            shutil.rmtree(root, ignore_errors=True)
        rows += [
            {"metric": "kill trials", "value": args.trials},
            {"metric": "kills that left a save half-written", "value": landed},
            {"metric": "trials with a complete checkpoint to load", "value": loaded},
            {"metric": "corrupt loads", "value": corrupt},
        ]
        pd.set_option("display.float_format", lambda x: f"{x:.4g}")
        print(pd.DataFrame(rows).to_string(index=False))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
