"""What checkpoints cost on this machine, against the goals of asynchronous saves, and whether a save killed part-way
can ever be loaded.

On the reference GPT (default size, Adam, so the optimizer state is twice the parameters) at P=2 on CPU ranks (gloo),
all measured in one run of this script (the fork server warmed first). The ``--rounds`` runs of each mode (no
checkpoints; ``Checkpointing(dir, every=1)`` asynchronous, the default; ``Checkpointing(dir, every=1,
asynchronous=False)``) are interleaved, their order rotated each round, and the figures are medians over them. One
table, with columns ``metric``, ``value``, ``goal`` and ``ok`` (``-`` for the raw figures a goal is computed from):

* **end to end** — training + cleanup (``jct.total_s - jct.assembly_s``) of ``--steps`` steps with a save after
  every step, over the same without checkpoints (medians): ``<= 1.10`` for async, ``> 1.25`` a failure (a second
  row); the sync mode's ratio beside it, and each mode's ``training_s + preemption_loss_s`` (the save stalls)
  ``+ cleanup_s`` (the final save, which waits for its write, and the teardown);
* **stall per save** — the median ``blocking_ms`` of the committed async periodic saves, against a plain in-memory
  copy of the largest rank's tensors in this process (``dst.copy_(src)`` of ``largest_rank_state_bytes`` uint8,
  with the threads a rank has, cores // P; a ``clone`` of the same bytes, which allocates, beside it): ``<= 2x``;
  and against cloning each tensor of a state shaped as that rank's (``{k: t.clone()}``, the copy of a state dict
  as a user would make it): ``<= 2x``;
  and against the median step without checkpoints: ``<= 10%`` (with what the plain copy alone costs of that step);
* **background write** — ``largest_rank_bytes / write_ms`` (the slowest rank's file, fsync and SHA-256) of the
  async periodic saves, against plain ``write`` + ``fsync`` of the same bytes on the same disk (:func:`plain_io`):
  ``>= 50%``, ``>= 80%`` the stretch; the sync mode's save throughput (``/ save_ms``, staging and commit included)
  and write throughput beside it, and SHA-256 of the same bytes in this process (part of ``write_ms``);
* **restore** — ``restore_s`` of a ``resume_from`` run on the same partition (``meta["restore_bytes"]``), against
  ``torch.load`` of a dict of tensors shaped as the largest rank's (``torch.save``-d to a file in the same
  directory; its save time shown too): ``<= 2x``; the restore's GB/s against a plain read of the same bytes too;
* **resume launch** — ``jct.assembly_s + restore_s`` of the resume run (launch to its first step) against a fresh
  start's ``assembly_s`` plus that restore (medians of 3, fresh and resume alternating): ``<= 1.00``;
* **kill trials** — SIGKILL of rank 1 at a random moment while a save is being written in the background (the 2nd
  to 4th save's ``.tmp-step-*`` directory exists) in a run with ``Checkpointing(dir, every=1, keep=2)``, then
  ``latest_checkpoint`` of the root must verify and hold exactly the state the uninterrupted sync run saved at that
  step: ``0`` corrupt loads; and in how many trials the newest intact checkpoint was the one loaded (its step is the
  highest ``step-*`` with a manifest). The rows also count the kills that found a save being written;
* **step with a save in flight** — the async runs' median step over the median step without checkpoints (steps
  after the first, the memory-probed step left out): ``<= 1.10``; within the async runs, the steps that overlap a
  background write for at least half their time against the others (told apart from the step starts and each
  save's ``blocking_ms``/``save_ms``; with a save every step hardly any step is free of a write).

The last line gives the wall time and the load average: on a shared machine other processes' load moves every
timing, which is why the modes are interleaved and the ratios are taken within one run of the script.

Run: ``python benchmarks/bench_checkpoint.py`` (``--trials 50 --steps 12 --rounds 3``): 5.5 minutes on 2 cores (326 s
at a load average near 4; 497 s with other jobs keeping it near 6), about 60% of it the kill trials; ``--quick``
(3 trials, 1 round, fewer repetitions) in 70-90 seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import re
import shutil
import signal
import statistics
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from pipeswift_lab import Checkpointing, Launch

#: A save being written (not the ``.tmp-step-trash-*`` of an old checkpoint being removed).
_SAVING = re.compile(r"^\.tmp-step-\d{8}-")


def _median(values: Any) -> float:
    values = [float(v) for v in values]
    return statistics.median(values) if values else float("nan")


def _saving(root: Path) -> list[str]:
    """The names of the saves being written under ``root``."""
    return [p.name for p in root.glob(".tmp-step-*") if _SAVING.match(p.name)] if root.exists() else []


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


def concurrent_write_GBps(nbytes: int, directory: Path, writers: int, repeats: int = 3) -> float:
    """Median GB/s each of ``writers`` threads gets writing (with fsync) its own ``nbytes`` file in ``directory`` at
    the same time, as the ranks of a run do."""
    payload = os.urandom(nbytes)
    rates = []

    def write(path: Path, out: list[float]) -> None:
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)

    for i in range(repeats):
        out: list[float] = []
        paths = [directory / f"plain-{i}-{w}.bin" for w in range(writers)]
        threads = [threading.Thread(target=write, args=(path, out)) for path in paths]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rates.append(statistics.median(out))
        for path in paths:
            path.unlink()
    return statistics.median(rates)


def memory_copy_ms(nbytes: int, threads: int, repeats: int = 7) -> tuple[float, float]:
    """Median ms of ``dst.copy_(src)`` of ``nbytes`` uint8 (``dst`` allocated once, as a staging buffer) and of
    ``src.clone()`` (fresh memory each time), with ``threads`` torch threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)  # touch the destination once, as the first save does
        copies, clones = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            copies.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            clone = src.clone()
            clones.append((time.perf_counter() - t0) * 1e3)
            del clone
        return statistics.median(copies), statistics.median(clones)
    finally:
        torch.set_num_threads(before)


def state_clone_ms(shapes: dict[str, tuple[str, list[int]]], threads: int, repeats: int = 7) -> float:
    """Median ms of cloning every tensor of a state shaped as ``shapes`` (``{key: (dtype, shape)}``): a plain
    in-memory copy of a rank's state, tensor by tensor, as ``{k: t.clone() for k, t in state.items()}``."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        state = {key: torch.ones(shape, dtype=getattr(torch, dtype)) for key, (dtype, shape) in shapes.items()}
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            copy = {key: t.clone() for key, t in state.items()}
            times.append((time.perf_counter() - t0) * 1e3)
            del copy
        return statistics.median(times)
    finally:
        torch.set_num_threads(before)


def sha256_ms(nbytes: int, repeats: int = 5) -> float:
    """Median ms of SHA-256 over ``nbytes`` in memory."""
    payload = os.urandom(nbytes)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        hashlib.sha256(payload).hexdigest()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def torch_save_load_s(
    shapes: dict[str, tuple[str, list[int]]], directory: Path, repeats: int = 5
) -> tuple[float, float]:
    """Median seconds of ``torch.save`` of a dict of tensors of ``shapes`` (``{key: (dtype, shape)}``) to a file in
    ``directory``, and of ``torch.load`` of it."""
    state = {}
    for key, (dtype, shape) in shapes.items():
        dt = getattr(torch, dtype)
        state[key] = torch.randn(shape).to(dt) if dt.is_floating_point else torch.zeros(shape, dtype=dt)
    saves, loads = [], []
    path = directory / "torch-save.pt"
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.save(state, path)
        saves.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        torch.load(path)
        loads.append(time.perf_counter() - t0)
        path.unlink()
    return statistics.median(saves), statistics.median(loads)


def largest_rank_shapes(manifest: dict[str, Any]) -> dict[str, tuple[str, list[int]]]:
    """``{key: (dtype, shape)}`` of the tensors of the rank with the most tensor bytes in a checkpoint's manifest."""
    ranks = manifest["ranks"]
    biggest = max(ranks, key=lambda r: sum(t[1] for t in r["tensors"].values()))
    return {key: (t[2], list(t[3])) for key, t in biggest["tensors"].items()}


def measured_steps(result: Any) -> list[int]:
    """Indices into ``result.step_ms`` of the steps a median is taken over: after the first (warm-up), without the
    step whose memory was probed (slower for it)."""
    probed = {s - result.first_step for s in result.probed_steps}
    return [j for j in range(1, len(result.step_ms)) if j not in probed]


def write_overlap(result: Any) -> list[tuple[float, float]]:
    """``(share, step_ms)`` of each of an async run's :func:`measured_steps`: the share of the step during which a
    background write was in flight (the save after ``k`` steps starts when step ``k-1`` ends, and is written from
    ``blocking_ms`` to ``save_ms`` later)."""
    starts, ms, first = result.meta["step_start_ms"], result.step_ms, result.first_step
    table = result.checkpoints
    rows = table[(table["status"] == "committed") & (table["mode"] == "async")]
    windows = []
    for row in rows.itertuples():
        k = int(row.step) - first
        if 1 <= k <= len(ms):
            begin = starts[k - 1] + ms[k - 1]
            windows.append((begin + float(row.blocking_ms), begin + float(row.save_ms)))
    out = []
    for j in measured_steps(result):
        a, b = starts[j], starts[j] + ms[j]
        out.append((sum(max(0.0, min(b, end) - max(a, begin)) for begin, end in windows) / ms[j], ms[j]))
    return out


def _killer(root: Path, nth: int, delay_s: float, done: threading.Event, outcome: dict) -> None:
    """SIGKILL rank 1 of this process's running job ``delay_s`` after its ``nth`` save starts being written (a
    ``.tmp-step-`` directory appears)."""
    me = str(os.getpid())
    seen = set()
    while not done.is_set():
        seen.update(_saving(root))
        if len(seen) >= nth:
            time.sleep(delay_s)
            for run_dir in Path(tempfile.gettempdir()).glob("pipeswift_run_*/segment*"):
                try:
                    if (run_dir / "owner.pid").read_text() == me:
                        os.kill(int((run_dir / "rank1.pid").read_text()), signal.SIGKILL)
                        outcome["killed"] = True
                        outcome["tmp_left"] = bool(_saving(root))
                        return
                except (OSError, ValueError):
                    continue
        time.sleep(0.001)


def _row(metric: str, value: Any, goal: str = "-", ok: Any = "-") -> dict[str, Any]:
    if isinstance(value, float):
        value = "nan" if value != value else f"{value:.4g}"
    return {"metric": metric, "value": value, "goal": goal, "ok": ok if ok == "-" else bool(ok)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=None, help="kill-during-save trials (default 50; --quick 3)")
    parser.add_argument("--steps", type=int, default=12, help="steps of each timed run (default 12)")
    parser.add_argument("--rounds", type=int, default=None, help="runs of each mode (default 3; --quick 1)")
    parser.add_argument("--quick", action="store_true", help="3 trials, 1 round, fewer repetitions: to debug")
    args = parser.parse_args(argv)
    trials = args.trials if args.trials is not None else (3 if args.quick else 50)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    repeats = 3 if args.quick else 7
    if args.steps < 4:
        parser.error("--steps must be at least 4 (the kill trials kill a save after an earlier one committed)")

    from pipeswift_lab import latest_checkpoint, load_checkpoint, run
    from pipeswift_lab.models import reference
    from pipeswift_lab.partitioning.balance import partition
    from pipeswift_lab.profiling.table import Profile
    from pipeswift_lab.runner import RunError

    began = time.perf_counter()
    setup = reference("gpt")
    n_layers = len(setup.model)
    P = 2
    part = partition(Profile.synthetic(fwd_ms=[1.0] * n_layers, bwd_ms=[2.0] * n_layers), P)
    adam = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731
    batch = (setup.inputs, setup.targets)
    common = dict(loss_fn=setup.loss_fn, partition=part, m=2, optimizer=adam, progress=False)
    steps = args.steps
    work = Path(tempfile.mkdtemp(prefix="pipeswift_bench_ckpt_"))
    try:
        run(setup.model, batch, steps=2, **common)  # warm the fork server

        # the three modes, interleaved; round 0's checkpoint roots are kept: sync's (a save at every step) for the
        # kill trials' reference states, async's to resume from
        modes = {
            "none": {},
            "async": dict(every=1),
            "sync": dict(every=1, asynchronous=False),
        }
        runs: dict[str, list[Any]] = {mode: [] for mode in modes}
        names = list(modes)
        for r in range(rounds):
            for mode in names[r % 3 :] + names[: r % 3]:
                saving = modes[mode]
                kwargs = {"checkpoint": Checkpointing(work / f"{mode}-{r}", keep=steps + 1, **saving)} if saving else {}
                runs[mode].append(run(setup.model, batch, steps=steps, **kwargs, **common))
                if saving and r > 0:
                    shutil.rmtree(work / f"{mode}-{r}", ignore_errors=True)

        def train_cleanup(mode: str) -> float:
            return _median(x.jct.total_s - x.jct.assembly_s for x in runs[mode])

        def breakdown(mode: str) -> str:
            """Medians of the JCT's terms after the assembly: the steps, the save stalls (and the restore, none
            here) and the cleanup (the final save, waited for, and the teardown)."""
            terms = ("training_s", "preemption_loss_s", "cleanup_s")
            return " + ".join(f"{_median(getattr(x.jct, t) for x in runs[mode]):.3f}" for t in terms)

        def step_median(mode: str) -> float:
            return _median(x.step_ms[j] for x in runs[mode] for j in measured_steps(x))

        table = pd.concat([x.checkpoints for x in runs["async"]], ignore_index=True)
        committed = table[table["status"] == "committed"]
        periodic = committed[(committed["kind"] == "periodic") & (committed["mode"] == "async")]
        due = table[table["kind"] == "periodic"]
        sync_table = pd.concat([x.checkpoints for x in runs["sync"]], ignore_index=True)
        sync = sync_table[(sync_table["status"] == "committed") & (sync_table["kind"] == "periodic")]
        largest = int(committed["largest_rank_bytes"].max())
        state_bytes = int(committed["largest_rank_state_bytes"].max())

        # plain baselines of the same bytes, in this process
        write_plain, read_plain = plain_io(largest, work, repeats=max(3, repeats - 2))
        write_each = concurrent_write_GBps(largest, work, P, repeats=3)
        rank_threads = max(1, (os.cpu_count() or 1) // P)
        copy_ms, clone_ms = memory_copy_ms(state_bytes, rank_threads, repeats)
        hash_ms = sha256_ms(largest, repeats=max(3, repeats - 2))
        resume_root = work / "async-0"
        newest = load_checkpoint(resume_root)
        shapes = largest_rank_shapes(newest.manifest)
        save_s_plain, load_s_plain = torch_save_load_s(shapes, work, max(3, repeats - 2))
        state_copy_ms = state_clone_ms(shapes, rank_threads, repeats)

        # fresh start and resume, alternating (the resume continues the async run for two more steps)
        fresh_s, resume_s, restore_s, restore_bytes = [], [], [], []
        for _ in range(1 if args.quick else 3):
            fresh = run(setup.model, batch, steps=2, **common)
            fresh_s.append(fresh.jct.assembly_s)
            resumed = run(setup.model, batch, steps=steps + 2, resume_from=resume_root, **common)
            resume_s.append(resumed.jct.assembly_s + resumed.restore_s)
            restore_s.append(resumed.restore_s)
            restore_bytes.append(resumed.meta["restore_bytes"])

        none_tc, async_tc, sync_tc = train_cleanup("none"), train_cleanup("async"), train_cleanup("sync")
        none_step, async_step, sync_step = step_median("none"), step_median("async"), step_median("sync")
        stall_ms = _median(periodic["blocking_ms"])
        write_GBps = _median(periodic["largest_rank_bytes"] / (periodic["write_ms"] / 1e3) / 1e9)
        save_GBps = _median(periodic["largest_rank_bytes"] / (periodic["save_ms"] / 1e3) / 1e9)
        sync_save_GBps = _median(sync["largest_rank_bytes"] / (sync["save_ms"] / 1e3) / 1e9)
        sync_write_GBps = _median(sync["largest_rank_bytes"] / (sync["write_ms"] / 1e3) / 1e9)
        restore_med, restore_b = _median(restore_s), _median(restore_bytes)
        fresh_med, resume_med = _median(fresh_s), _median(resume_s)
        overlaps = [pair for x in runs["async"] for pair in write_overlap(x)]
        in_flight = [ms for share, ms in overlaps if share >= 0.5]
        free = [ms for share, ms in overlaps if share < 0.5]
        in_flight_ms, free_ms = _median(in_flight), _median(free)

        e2e = async_tc / none_tc
        rows = [
            _row(f"train+cleanup, no checkpoints (s, median of {rounds})", none_tc),
            _row("train+cleanup, async save every step (s)", async_tc),
            _row("train+cleanup, sync save every step (s)", sync_tc),
            _row("end to end: async / no checkpoints", e2e, "<= 1.10", e2e <= 1.10),
            _row("end to end: async / no checkpoints (failure bound)", e2e, "<= 1.25", e2e <= 1.25),
            _row("end to end: sync / no checkpoints", sync_tc / none_tc),
            _row("  training_s + preemption_loss_s + cleanup_s, none (s)", breakdown("none")),
            _row("  training_s + preemption_loss_s + cleanup_s, async (s)", breakdown("async")),
            _row("  training_s + preemption_loss_s + cleanup_s, sync (s)", breakdown("sync")),
            _row("median step, no checkpoints (ms)", none_step),
            _row("stall per save: median blocking_ms, async periodic", stall_ms),
            _row(f"plain copy_ of largest_rank_state_bytes (ms, {rank_threads} thread, median)", copy_ms),
            _row("clone of the same bytes (ms, median)", clone_ms),
            _row("stall / plain copy", stall_ms / copy_ms, "<= 2", stall_ms / copy_ms <= 2),
            _row("clone of each tensor of the rank's state (ms, median)", state_copy_ms),
            _row("stall / clone of each tensor", stall_ms / state_copy_ms, "<= 2", stall_ms / state_copy_ms <= 2),
            _row("stall / median step", stall_ms / none_step, "<= 0.10", stall_ms / none_step <= 0.10),
            _row("plain copy / median step", copy_ms / none_step),
            _row("median sync blocking_ms", _median(sync["blocking_ms"])),
            _row("checkpoint size, all ranks (MB)", float(committed["bytes"].iloc[0]) / 1e6),
            _row("largest rank's file (MB)", largest / 1e6),
            _row("largest rank's tensors (MB)", state_bytes / 1e6),
            _row("async background write GB/s (bytes / write_ms, median)", write_GBps),
            _row("plain write+fsync GB/s", write_plain),
            _row(f"plain write+fsync, {P} files at once (GB/s each)", write_each),
            _row("async write / plain", write_GBps / write_plain, ">= 0.50", write_GBps / write_plain >= 0.5),
            _row("async write / plain (stretch)", write_GBps / write_plain, ">= 0.80", write_GBps / write_plain >= 0.8),
            _row("median write_ms, async periodic", _median(periodic["write_ms"])),
            _row("plain write+fsync of the same bytes (ms)", largest / write_plain / 1e6),
            _row("sha256 of the same bytes in this process (ms)", hash_ms),
            _row("async save GB/s (bytes / save_ms, start to commit)", save_GBps),
            _row("save_vs_plain (async, save_ms)", save_GBps / write_plain),
            _row("sync save GB/s (bytes / save_ms)", sync_save_GBps),
            _row("sync save / plain", sync_save_GBps / write_plain),
            _row("sync write GB/s (bytes / write_ms)", sync_write_GBps),
            _row("median write_ms, sync", _median(sync["write_ms"])),
            _row("periodic saves skipped (a write still in flight)", f"{len(due) - len(periodic)} of {len(due)}"),
            _row(f"restore_s, same partition (s, median of {len(restore_s)})", restore_med),
            _row("restore_bytes (MB)", restore_b / 1e6),
            _row("torch.save of an equally shaped dict (s, median)", save_s_plain),
            _row("torch.load of it (s, median)", load_s_plain),
            _row("restore / torch.load", restore_med / load_s_plain, "<= 2", restore_med / load_s_plain <= 2),
            _row("restore GB/s", restore_b / restore_med / 1e9),
            _row("plain read GB/s", read_plain),
            _row("restore_vs_plain", restore_b / restore_med / 1e9 / read_plain),
            _row(f"fresh start: assembly_s (s, median of {len(fresh_s)})", fresh_med),
            _row("resume: assembly_s + restore_s (s, median)", resume_med),
            _row("resume / (fresh assembly + restore)", resume_med / (fresh_med + restore_med), "<= 1.00",
                 resume_med <= fresh_med + restore_med),
        ]  # fmt: skip

        # kill-during-save trials against the states of the uninterrupted sync run, which saved at every step
        reference_root = work / "sync-0"
        want: dict[int, dict[str, torch.Tensor]] = {}

        def wanted(step: int) -> dict[str, torch.Tensor]:
            if step not in want:
                want[step] = load_checkpoint(reference_root / f"step-{step:08d}").state_dict()
            return want[step]

        rng = random.Random(0)
        # the kill comes at a random moment of the nth write: the hidden directory exists from the end of the
        # staging to the commit, save_ms - blocking_ms (its lower quartile, so that most kills land in it)
        save_s = float((periodic["save_ms"] - periodic["blocking_ms"]).quantile(0.25)) / 1e3
        # the nth save being written is killed: a later save than the first, so that a complete checkpoint exists, and
        # an early one (a trial takes about 2.5 s + 0.5 s a step on 2 cores), within the saves the async runs committed
        commits = min(int((x.checkpoints["status"] == "committed").sum()) for x in runs["async"])
        last_nth = max(2, min(4, commits - 1))
        corrupt, killed, landed, loaded, newest_loaded, warned = 0, 0, 0, 0, 0, 0
        for trial in range(trials):
            root = work / f"kill-{trial}"
            done, outcome = threading.Event(), {}
            nth = rng.randint(2, last_nth)  # a later save, so that an earlier complete checkpoint exists
            killer = threading.Thread(
                target=_killer, args=(root, nth, rng.uniform(0, save_s), done, outcome), daemon=True
            )
            killer.start()
            try:
                run(
                    setup.model,
                    batch,
                    steps=steps,
                    checkpoint=Checkpointing(root, every=1, keep=2),
                    launch=Launch(timeout_s=120),
                    **common,
                )
            except RunError:
                pass
            done.set()
            killer.join(5)
            killed += bool(outcome.get("killed"))
            landed += bool(outcome.get("tmp_left"))
            complete = [int(p.name[5:]) for p in root.glob("step-*") if (p / "manifest.json").is_file()]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                latest = latest_checkpoint(root)
            warned += bool(caught)
            if latest is not None:
                loaded += 1
                newest_loaded += latest.step == max(complete)
                state, expected = latest.state_dict(), wanted(latest.step)
                corrupt += not all(torch.equal(state[k], expected[k]) for k in expected)
            shutil.rmtree(root, ignore_errors=True)

        flight = async_step / none_step
        rows += [
            _row("kill trials", trials),
            _row("trials where rank 1 was killed", killed),
            _row("kills while a save was being written (.tmp- left)", landed),
            _row("trials with a complete checkpoint to load", loaded),
            _row("newest intact checkpoint loaded", newest_loaded, f"= {loaded}", newest_loaded == loaded),
            _row("loads that skipped a checkpoint with a warning", warned),
            _row("corrupt loads", corrupt, "0", corrupt == 0),
            _row("median step, async save every step (ms)", async_step),
            _row("median step, sync save every step (ms)", sync_step),
            _row("step with a save in flight: async / no checkpoints", flight, "<= 1.10", flight <= 1.10),
            _row(f"async steps >= half under a write: median (ms), n={len(in_flight)}", in_flight_ms),
            _row(f"async steps < half under a write: median (ms), n={len(free)}", free_ms),
            _row("async steps: >= half / < half under a write", in_flight_ms / free_ms,
                 "<= 1.10" if in_flight and free else "-",
                 in_flight_ms / free_ms <= 1.10 if in_flight and free else "-"),
        ]  # fmt: skip
        pd.set_option("display.max_colwidth", 100)
        pd.set_option("display.width", 200)
        out = pd.DataFrame(rows)
        out["metric"] = out["metric"].str.ljust(int(out["metric"].str.len().max()))
        print(out.to_string(index=False, justify="left"))
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        took = time.perf_counter() - began
        print(f"\n{trials} trials, {rounds} rounds, {steps} steps; ran in {took:.0f} s; load average {load}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
