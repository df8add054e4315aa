"""A zero-bubble schedule's weight pass recomputes a checkpointed layer once (core/recompute.py), with torch's own
backward functions and its own ZBVZeroBubble schedule on one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipeswift_lab.core.recompute import apply_recompute, recompute_weight_pass_once


class CountingBlock(nn.Module):
    """A transformer-shaped block of six parameterized operators (two norms, four linears) that counts its
    forwards."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(3 * d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = x + self.proj(torch.tanh(self.qkv(self.ln1(x))))
        return x + self.down(torch.relu(self.up(self.ln2(x))))


def test_torch_weight_pass_recomputes_once_per_parameter_group_and_once_in_one_graph_exec_group():
    """The mechanism recompute_weight_pass_once answers: torch's stage_backward_weight runs one autograd.grad per
    parameter group, each recomputing a non-reentrant checkpoint; under one GraphExecGroup they share one."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from torch.utils.checkpoint import GraphExecGroup, checkpoint

    torch.manual_seed(0)
    block = CountingBlock()
    counts = []
    for grouped in (False, True):
        x = torch.randn(4, 8, requires_grad=True)
        block.calls = 0
        y = checkpoint(block, x, use_reentrant=False)
        _, groups = stage_backward_input([y], [torch.ones_like(y)], [x], block.parameters())
        before_weight = block.calls
        if grouped:
            with GraphExecGroup():
                stage_backward_weight(block.parameters(), groups)
        else:
            stage_backward_weight(block.parameters(), groups)
        counts.append((len(groups), before_weight, block.calls - before_weight))
    assert counts == [(6, 2, 6), (6, 2, 1)]  # (groups, forward + I's recomputation, W's recomputations)


@pytest.fixture
def one_process_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("once", [False, True], ids=["as torch runs it", "recompute_weight_pass_once"])
def test_a_zbv_step_recomputes_each_layer_once_per_pass(one_process_group, once):
    """Both stages of a V on one rank under torch's ScheduleZBVZeroBubble, every block recomputed fully: per
    micro-batch the second stage's block runs its forward, its recomputation in I and one in W; the first stage has
    no I (its W runs the whole backward). The gradients are those of the step without recomputation."""
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

    torch.manual_seed(0)
    blocks = [CountingBlock(), CountingBlock()]
    reference = [CountingBlock(), CountingBlock()]
    for plain, block in zip(reference, blocks):
        plain.load_state_dict(block.state_dict())
    x, target = torch.randn(8, 8), torch.randn(8, 8)
    m = 4
    for block in blocks:
        apply_recompute(nn.ModuleDict({"block": block}), ["block"], "full", split_backward=True)
    stages = [PipelineStage(block, i, 2, torch.device("cpu")) for i, block in enumerate(blocks)]
    if once:
        stages = [recompute_weight_pass_once(stage) for stage in stages]
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=m, loss_fn=nn.functional.mse_loss)
    schedule.step(x, target=target)  # the first step also infers the stages' shapes
    for stage in stages:
        for p in stage.submod.parameters():
            p.grad = None
    before = [b.calls for b in blocks]
    schedule.step(x, target=target)
    second_weight_pass = 1 if once else 6
    assert [b.calls - n for b, n in zip(blocks, before)] == [m * 2, m * (2 + second_weight_pass)]

    chunks = [nn.functional.mse_loss(reference[1](reference[0](xc)), tc) for xc, tc in zip(x.chunk(m), target.chunk(m))]
    torch.stack(chunks).mean().backward()  # torch scales the gradients by 1 / m
    for plain, block in zip(reference, blocks):
        for (name, p), q in zip(plain.named_parameters(), block.parameters()):
            assert torch.allclose(p.grad, q.grad, atol=1e-6), name
