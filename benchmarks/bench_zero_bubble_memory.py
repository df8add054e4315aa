"""A zero-bubble schedule's peak memory on Hugging Face families: the prediction against the measure.

torch's input-gradient pass (``I``) keeps the stage's graph for the weight pass (``W``), so it frees nothing as it
goes and holds every later layer's kept gradients beside each layer's pass
(:mod:`pipeswift_lab.partitioning.input_pass`). A last stage of several decoder layers shows it most. Real runs (gloo,
one CPU process per rank, Adam) of a Mixtral and a Qwen2 (tied head) built from small configs (4 layers, width 64,
vocabulary 256, sequences of 64 tokens), ZBVZeroBubble at P = 2 (four stages), m = 4 micro-batches of 4 sequences;
each on the balanced split and on one with every decoder layer but the first three on the last stage, without
recomputation and with selective recomputation. Per rank: ``RunResult.memory``'s predicted and measured peak, the
relative error, and where each came.

Run: ``python benchmarks/bench_zero_bubble_memory.py`` (about two minutes on 2 cores). Figures are reported, never
asserted.
"""

from __future__ import annotations

import pandas as pd
import torch

import pipeswift_lab as psl
from pipeswift_lab.partitioning.stages import Partition

MICRO, M, SEQ, VOCAB = 4, 4, 64, 256


def lm_loss(output: object, targets: torch.Tensor) -> torch.Tensor:
    logits = getattr(output, "logits", output)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def families() -> dict[str, object]:
    import transformers

    shape = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=2 * SEQ)  # fmt: skip
    return {
        "Mixtral": transformers.MixtralConfig(
            intermediate_size=128, num_local_experts=4, num_experts_per_tok=2, **shape
        ),
        "Qwen2 (tied)": transformers.Qwen2Config(intermediate_size=176, tie_word_embeddings=True, **shape),
    }


def main() -> None:
    import transformers

    torch.set_num_threads(1)
    rows = []
    for family, config in families().items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, VOCAB, (MICRO * M, SEQ), generator=g)
        y = torch.randint(0, VOCAB, (MICRO * M, SEQ), generator=g)
        prof = psl.profile(model, x[:MICRO], target=y[:MICRO], loss_fn=lm_loss, layers="auto", progress=False,
                           recompute=True)  # fmt: skip
        n = len(prof.df)
        splits = {
            "balanced": psl.partition(prof, 2, v=2, schedule="ZBVZeroBubble", m=M),
            "last stage heavy": Partition.from_bounds(
                prof, [(0, 1), (1, 2), (2, 3), (3, n)], v=2, schedule="ZBVZeroBubble", m=M
            ),
        }
        for split, part in splits.items():
            for recompute in (None, "selective"):
                result = psl.run(model, (x, y), lm_loss, part, M, steps=2, progress=False, recompute=recompute,
                                 optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))  # fmt: skip
                for _, r in result.memory.iterrows():
                    rows.append({"family": family, "split": split, "recompute": recompute or "none", "rank": r["rank"],
                                 "measured_MiB": r["measured_peak_bytes"] / 2**20,
                                 "predicted_MiB": r["predicted_peak_bytes"] / 2**20, "error": r["error"],
                                 "measured_at": r["measured_peak_at"], "predicted_at": r["peak_at"]})  # fmt: skip
    table = pd.DataFrame(rows)
    with pd.option_context("display.width", 200, "display.precision", 3):
        print(table.to_string(index=False))
    errors = table["error"].abs()
    print(f"\n{len(table)} ranks: largest |error| {errors.max():.1%}, median {errors.median():.1%}")
    for mode, part in table.groupby("recompute"):
        print(f"  recompute={mode}: largest |error| {part['error'].abs().max():.1%}")


if __name__ == "__main__":
    main()
