"""Exercise every CUDA path of the toolkit on this machine's GPUs; print a table; exit non-zero on a failure.

    python benchmarks/gpu_check.py            # under 5 minutes on one GPU

Paths: the profiler's CUDA events and peak memory, ``torch.cuda.max_memory_allocated`` around a
step, a real run on ``cuda`` devices with NCCL (P=2 with two GPUs, P=1 with one), and CUDA RNG
state in checkpoints (a run with dropout resumed from its middle checkpoint must end bitwise
equal to the uninterrupted run). Without a CUDA device it says so and exits 0: nothing to check.
Later work adds its GPU paths here.
"""

from __future__ import annotations

import sys
import tempfile
import time
import traceback
from pathlib import Path

import pandas as pd
import torch
from torch import nn


def _check(rows: list, path: str, fn) -> None:
    """Run one check; append ``(path, result, figure)``: ``ok`` with its figure, or ``FAILED`` with the error."""
    t0 = time.perf_counter()
    try:
        figure = fn()
        rows.append({"path": path, "result": "ok", "figure": figure, "seconds": round(time.perf_counter() - t0, 1)})
    except Exception as exc:
        traceback.print_exc()
        rows.append(
            {
                "path": path,
                "result": "FAILED",
                "figure": f"{type(exc).__name__}: {exc}"[:160],
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )


def _setup():
    import pipeswift_lab as psl

    return psl.models.reference("mlp", batch_size=16, seed=0)


def profiler_cuda_events() -> str:
    import pipeswift_lab as psl

    setup = _setup()
    model = setup.model.cuda()
    prof = psl.profile(
        model, setup.inputs.cuda(), target=setup.targets.cuda(), loss_fn=setup.loss_fn, warmup=2, repeats=5
    )
    df = prof.df
    assert (df["fwd_ms"] > 0).all() and (df["bwd_ms"] > 0).all(), "a layer timed at 0 ms"
    assert "peak_bytes" in df and (df["peak_bytes"] > 0).any(), "no CUDA peak memory reported"
    peak_mib = df["peak_bytes"].max() / 2**20
    return f"fwd {df['fwd_ms'].sum():.3f} ms, bwd {df['bwd_ms'].sum():.3f} ms, peak {peak_mib:.1f} MiB"


def max_memory_allocated() -> str:
    setup = _setup()
    model = setup.model.cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    setup.loss_fn(model(setup.inputs.cuda()), setup.targets.cuda()).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    assert peak > before, "max_memory_allocated did not rise over a forward and backward"
    return f"{(peak - before) / 2**20:.2f} MiB over {before / 2**20:.2f} MiB resident"


def _ranks() -> int:
    return 2 if torch.cuda.device_count() >= 2 else 1


def nccl_run() -> str:
    import pipeswift_lab as psl

    P = _ranks()
    setup = _setup()
    prof = psl.Profile.synthetic(fwd_ms=[1.0] * len(setup.model), bwd_ms=[2.0] * len(setup.model))
    part = psl.partition(prof, P)
    batch = (setup.inputs, setup.targets)
    gpu = psl.run(
        setup.model,
        batch,
        setup.loss_fn,
        part,
        4,
        steps=3,
        launch=psl.Launch(devices="cuda", timeout_s=240),
        progress=False,
    )
    cpu = psl.run(
        setup.model,
        batch,
        setup.loss_fn,
        part,
        4,
        steps=3,
        launch=psl.Launch(devices="cpu", timeout_s=240),
        progress=False,
    )
    worst = max(
        ((gpu.state_dict()[k] - cpu.state_dict()[k]).norm() / cpu.state_dict()[k].norm().clamp_min(1e-12)).item()
        for k in cpu.state_dict()
    )
    assert worst < 1e-3, f"GPU and CPU runs differ by {worst:.2e} (relative)"
    return f"P={P}, steady step {gpu.steady_step_ms:.2f} ms, vs CPU run max rel diff {worst:.1e}"


def cuda_rng_in_checkpoints() -> str:
    import pipeswift_lab as psl

    P = _ranks()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Dropout(0.3), nn.Linear(64, 64), nn.Dropout(0.3), nn.Linear(64, 8))
    batch = (torch.randn(16, 32), torch.randn(16, 8))
    part = psl.partition(psl.Profile.synthetic(fwd_ms=[1.0] * 5, bwd_ms=[2.0] * 5), P)
    with tempfile.TemporaryDirectory() as root:
        whole = psl.run(
            model,
            batch,
            nn.functional.mse_loss,
            part,
            4,
            steps=4,
            checkpoint=psl.Checkpointing(Path(root) / "a", every=2, keep=3),
            launch=psl.Launch(devices="cuda", timeout_s=240),
            progress=False,
        )
        middle = whole.checkpoints.query("step == 2")["path"].iloc[0]
        resumed = psl.run(
            model,
            batch,
            nn.functional.mse_loss,
            part,
            4,
            steps=4,
            launch=psl.Launch(devices="cuda", timeout_s=240),
            progress=False,
            resume_from=middle,
        )
    same = all(torch.equal(whole.state_dict()[k], resumed.state_dict()[k]) for k in whole.state_dict())
    assert same, (
        "a run resumed from step 2 does not end bitwise equal to the uninterrupted run (CUDA RNG state not restored?)"
    )
    return f"P={P}, dropout run resumed at step 2 of 4: bitwise equal"


def meta_model_on_cuda() -> str:
    """A meta model profiled unit by unit on the GPU under ``torch.cuda.set_per_process_memory_fraction``, then run
    with each rank making its stage on ``cuda:{local_rank}`` from a safetensors checkpoint: it must train as the same
    weights loaded eagerly on the CPU."""
    from safetensors.torch import save_file

    import pipeswift_lab as psl

    P = _ranks()

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.Tanh()) for _ in range(8)])

    with torch.device("meta"):
        meta = build()
    x, y = torch.randn(16, 1024), torch.randn(16, 1024)
    cap = 64 * 2**20  # the 8 layers' weights alone are 32 MiB, with gradients 64 MiB: one layer at a time fits
    prof = psl.profile(meta, x[:4], target=y[:4], loss_fn=nn.functional.mse_loss, device="cuda",
                       unit_by_unit=psl.UnitByUnit(memory_cap=cap), warmup=1, repeats=3, progress=False)  # fmt: skip
    assert prof.meta["unit_by_unit"] and (prof.df["fwd_ms"] > 0).all()
    part = psl.partition(prof, P)
    with tempfile.TemporaryDirectory() as tmp:
        save_file(build().state_dict(), str(Path(tmp) / "model.safetensors"))
        kwargs = dict(steps=3, progress=False, launch=psl.Launch(timeout_s=240), weights=tmp)
        gpu = psl.run(meta, (x, y), nn.functional.mse_loss, part, 4, launch=psl.Launch(devices="cuda"), **kwargs)
        cpu = psl.run(meta, (x, y), nn.functional.mse_loss, part, 4, launch=psl.Launch(devices="cpu"), **kwargs)
    worst = max(
        ((gpu.state_dict()[k] - cpu.state_dict()[k]).norm() / cpu.state_dict()[k].norm().clamp_min(1e-12)).item()
        for k in cpu.state_dict()
    )
    assert worst < 1e-3, f"the meta model's GPU and CPU runs differ by {worst:.2e} (relative)"
    peak = prof.meta["live_peak_bytes"] / 2**20
    return (
        f"profile peak {peak:.0f} MiB under a {cap / 2**20:.0f} MiB cap; P={P} from safetensors, rel diff {worst:.1e}"
    )


CHECKS = (
    ("profiler: CUDA events + peak memory", profiler_cuda_events),
    ("torch.cuda.max_memory_allocated", max_memory_allocated),
    ("run on cuda devices with NCCL", nccl_run),
    ("CUDA RNG state in checkpoints", cuda_rng_in_checkpoints),
    ("meta model: unit-by-unit profile under a CUDA cap, stages made on cuda:{local_rank}", meta_model_on_cuda),
)


def main() -> int:
    """Run every check; print the table; return the exit status (1 if any check failed)."""
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device on this machine (torch.cuda.is_available() is False): nothing to check.")
        return 0
    print(f"gpu_check: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    rows: list = []
    for path, fn in CHECKS:
        _check(rows, path, fn)
    table = pd.DataFrame(rows)
    with pd.option_context("display.max_colwidth", 120, "display.width", 200):
        print(table.to_string(index=False))
    return int((table["result"] != "ok").any())


if __name__ == "__main__":
    sys.exit(main())
