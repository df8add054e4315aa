"""The precision a run computes in (pipeswift_lab.runner.stages.precision): bf16 autocast against one process.

The reference is one process that runs each micro-batch's forward and loss under its own autocast region, as the
pipeline's stages do, and backwards ``loss / n`` after each: the same bf16 operators on the same values, so the
pipeline matches it up to the order the fp32 gradients are scaled and summed in, a few fp32 ulps per step (1e-6 on
the parameters and the losses after four Adam steps; measured 6e-8 and 1.2e-7). One autocast region around all the
micro-batches would not be a fair reference: autocast caches each weight's bf16 copy across the region, and the
gradients of that one copy then add up in bf16 (it moved the parameters by 4e-2 here).
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.profiling.measure import profile
from pipeswift_lab.runner import make_spec, run

M, STEPS = 4, 4


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.ln, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


def setup(n=8):
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(4)])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 5, 16, generator=g), torch.randn(n, 5, 16, generator=g)
    prof = profile(model, x[:2], target=y[:2], loss_fn=F.mse_loss, warmup=0, repeats=1, progress=False)
    return model, x, y, prof


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def one_process_under_autocast(model, x, y, D=1):
    ref = copy.deepcopy(model)
    opt = adam(list(ref.parameters()))
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        chunks = [(a, b) for hx, hy in zip(x.chunk(D), y.chunk(D)) for a, b in zip(hx.chunk(M), hy.chunk(M))]
        step = []
        for a, b in chunks:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse_loss(ref(a), b)
            (loss / len(chunks)).backward()
            step.append(loss.item())
        opt.step()
        losses.append(sum(step) / len(step))
    return ref, losses


def assert_like(result, ref, losses):
    got, want = result.state_dict(), ref.state_dict()
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6
    assert list(result.losses) == pytest.approx(losses, rel=1e-6)
    assert all(t.dtype == torch.float32 for t in got.values())  # fp32 weights: autocast casts them on the way


@pytest.mark.processes
@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_bf16_mixed_trains_like_one_process_under_autocast(schedule):
    model, x, y, prof = setup()
    v = 2 if schedule == "ZBVZeroBubble" else 1
    result = run(model, (x, y), F.mse_loss, partition(prof, 2, v=v, schedule=schedule), M, steps=STEPS,
                 optimizer=adam, progress=False, precision="bf16-mixed")  # fmt: skip
    assert result.meta["precision"] == "bf16-mixed"
    assert_like(result, *one_process_under_autocast(model, x, y))


@pytest.mark.processes
def test_zero1_shards_the_optimizer_over_two_replicas_and_trains_the_same():
    model, x, y, prof = setup(16)
    result = run(model, (x, y), F.mse_loss, partition(prof, 2), M, steps=STEPS, optimizer=adam, progress=False,
                 precision="bf16-mixed-zero1", D=2)  # fmt: skip
    assert_like(result, *one_process_under_autocast(model, x, y, D=2))
    memory = result.memory.set_index(["replica", "rank"])
    # each replica keeps half of each stage's Adam state (ZeroRedundancyOptimizer shards it by parameter)
    assert (memory["state_optimizer_bytes"] < 0.75 * 2 * memory["state_param_bytes"]).all()


def test_a_bad_precision_and_zero1_with_checkpoints_are_refused(tmp_path):
    model, x, y, prof = setup()
    with pytest.raises(
        ValueError, match=r"precision='fp16' is not one of \['fp32', 'bf16-mixed', 'bf16-mixed-zero1'\]"
    ):
        make_spec(model, (x, y), F.mse_loss, partition(prof, 2), M, precision="fp16")
    with pytest.raises(ValueError, match="bf16-mixed-zero1' cannot be combined with checkpoint_dir"):
        run(model, (x, y), F.mse_loss, partition(prof, 2), M, steps=2, precision="bf16-mixed-zero1",
            checkpoint=tmp_path, progress=False)  # fmt: skip
