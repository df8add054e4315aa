"""Every tensor a stage sends is contiguous (pipeswift_lab.runner.stages.contiguous): in the traced graph before the
stages are built, and at the send itself for any stage."""

import copy

import pytest
import torch
import torch.nn.functional as F
from tiny_transformers import opt
from torch import nn

from pipeswift_lab import Launch
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.profiling.measure import profile
from pipeswift_lab.runner import run
from pipeswift_lab.runner.stages.contiguous import contiguous_boundaries
from pipeswift_lab.runner.stages.skips import stage_calls, stage_outputs
from pipeswift_lab.runner.stages.traced import trace

pytest.importorskip("transformers")


def boundary_layouts(pipe):
    """Whether each tensor a stage sends, and each one a stage receives from another stage, is contiguous."""
    calls = stage_calls(pipe.split_gm.graph)
    sent, received = [], []
    for k, call in enumerate(calls):
        sub = getattr(pipe.split_gm, str(call.target))
        if k < len(calls) - 1:
            sent += [v.meta["val"].is_contiguous() for v in stage_outputs(sub)[1]]
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        received += [
            ph.meta["val"].is_contiguous()
            for ph, arg in zip(placeholders, call.args)
            if isinstance(arg, torch.fx.Node) and arg.op != "placeholder"
        ]
    return sent, received


def test_the_traced_opt_sends_and_receives_only_contiguous_tensors():
    from torch.distributed.pipelining import SplitPoint, pipeline

    model, ids = opt(), torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    name = "model.decoder.layers.2"
    model.config.use_cache = False
    raw = pipeline(copy.deepcopy(model), (ids,), split_spec={name: SplitPoint.BEGINNING})
    sent, received = boundary_layouts(raw)
    assert not all(sent) and not all(received)  # torch's own trace sends the causal mask's expand (stride 0)
    assert contiguous_boundaries(raw) == sent.count(False)
    assert boundary_layouts(raw) == ([True] * len(sent), [True] * len(received))
    model.config.use_cache = True
    traced = trace(model, ids, (name,), torch.device("cpu"))
    assert boundary_layouts(traced) == ([True] * len(sent), [True] * len(received))


def assert_trains_under_zbv_like_one_process(model, x, y, m=4, steps=2):
    prof = profile(model, x[:2], target=y[:2], loss_fn=F.mse_loss, warmup=1, repeats=1, progress=False)
    part = partition(prof, P=2, v=2, schedule="ZBVZeroBubble")
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    result = run(
        model, (x, y), F.mse_loss, part, m, steps=steps, optimizer=sgd, progress=False, launch=Launch(timeout_s=240)
    )
    ref = copy.deepcopy(model)
    opt_ = sgd(list(ref.parameters()))
    for _ in range(steps):
        opt_.zero_grad()
        torch.stack([F.mse_loss(ref(a), b) for a, b in zip(x.chunk(m), y.chunk(m))]).mean().backward()
        opt_.step()
    got, want = result.state_dict(), ref.state_dict()
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6


class Mix(nn.Module):
    """Mixes along the sequence: the gradient it returns for its input is a transposed view."""

    def __init__(self, n=8):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n, n) / n**0.5)

    def forward(self, x):
        return torch.tanh(x.transpose(1, 2) @ self.w).transpose(1, 2)


@pytest.mark.processes
def test_a_stage_whose_input_gradient_is_a_transposed_view_trains_under_zbv_like_one_process():
    """ZBVZeroBubble computes the input gradient with ``torch.autograd.grad``, which returns it as autograd made it (a
    transposed view here): the send makes it contiguous."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Mix() for _ in range(4)])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, 6, generator=g), torch.randn(8, 8, 6, generator=g)
    assert_trains_under_zbv_like_one_process(model, x, y)


class ViewOut(nn.Module):
    """A block whose output is a view of the tensor it computes (``h.view(shape)``, as a reshape at a block's end)."""

    def __init__(self, n=6):
        super().__init__()
        self.linear = nn.Linear(n, n)

    def forward(self, x):
        h = torch.tanh(self.linear(x))
        return h.view(x.shape)


@pytest.mark.processes
def test_a_stage_whose_output_is_a_view_trains_under_zbv_like_one_process():
    """ZBVZeroBubble detaches every stage output in place, which a view refuses: the stage returns a copy instead."""
    torch.manual_seed(0)
    model = nn.Sequential(*[ViewOut() for _ in range(4)])
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 5, 6, generator=g), torch.randn(8, 5, 6, generator=g)
    assert_trains_under_zbv_like_one_process(model, x, y)
