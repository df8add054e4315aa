"""A zoo of models for the memory model: layer kinds, schedules, P, m and optimizers nobody tuned it to.

28 cases (:data:`CASES`): seven families (FFN blocks with GELU, with ReLU and with SwiGLU,
attention blocks, and the Hugging Face Llama, GPT-2 and BERT families from small configs), each
under four of the configurations in :data:`CONFIGS` (GPipe, 1F1B, Interleaved1F1B and
ZBVZeroBubble; P in {2, 3}; m in {2, 4, 8}; SGD and Adam). Every third case (index 2, 5, 8, ...)
is held out: kept out of every decision about the memory model and reported apart.

Each case is a real run (gloo, one CPU process per rank, three steps) of a model profiled at the
run's micro-batch size; the table has one row per rank: measured against predicted peak, and the
term whose prediction is furthest from its measure at the peak.

``python benchmarks/bench_memory.py --zoo`` prints it (``--zoo --held-out`` runs only the held-out
third, ``--zoo --in-sample`` only the rest).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

import pipeswift_lab as psl

#: Width, FFN width, tokens per sequence and sequences per micro-batch of the block families.
D, HIDDEN, TOKENS, MICRO = 128, 512, 64, 2
#: The Hugging Face families' vocabulary, width and sequence length.
VOCAB, HF_WIDTH, HF_SEQ = 256, 64, 32


class FFNBlock(nn.Module):
    """``x + down(act(up(x)))``: the plain transformer FFN block, with GELU or ReLU."""

    def __init__(self, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.up, self.down, self.act = nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


class SwiGLUBlock(nn.Module):
    """``x + down(silu(gate(x)) * up(x))`` (Shazeer, *GLU Variants Improve Transformer*, 2020), as in Llama."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(D, HIDDEN, bias=False), nn.Linear(D, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


class AttentionBlock(nn.Module):
    """Pre-LN causal self-attention alone: ``x + proj(sdpa(qkv(ln(x))))``, 4 heads."""

    def __init__(self, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln, self.qkv, self.proj = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(self.ln(x)).split(D, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(out.transpose(1, 2).reshape(B, T, D))


def _blocks(make: Callable[[], nn.Module], n: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[make() for _ in range(n)])


def _lm_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def _hf(family: str, n_layers: int) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HF_WIDTH,
            intermediate_size=4 * HF_WIDTH,
            num_hidden_layers=n_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=HF_SEQ,
        )
        return transformers.LlamaForCausalLM(config)
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=HF_WIDTH, n_layer=n_layers, n_head=4, n_positions=HF_SEQ,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HF_WIDTH, num_hidden_layers=n_layers, num_attention_heads=4,
        intermediate_size=4 * HF_WIDTH, max_position_embeddings=HF_SEQ,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family of the zoo: how to build it with ``n`` blocks, its batch of ``b`` samples, its loss."""

    name: str
    build: Callable[[int], nn.Module]
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    layers: str | None  # profile(layers=...): None for an nn.Sequential, "auto" for a Hugging Face model


def _float_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, TOKENS, D, generator=g), torch.randn(b, TOKENS, D, generator=g)


def _token_batch(b: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (b, HF_SEQ), generator=g), torch.randint(0, VOCAB, (b, HF_SEQ), generator=g)


FAMILIES = {
    f.name: f
    for f in (
        Family("ffn-gelu", lambda n: _blocks(lambda: FFNBlock(F.gelu), n), _float_batch, F.mse_loss, None),
        Family("ffn-relu", lambda n: _blocks(lambda: FFNBlock(F.relu), n), _float_batch, F.mse_loss, None),
        Family("swiglu", lambda n: _blocks(SwiGLUBlock, n), _float_batch, F.mse_loss, None),
        Family("attention", lambda n: _blocks(AttentionBlock, n), _float_batch, F.mse_loss, None),
        Family("hf-llama", lambda n: _hf("llama", n), _token_batch, _lm_loss, "auto"),
        Family("hf-gpt2", lambda n: _hf("gpt2", n), _token_batch, _lm_loss, "auto"),
        Family("hf-bert", lambda n: _hf("bert", n), _token_batch, _lm_loss, "auto"),
    )
}

#: (schedule, P, m, optimizer): every family runs four of them, rotating.
CONFIGS = (
    ("GPipe", 2, 4, "adam"),
    ("1F1B", 3, 4, "sgd"),
    ("Interleaved1F1B", 2, 8, "adam"),
    ("ZBVZeroBubble", 2, 2, "sgd"),
    ("1F1B", 2, 8, "adam"),
    ("GPipe", 3, 2, "sgd"),
    ("ZBVZeroBubble", 3, 4, "adam"),
    ("Interleaved1F1B", 3, 2, "sgd"),
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One run of the zoo."""

    index: int
    family: str
    schedule: str
    P: int
    m: int
    optimizer: str

    @property
    def held_out(self) -> bool:
        """Every third case is kept out of every decision about the memory model."""
        return self.index % 3 == 2

    @property
    def label(self) -> str:
        return f"{self.family} {self.schedule} P={self.P} m={self.m} {self.optimizer}"


CASES = tuple(
    Case(i, name, *CONFIGS[(4 * f + k) % len(CONFIGS)])
    for i, (f, name, k) in enumerate((f, name, k) for f, name in enumerate(FAMILIES) for k in range(4))
)


def _optimizer(name: str) -> Callable[[Any], torch.optim.Optimizer]:
    if name == "adam":
        return lambda params: torch.optim.Adam(params, lr=1e-3)
    return lambda params: torch.optim.SGD(params, lr=1e-2)


def run_case(case: Case) -> pd.DataFrame:
    """Profile, cut and run ``case``; return its ``RunResult.memory`` rows with the case's fields."""
    family = FAMILIES[case.family]
    v = 2 if case.schedule in ("Interleaved1F1B", "ZBVZeroBubble") else 1
    hf = family.layers == "auto"
    blocks = max(4, case.P * v) if not hf else 4  # a Hugging Face model adds its embeddings and head as units
    model = family.build(blocks)
    x, y = family.batch(MICRO * case.m)
    prof = psl.profile(
        model, x[:MICRO], target=y[:MICRO], loss_fn=family.loss, layers=family.layers, warmup=1, repeats=2,
        progress=False,
    )  # fmt: skip
    part = psl.partition(prof, case.P, v=v, schedule=case.schedule, m=case.m)
    result = psl.run(
        model, (x, y), family.loss, part, case.m, schedule=case.schedule, steps=3,
        optimizer=_optimizer(case.optimizer), progress=False, launch=psl.Launch(timeout_s=300),
    )  # fmt: skip
    memory = result.memory
    return memory.assign(case=case.label, index=case.index, held_out=case.held_out)


def zoo_table(cases: tuple[Case, ...] = CASES, progress: bool = True) -> pd.DataFrame:
    """Every case's ranks: ``case``, ``rank``, measured and predicted MiB, ``error``, ``term_off`` and the gap of
    that term (MiB), ``peak_at`` (predicted) and ``measured_peak_at``."""
    from tqdm.auto import tqdm

    rows = []
    for case in tqdm(cases, desc="memory zoo", disable=not progress):
        memory = run_case(case)
        for _, r in memory.iterrows():
            term = r.get("term_off")
            gap = r[f"{term}_bytes"] - r[f"measured_{term}_bytes"] if isinstance(term, str) else float("nan")
            rows.append(
                {
                    "index": case.index,
                    "case": case.label,
                    "held_out": case.held_out,
                    "rank": int(r["rank"]),
                    "measured_MiB": r["measured_peak_bytes"] / 2**20,
                    "predicted_MiB": r["predicted_peak_bytes"] / 2**20,
                    "error": r["error"],
                    "term_off": term,
                    "term_gap_MiB": gap / 2**20,
                    "peak_at": r.get("peak_at"),
                    "measured_peak_at": r.get("measured_peak_at"),
                }
            )
    return pd.DataFrame(rows)


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Median and max |error| per set (in-sample, held out, all), with the goal and the failure line."""
    out = []
    parts = (("in-sample", table[~table["held_out"]]), ("held out", table[table["held_out"]]), ("all", table))
    for name, part in parts:
        if part.empty:
            continue
        errors = part["error"].abs()
        out.append(
            {
                "set": name,
                "cases": part["index"].nunique(),
                "ranks": len(part),
                "median_abs_error": errors.median(),
                "max_abs_error": errors.max(),
                "goal_met": bool(errors.median() <= 0.05 and errors.max() <= 0.10),
                "under_failure_line": bool(errors.max() <= 0.15),
            }
        )
    return pd.DataFrame(out)


__all__ = ["CASES", "CONFIGS", "FAMILIES", "Case", "run_case", "summary", "zoo_table"]
