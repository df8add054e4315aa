"""Training a family of the model zoo in a PP x FSDP x TP layout, eager or on meta from its checkpoint: what
test_layouts_hf.py checks and benchmarks/bench_layouts_hf.py tabulates over the whole matrix."""

from pathlib import Path

import torch
from model_zoo import build
from test_layouts import LAYOUTS, sgd
from tiny_transformers import M, lm_loss, tokens

import pipeswift_lab as psl


def train_in_layout(
    family: str, layout: str, meta: bool, folder: Path
) -> tuple[torch.nn.Module, psl.RunResult, torch.Tensor, torch.Tensor]:
    """Profile ``family`` (untied), partition it and train it two SGD steps in ``layout`` (a key of ``LAYOUTS``):
    the caller's model, or with ``meta`` one built on the meta device that reads the checkpoint saved in ``folder``.
    Returns the eager model (as it was before training), the run's result and the batch ``(x, y)``."""
    P, fsdp, tp = LAYOUTS[layout]
    model = build(family)
    model.config.tie_word_embeddings = False
    x, y = tokens()
    part = psl.partition(psl.profile(model, x[: 8 // (M * fsdp)], layers="auto", progress=False), P=P)
    kw = dict(fsdp=fsdp, tp=tp, steps=2, optimizer=sgd, progress=False)
    if meta:
        model.save_pretrained(folder / "hf")
        result = psl.run(build(family, "meta"), (x, y), lm_loss, part, M, weights=folder / "hf", **kw)
    else:
        result = psl.run(model, (x, y), lm_loss, part, M, **kw)
    return model, result, x, y
