"""Layers that sleep a known time in forward and backward: deterministic timing for the profiler tests."""

import time

import torch
from torch import nn


class SleepBackward(torch.autograd.Function):
    """Identity whose backward sleeps ``seconds``."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class SleepProduct(torch.autograd.Function):
    """``x * weight``, sleeping ``fwd_s`` in forward and ``bwd_s`` in backward (a layer with a known time and a
    gradient)."""

    @staticmethod
    def forward(ctx, x, weight, fwd_s, bwd_s):
        time.sleep(fwd_s)
        ctx.save_for_backward(x, weight)
        ctx.bwd_s = bwd_s
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.bwd_s)
        x, weight = ctx.saved_tensors
        return grad * weight, (grad * x).sum().reshape(weight.shape), None, None


class _SleepOneGrad(torch.autograd.Function):
    """``x * weight`` whose backward gives one gradient only (``wrt`` is ``"input"`` or ``"weight"``), sleeping
    ``seconds``."""

    @staticmethod
    def forward(ctx, x, weight, seconds, wrt):
        ctx.save_for_backward(weight if wrt == "input" else x)
        ctx.seconds, ctx.wrt = seconds, wrt
        return x * weight

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        (other,) = ctx.saved_tensors
        if ctx.wrt == "input":
            return grad * other, None, None, None
        return None, (grad * other).sum().reshape(1), None, None


class SleepLayer(nn.Module):
    """``x * weight`` (one parameter) that sleeps ``fwd_ms`` in forward and ``bwd_ms`` in backward: a pipeline stage's
    layer of known time. ``per_sample_ms`` adds that much per sample of the batch to both (twice to the backward).

    ``split_backward=True`` makes the input and the weight gradient two autograd nodes of ``bwd_ms / 2`` each, as a
    real layer's two matmuls are: autograd runs only the one a pass needs, so a zero-bubble schedule's input-grad
    (``I``) and weight-grad (``W``) passes cost half each (one custom node would run its whole backward in both), and
    a first layer whose input needs no gradient costs half. Otherwise one node sleeps ``bwd_ms`` whatever is asked.
    """

    def __init__(self, fwd_ms, bwd_ms, per_sample_ms=0.0, split_backward=False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.fwd_ms, self.bwd_ms, self.per_sample_ms, self.split_backward = (
            fwd_ms,
            bwd_ms,
            per_sample_ms,
            split_backward,
        )

    def forward(self, x):
        extra = self.per_sample_ms * x.shape[0]
        fwd_s, bwd_s = (self.fwd_ms + extra) / 1e3, (self.bwd_ms + 2 * extra) / 1e3
        if not self.split_backward:
            return SleepProduct.apply(x, self.weight, fwd_s, bwd_s)
        time.sleep(fwd_s)
        by_input = _SleepOneGrad.apply(x, self.weight.detach(), bwd_s / 2, "input")
        by_weight = _SleepOneGrad.apply(x.detach(), self.weight, bwd_s / 2, "weight")
        return by_input + by_weight - (x * self.weight).detach()  # = x * weight; each gradient from its own node


class Sleep(nn.Module):
    """A Linear layer whose forward sleeps ``fwd_s`` and backward sleeps ``bwd_s``."""

    def __init__(self, fwd_s, bwd_s, width=8):
        super().__init__()
        self.fwd_s, self.bwd_s = fwd_s, bwd_s
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        time.sleep(self.fwd_s)
        return SleepBackward.apply(self.lin(x), self.bwd_s)


#: Upper slack (ms) on sleep-based timing asserts: a loaded 2-core machine wakes a 2 ms sleep 10+ ms late.
#: Lower bounds (a sleep never ends early) stay exact; only "at most" checks get this slack.
SLACK_MS = 40.0
