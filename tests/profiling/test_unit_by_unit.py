"""Profiling one unit at a time: a meta model is made unit by unit, each timed on the previous unit's real output and
freed, so the process never holds the model. Timing is checked on layers that sleep a known time; memory with the
toolkit's own live-byte counter, under a cap the whole model exceeds."""

import pytest
import torch
import torch.nn.functional as F
from sleep_layers import Sleep
from tiny_transformers import SMALL, VOCAB
from torch import nn

from pipeswift_lab import UnitByUnit
from pipeswift_lab.core.live_bytes import LiveTensorBytes, live_tensors
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.profiling.measure import profile

SLEEPS_MS = [(6.0, 10.0), (12.0, 4.0), (3.0, 3.0)]  # a forward-heavy, a backward-heavy and an even unit
WIDTH = 512
N_WIDE = 5  # layers of wide(): one more than the cap below holds


def sleepy():
    torch.manual_seed(0)
    return nn.Sequential(*[Sleep(f / 1e3, b / 1e3) for f, b in SLEEPS_MS])


def wide(n=N_WIDE):
    """Five 1 MiB layers: 5 MiB of weights, 10 MiB with their gradients."""
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(n)])


def on_meta(build):
    with torch.device("meta"):
        return build()


def test_unit_by_unit_times_each_unit_of_the_whole_model_at_least_its_sleeps():
    """Both ways of profiling time every unit at least its sleeps (a sleep never ends early: bounds a loaded machine
    keeps). How close the two readings come is a timing against a timing: ``benchmarks/bench_profile.py
    --unit-by-unit`` prints it."""
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    kwargs = dict(target=y, loss_fn=F.mse_loss, warmup=1, repeats=2, progress=False)
    whole = profile(sleepy(), x, **kwargs)
    units = profile(on_meta(sleepy), x, **kwargs)
    assert units.meta["unit_by_unit"] and units.meta["timed_units"] == len(SLEEPS_MS)
    assert not whole.meta.get("unit_by_unit") and list(units.df["name"]) == list(whole.df["name"])
    for (fwd, bwd), (_, a), (_, b) in zip(SLEEPS_MS, whole.df.iterrows(), units.df.iterrows()):
        assert b["fwd_ms"] >= fwd and b["bwd_ms"] >= bwd and a["fwd_ms"] >= fwd and a["bwd_ms"] >= bwd
    sleeps = sum(f + b for f, b in SLEEPS_MS)
    assert units.step_ms >= sleeps and whole.step_ms >= sleeps and units.total_ms >= sleeps


def test_the_peak_is_the_largest_unit_under_a_cap_the_whole_model_exceeds():
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    model = on_meta(wide)
    weights_bytes = sum(p.numel() * 4 for p in model.parameters())
    unit_bytes = weights_bytes // N_WIDE
    cap = 4 * unit_bytes  # a unit's weights, gradients and activations fit; the model's weights alone do not
    assert 2 * weights_bytes > weights_bytes > cap
    counter = LiveTensorBytes()
    counter.adopt(live_tensors())
    before = counter.live_bytes
    with counter:
        prof = profile(
            model,
            x,
            target=y,
            loss_fn=F.mse_loss,
            warmup=0,
            repeats=1,
            progress=False,
            unit_by_unit=UnitByUnit(memory_cap=cap),
        )
    assert counter.peak_bytes - before <= cap
    assert prof.meta["live_peak_bytes"] - before <= cap
    assert all(t.is_meta for t in model.state_dict().values())  # the caller's model was not made
    assert list(prof.df["param_bytes"]) == [unit_bytes] * N_WIDE
    with pytest.raises(MemoryError, match=r"unit '0' held .* MiB of tensors at its peak, above memory_cap=0.5 MiB"):
        profile(
            model,
            x,
            target=y,
            loss_fn=F.mse_loss,
            warmup=0,
            repeats=1,
            progress=False,
            unit_by_unit=UnitByUnit(memory_cap=2**19),
        )


def test_repeated_once_times_the_first_block_of_each_class_and_gives_its_rows_to_the_others():
    def lm_loss(out, y):
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())

    import transformers

    blocks = 2  # one timed, one given its rows
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SMALL, "num_hidden_layers": blocks}))
    ids, target = torch.randint(0, VOCAB, (2, 16)), torch.randint(0, VOCAB, (2, 16))
    prof = profile(model, ids, target=target, loss_fn=lm_loss, layers="auto", warmup=0, repeats=2, progress=False,
                   unit_by_unit=UnitByUnit(repeated="once"))  # fmt: skip
    names = list(prof.df["name"])
    assert names == ["model.embed_tokens", *(f"model.layers.{i}" for i in range(blocks)), "model.norm", "lm_head"]
    assert prof.meta["timed_units"] == 4  # the embedding, the first block, the norm, the head
    rows = prof.df.iloc[1 : 1 + blocks]
    for column in ("fwd_ms", "bwd_ms", "activation_bytes", "output_bytes", "param_bytes"):
        assert rows[column].nunique() == 1, column
    assert prof.df["fwd_ms"].gt(0).all() and prof.df["activation_bytes"].gt(0).all()
    part = partition(prof, P=2, schedule="1F1B")  # the profile partitions as any other (where is a matter of time)
    assert [name for stage in part.layer_names for name in stage] == names


def test_options_of_unit_by_unit_profiling_are_checked():
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    model = on_meta(wide)
    with pytest.raises(ValueError, match=r"repeated='twice' is not one of \['all', 'once'\]"):
        profile(model, x, target=y, loss_fn=F.mse_loss, unit_by_unit=UnitByUnit(repeated="twice"), progress=False)
    with pytest.raises(ValueError, match="leave unit_by_unit=None"):
        profile(model, x, target=y, loss_fn=F.mse_loss, unit_by_unit=False, progress=False)
    with pytest.raises(ValueError, match="device='meta' is not supported"):
        profile(model, x, target=y, loss_fn=F.mse_loss, device="meta", progress=False)
    with pytest.raises(TypeError, match=r"memory_cap= is now unit_by_unit=psl.UnitByUnit\(memory_cap=...\)"):
        profile(wide(), x, target=y, loss_fn=F.mse_loss, memory_cap=2**20, progress=False)
    with pytest.raises(TypeError, match="unit_by_unit must be None, True, False or a pipeswift_lab.UnitByUnit"):
        profile(wide(), x, target=y, loss_fn=F.mse_loss, unit_by_unit="yes", progress=False)
