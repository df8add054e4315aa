"""What changing P within a job costs on this machine, and shrink-and-continue against waiting for GPUs.

1. **Reconfiguration time** — the reference GPT (default size, Adam) resized P=2→4→2 on CPU
   ranks (``run(elastic=Elastic(resize_at=...))``): for each change the measured save, teardown, assembly of
   the new workers and restore (``RunResult.segments``), against a fresh start's assembly
   (launch to first step of a plain run, warm fork server; median of 3).
2. **Shrink and continue vs wait** — a job of layers that sleep a known time (so that 4 ranks
   on 2 cores behave like 4 devices) whose 4 GPUs become 2 after ``DROP_AT`` steps and 4 again
   ``GAP_S`` seconds later: measured JCT of resizing 4→2→4 against stopping at the drop,
   waiting ``GAP_S`` and resuming on 4, each next to its prediction from the measured step
   times and the cost models calibrated on these runs (``AssemblyModel``/``CheckpointModel``).

Run: ``python benchmarks/bench_elastic.py`` (about two minutes on 2 cores).
"""

from __future__ import annotations

import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from sleep_layers import Sleep  # the tests' Linear that sleeps a known time in forward and backward

STEPS, DROP_AT, GAP_S = 80, 10, 6.0


def _batch(step):
    return torch.randn(16, 16), torch.randn(16, 16)


def reconfiguration() -> pd.DataFrame:
    import pipeswift_lab as psl
    from pipeswift_lab.models import reference

    setup = reference("gpt")
    n = len(setup.model)
    prof = psl.Profile.synthetic(fwd_ms=[1.0] * n, bwd_ms=[2.0] * n)
    part = psl.partition(prof, 2, m=4)
    adam = lambda params: torch.optim.Adam(params, lr=1e-3)  # noqa: E731
    common = dict(loss_fn=setup.loss_fn, m=4, optimizer=adam, progress=False)  # 1F1B needs m >= P = 4
    batch = (setup.inputs, setup.targets)
    psl.run(setup.model, batch, partition=part, steps=2, **common)  # warm the fork server
    fresh = [psl.run(setup.model, batch, partition=part, steps=3, **common).jct.assembly_s for _ in range(3)]
    resized = psl.run(
        setup.model, batch, partition=part, steps=9, elastic=psl.Elastic(resize_at={3: 4, 6: 2}, profile=prof), **common
    )
    seg = resized.segments
    rows = []
    for i in range(1, len(seg)):
        before, after = seg.iloc[i - 1], seg.iloc[i]
        rows.append(
            {
                "change": f"P={before.P}->{after.P}",
                "save_s": before.save_s,
                "teardown_s": before.teardown_s,
                "assembly_s": after.assembly_s,
                "restore_s": after.restore_s,
                "reconfiguration_s": before.save_s + before.teardown_s + after.assembly_s + after.restore_s,
                "fresh_start_assembly_s": statistics.median(fresh),
            }
        )
    return pd.DataFrame(rows)


def shrink_vs_wait() -> pd.DataFrame:
    import pipeswift_lab as psl
    from pipeswift_lab import JCT
    from pipeswift_lab.core.costs import AssemblyModel, CheckpointModel

    def stack():
        torch.manual_seed(0)
        return nn.Sequential(*[Sleep(0.003, 0.003, width=16) for _ in range(8)])

    m = 4
    prof = psl.Profile.synthetic(fwd_ms=[3.0] * 8, bwd_ms=[3.0] * 8)
    four, two = psl.partition(prof, 4, m=m), psl.partition(prof, 2, m=m)
    job = dict(loss_fn=nn.functional.mse_loss, m=m, progress=False)
    psl.run(stack(), _batch, partition=two, steps=2, **job)
    step4 = psl.run(stack(), _batch, partition=four, steps=8, **job).steady_step_ms / 1e3
    step2 = psl.run(stack(), _batch, partition=two, steps=8, **job).steady_step_ms / 1e3
    back_at = DROP_AT + math.ceil(GAP_S / step2)
    root = Path(tempfile.mkdtemp(prefix="pipeswift_bench_elastic_"))
    try:
        shrink = psl.run(
            stack(),
            _batch,
            partition=four,
            steps=STEPS,
            elastic=psl.Elastic(resize_at={DROP_AT: 2, back_at: 4}, profile=prof),
            **job,
        )
        before = psl.run(stack(), _batch, partition=four, steps=DROP_AT, checkpoint=root, **job)
        time.sleep(GAP_S)
        after = psl.run(stack(), _batch, partition=four, steps=STEPS, resume_from=root, checkpoint=root, **job)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    wait = JCT(
        queue_s=GAP_S,
        assembly_s=before.jct.assembly_s + after.jct.assembly_s + after.restore_s,
        training_s=before.jct.training_s + after.jct.training_s,
        cleanup_s=before.jct.cleanup_s + after.jct.cleanup_s,
        preemption_loss_s=before.jct.preemption_loss_s + after.jct.preemption_loss_s - after.restore_s,
    )
    ckpt = CheckpointModel.calibrate([shrink, after])
    asm = AssemblyModel.calibrate([shrink, before, after])
    shard = shrink.checkpoints["largest_rank_state_bytes"].max()

    def move(P):
        return ckpt.save_s(shard) + asm.seconds(P, 1) + ckpt.restore_s(shard)

    predicted_shrink = (
        asm.seconds(4, 1)
        + DROP_AT * step4
        + move(2)
        + (back_at - DROP_AT) * step2
        + move(4)
        + (STEPS - back_at) * step4
        + ckpt.teardown_s
    )
    predicted_wait = (
        asm.seconds(4, 1) + DROP_AT * step4 + GAP_S + move(4) + (STEPS - DROP_AT) * step4 + 2 * ckpt.teardown_s
    )
    return pd.DataFrame(
        [
            {
                "strategy": "shrink 4->2->4 and continue",
                "predicted_s": predicted_shrink,
                "measured_s": shrink.jct.total_s,
            },
            {
                "strategy": f"stop, wait {GAP_S:g} s, resume on 4",
                "predicted_s": predicted_wait,
                "measured_s": wait.total_s,
            },
        ]
    ).assign(
        rel_error=lambda d: d["predicted_s"] / d["measured_s"] - 1,
        step4_ms=step4 * 1e3,
        step2_ms=step2 * 1e3,
        back_at_step=back_at,
    )


def main() -> None:
    pd.set_option("display.width", 160)
    pd.set_option("display.float_format", lambda x: f"{x:.4g}")
    print("Reconfiguration of the reference GPT on CPU ranks (seconds):")
    print(reconfiguration().to_string(index=False))
    print(f"\nA job of {STEPS} steps on 4 ranks; 2 of them leave after step {DROP_AT} and return {GAP_S:g} s later:")
    print(shrink_vs_wait().to_string(index=False))


if __name__ == "__main__":
    main()
