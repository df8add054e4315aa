"""Measure and save the per-layer profiles that ``data/profiles/`` holds (read by ``notebooks/00_start_here``).

The model is the small reference GPT of the tutorials (``models.reference("gpt", batch_size=16, vocab_size=4096,
seq_len=32, d_model=64, n_layers=4, n_heads=4)``), profiled at micro-batch sizes 1, 2, 4 and 8 sequences with the
thread count one of two ranks gets. Each CSV's first line records the machine (``cores``, ``threads``,
``torch_version``, platform).

    python benchmarks/save_profiles.py [--out data/profiles]
"""

from __future__ import annotations

import argparse
import os
import platform
from pathlib import Path

import torch

import pipeswift_lab as psl

MICROBATCH_SIZES = (1, 2, 4, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "data" / "profiles"))
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // 2))
    setup = psl.models.reference("gpt", batch_size=16, vocab_size=4096, seq_len=32, d_model=64, n_layers=4, n_heads=4)
    for b in MICROBATCH_SIZES:
        prof = psl.profile(
            setup.model,
            setup.inputs[:b],
            target=setup.targets[:b],
            loss_fn=setup.loss_fn,
            warmup=5,
            repeats=30,
            progress=False,
        )
        prof.meta.update(
            model="reference gpt (vocab 4096, seq 32, d_model 64, 4 layers, 4 heads)",
            microbatch_size=b,
            cores=cores,
            platform=platform.platform(),
            processor=platform.processor() or platform.machine(),
        )
        path = out / f"gpt_small_cpu_b{b}.csv"
        prof.to_csv(path)
        print(f"b={b}: {prof.total_ms:.2f} ms per micro-batch (cv {prof.cv:.1%}) -> {path}")


if __name__ == "__main__":
    main()
