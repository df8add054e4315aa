"""Planner benchmarks.

1. Planner time on a large search: a 96-layer profile over 1,024 GPUs and over 16,384 with every schedule,
   availability that doubles 4 h in, an 80 GB cap; each beside the action-by-action replay of the memory model
   (the same plan, the peaks of every configuration compared).
2. Predicted-vs-measured agreement on the CPU: the planner ranks configurations of a small
   model whose layers sleep a known time; each is then run for real with the runner, and
   the ranks are compared (Spearman correlation, and the measured step of the planner's
   pick against the best measured).
3. The 3-D search (``plan(..., topology=...)``): the 96-layer profile with tensor-parallel columns (``meta
   ["tp_divides"]`` allowing tp 1, 2, 4, 8) on 16,384 GPUs in nodes of 8, every ``P × D × fsdp × tp``, timed in a
   fresh Python process (its imports timed apart); and on 256 GPUs the same best as ``exhaustive=True``.

Run: ``python benchmarks/bench_planner.py`` (``python benchmarks/bench_planner.py search`` for the
first benchmark alone, ``python benchmarks/bench_planner.py 3d`` for the third alone).
"""

import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pipeswift_lab import Profile, Topology, plan, profile, run
from pipeswift_lab.core import schedule_orders
from pipeswift_lab.core.peak_forms import peak_form
from pipeswift_lab.planning.inputs import check_plan_inputs
from pipeswift_lab.planning.memory_bound import held_counts
from pipeswift_lab.planning.planner import evaluator_of, search
from pipeswift_lab.simulation.engine import lowered

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from sleep_layers import SleepLayer  # the same sleeping layers as the validation test

from pipeswift_lab import Launch

#: The planner-time goals of the large search (seconds) by GPU count, and the 1,024-GPU search's time once the memory
#: model replayed every action of every candidate split (43 s idle on the 2-vCPU development machine, 78 s under
#: load; 1.4 s before the memory model, which counted in-flight micro-batches in closed form).
GOAL_S = {1024: 2.0, 16384: 5.0}
#: The 3-D search's goal (seconds) on 16,384 GPUs in a fresh process, and the time it aims at.
GOAL_3D_S, AIM_3D_S = 5.0, 3.0
BEFORE_S = 43.0
#: Timed runs of each search (the median is printed).
REPEATS = 3


def large_profile() -> Profile:
    rng = np.random.default_rng(0)
    L = 96
    fwd = rng.uniform(8, 12, L)
    fwd[0], fwd[-1] = 4.0, 30.0  # embedding light, LM head heavy (ms at micro-batch 4)
    return Profile.synthetic(
        fwd_ms=fwd.tolist(),
        bwd_ms=(2 * fwd).tolist(),
        param_bytes=[4 * 200e6] * L,  # 200M parameters a layer, fp32
        activation_bytes=[2e9] * L,
        output_bytes=[64e6] * L,
        meta={"batch_size": 4, "device": "cuda"},
    )


def large_tp_profile() -> Profile:
    """:func:`large_profile` with what a Llama-like tensor-parallel plan shards of each layer: 98% of its parameters
    (the norms stay whole), 75% of its saved activations, 95% of its compute; two all-reduces of its output forward
    (attention's and the MLP's) and two backward; 64 heads and 8 key/value heads (tp in 1, 2, 4, 8)."""
    base = large_profile()
    df = base.df
    return Profile.synthetic(
        fwd_ms=df["fwd_ms"].tolist(),
        bwd_ms=df["bwd_ms"].tolist(),
        param_bytes=df["param_bytes"].tolist(),
        activation_bytes=df["activation_bytes"].tolist(),
        output_bytes=df["output_bytes"].tolist(),
        tp_param_bytes=(0.98 * df["param_bytes"]).tolist(),
        tp_activation_bytes=(0.75 * df["activation_bytes"]).tolist(),
        tp_flop_fraction=[0.95] * len(df),
        tp_forward_bytes=(2 * df["output_bytes"]).tolist(),
        tp_backward_bytes=(2 * df["output_bytes"]).tolist(),
        meta={**base.meta, "tp_divides": [64, 8]},
    )


def search_3d_kwargs(gpus: int) -> dict:
    """The 3-D search's arguments: the large search's, on nodes of 8 GPUs (NVLink inside, 25 GB/s between)."""
    return dict(
        gpus=gpus,
        global_batch=1024,
        steps=10_000,
        mem_per_gpu_bytes=80e9,
        availability=[(0, gpus // 2), (4 * 3600, gpus)],
        topology=Topology(8),
        progress=False,
    )


def search_3d_child() -> None:
    """The 3-D search of 16,384 GPUs, run as a fresh process's only work: prints its plan time, and apart the import
    of torch's pipelining that the first plan of any process pays (the other searches here import it untimed)."""
    prof = large_tp_profile()
    start = time.perf_counter()
    schedule_orders.compute_orders(2, 4, "Interleaved1F1B", 2)
    torch_import_s = time.perf_counter() - start
    start = time.perf_counter()
    result = plan(prof, **search_3d_kwargs(16384))
    seconds = time.perf_counter() - start
    table = result.table
    unweighed = int(table["reason"].str.startswith("not weighed").sum())
    print(
        f"96 layers, 16,384 GPUs in nodes of 8, 3-D (tp {sorted(set(table['tp']))}, fsdp up to {table['fsdp'].max()}): "
        f"{len(table):,} configurations, {unweighed:,} pruned by their closed-form bound, {len(result.feasible):,} "
        f"simulated, in {seconds:.2f} s in a fresh process (goal < {GOAL_3D_S:.0f} s, aim {AIM_3D_S:.0f} s: "
        f"{'met' if seconds < GOAL_3D_S else 'MISSED'}; {torch_import_s:.2f} s more importing torch's pipelining, "
        f"which the first plan of a process pays: {seconds + torch_import_s:.2f} s)"
    )
    print(f"  best: {result.best.label}, JCT {result.best.total_s / 3600:.2f} h")


def search_3d() -> None:
    """Time the 3-D search in a fresh process; check on 256 GPUs that it plans what the exhaustive search plans."""
    start = time.perf_counter()
    subprocess.run([sys.executable, __file__, "3d-child"], check=True)
    print(
        f"  the fresh process's wall time, Python's and the package's imports included: "
        f"{time.perf_counter() - start:.2f} s"
    )
    prof = large_tp_profile()
    kwargs = search_3d_kwargs(256)
    (pruned, pruned_s), (full, full_s) = (
        cold(lambda: plan(prof, **kwargs)),
        cold(lambda: plan(prof, exhaustive=True, **kwargs)),
    )
    same = pruned.best.label == full.best.label and pruned.best.total_s == full.best.total_s
    print(
        f"  256 GPUs: {len(pruned.feasible):,} simulated in {pruned_s:.2f} s, exhaustive {len(full.feasible):,} in "
        f"{full_s:.1f} s; same best: {same} ({pruned.best.label})"
    )


def cold(function):
    """``function()``'s value and seconds, with the caches of compiled peaks and torch's orders emptied first, as
    in a fresh process."""
    peak_form.cache_clear()
    schedule_orders._orders.cache_clear()
    schedule_orders._action_groups.cache_clear()
    held_counts.cache_clear()
    lowered.cache_clear()
    start = time.perf_counter()
    value = function()
    return value, time.perf_counter() - start


def large_search(gpus: int) -> None:
    prof = large_profile()
    kwargs = dict(
        gpus=gpus,
        global_batch=1024,
        steps=10_000,
        mem_per_gpu_bytes=80e9,
        availability=[(0, gpus // 2), (4 * 3600, gpus)],
        progress=False,
    )
    times = []
    for _ in range(REPEATS):
        result, seconds = cold(lambda: plan(prof, **kwargs))
        times.append(seconds)
    seconds = statistics.median(times)
    table = result.table
    goal = GOAL_S[gpus]
    print(
        f"96 layers, {gpus:,} GPUs, all schedules: {len(table):,} configurations weighed, "
        f"{int(table['feasible'].sum()):,} feasible, {len(result.feasible):,} simulated, in {seconds:.2f} s "
        f"(median of {REPEATS}: {', '.join(f'{t:.2f}' for t in times)}; goal < {goal:.0f} s: "
        f"{'met' if seconds < goal else 'MISSED'})"
    )
    print(f"  best: {result.best.label}, JCT {result.best.total_s / 3600:.2f} h")
    everything, exhaustive_s = cold(lambda: plan(prof, exhaustive=True, **kwargs))
    same = everything.best.label == result.best.label and everything.best.total_s == result.best.total_s
    print(f"  exhaustive=True: {len(everything.feasible):,} simulated in {exhaustive_s:.2f} s; same best: {same}")
    inputs = check_plan_inputs(prof, **kwargs)
    replay = evaluator_of(inputs, replay=True)
    replayed, replay_s = cold(lambda: search(inputs, replay))
    compare(result, replayed, replay_s)
    compiled = evaluator_of(inputs)
    worst, ranks = 0.0, 0
    for key, peaks in replay.peaks.items():  # every split the search weighed, the capped search's included
        mine = np.array(compiled.peak_memory(*key))
        worst = max(worst, float(np.max(np.abs(mine - peaks) / np.asarray(peaks))))
        ranks += len(peaks)
    print(f"  every split weighed: {len(replay.peaks):,} ({ranks:,} ranks' peaks) within {worst:.1e} of the replay's")


def compare(result, replayed, replay_s: float) -> None:
    """Print whether the replay of every action plans the same: rows, reasons, best, the feasible ones' peaks."""
    columns = ["P", "D", "m", "microbatch_size", "schedule", "v", "strategy", "feasible", "reason"]
    same_rows = result.table[columns].equals(replayed.table[columns])
    fast, slow = result.table["peak_mem_bytes"].to_numpy(float), replayed.table["peak_mem_bytes"].to_numpy(float)
    both = np.isfinite(fast) & np.isfinite(slow)
    worst = float(np.max(np.abs(fast[both] - slow[both]) / slow[both])) if both.any() else 0.0
    same_best = replayed.best.label == result.best.label and replayed.best.total_s == result.best.total_s
    print(
        f"  the replay of every action: {replay_s:.1f} s, best {replayed.best.label} "
        f"(JCT {replayed.best.total_s / 3600:.2f} h); same best: {same_best}; same rows and reasons: {same_rows}; "
        f"peaks of the {int(both.sum()):,} feasible within {worst:.1e} of the replay's"
        f"{'' if np.array_equal(np.isfinite(fast), np.isfinite(slow)) else ' (NOT the same ones)'}"
    )


def cpu_agreement():
    torch.set_num_threads(1)
    # split_backward: zero-bubble's I and W passes each run their half, as a real layer's two matmuls do
    model = nn.Sequential(
        *[
            SleepLayer(fixed_ms, 2 * fixed_ms, per_sample_ms=1.0, split_backward=True)
            for fixed_ms in [6.0, 3.0, 3.0, 9.0]
        ]
    )
    loss_fn = nn.functional.mse_loss
    profiles = [
        profile(
            model, torch.randn(b, 4), target=torch.randn(b, 4), loss_fn=loss_fn, warmup=1, repeats=3, progress=False
        )
        for b in (2, 8)
    ]
    global_batch = 16
    result = plan(
        profiles,
        gpus=2,
        global_batch=global_batch,
        steps=100,
        P=[2],
        microbatch_sizes=[2, 4, 8],
        schedules=["GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"],
        exhaustive=True,
        progress=False,
    )
    grid = result.feasible[result.feasible["D"] == 1].reset_index(drop=True)
    batch = (torch.randn(global_batch, 4), torch.randn(global_batch, 4))
    measured, wall = [], []
    for _, row in grid.iterrows():
        runs = run(
            model,
            batch,
            loss_fn,
            result.partition_of(row),
            int(row["m"]),
            steps=6,
            progress=False,
            launch=Launch(timeout_s=120),
        )
        measured.append(runs.timeline.step_ms)  # first action to last: the pipeline step
        wall.append(runs.steady_step_ms)  # the whole step, with the runtime's own overhead
    grid = grid.assign(measured_ms=measured, wall_ms=wall, predicted_rank=range(1, len(grid) + 1))
    grid["measured_rank"] = grid["measured_ms"].rank(method="min").astype(int)
    # Spearman's rho as the Pearson correlation of the ranks: pandas' method="spearman" needs scipy, not a dependency
    rho = grid["predicted_rank"].rank().corr(grid["measured_ms"].rank())
    print(
        grid[
            [
                "m",
                "microbatch_size",
                "schedule",
                "v",
                "step_ms",
                "measured_ms",
                "wall_ms",
                "predicted_rank",
                "measured_rank",
            ]
        ]
        .round(1)
        .to_string(index=False)
    )
    best = grid["measured_ms"].min()
    print(
        f"Spearman rank correlation {rho:.2f}; the planner's pick measured {grid['measured_ms'].iloc[0]:.1f} ms, "
        f"{grid['measured_ms'].iloc[0] / best - 1:+.1%} from the best measured {best:.1f} ms"
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["3d-child"]:
        search_3d_child()
        sys.exit(0)
    if sys.argv[1:] == ["3d"]:
        search_3d()
        sys.exit(0)
    schedule_orders.compute_orders(2, 4, "Interleaved1F1B", 2)  # import torch's pipelining once, outside the timing
    print(f"(the 1,024-GPU search took {BEFORE_S:.0f} s when the memory model replayed every action)")
    for gpus in GOAL_S:
        large_search(gpus)
    search_3d()
    if sys.argv[1:] != ["search"]:
        cpu_agreement()
