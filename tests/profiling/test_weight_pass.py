"""How the profiler times a zero-bubble schedule's two backward passes, ``I`` and ``W``, per unit."""

import math

import pytest
import torch
import torch.nn.functional as F
from sleep_layers import SleepBackward
from torch import nn

from pipeswift_lab.profiling.weight_pass import split_backward_columns

pytestmark = pytest.mark.usefixtures("one_torch_thread")

INPUT_SLEEP_S, WEIGHT_SLEEP_S = 0.02, 0.03


class SlowLinear(nn.Module):
    """A linear whose input gradient's path sleeps ``INPUT_SLEEP_S`` and its weight gradient's ``WEIGHT_SLEEP_S``."""

    def __init__(self, calls: list[str], name: str):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))
        self.calls, self.name = calls, name

    def forward(self, x):
        self.calls.append(self.name)
        return F.linear(SleepBackward.apply(x, INPUT_SLEEP_S), SleepBackward.apply(self.weight, WEIGHT_SLEEP_S))


def test_each_pass_is_timed_on_its_own_path():
    torch.manual_seed(0)
    calls: list[str] = []
    units = [(name, SlowLinear(calls, name)) for name in ("a", "b")]
    x = torch.randn(4, 8)
    forward = lambda: units[1][1](units[0][1](x))  # noqa: E731  "a" is fed the batch: no input gradient, no I
    columns = split_backward_columns(units, forward, repeats=3)
    # "b" alone is timed: its I waits on the input's path, its W on the weight's
    assert math.isnan(columns["input_pass_ms"][0]) and math.isnan(columns["weight_pass_ms"][0])
    assert INPUT_SLEEP_S * 1e3 <= columns["input_pass_ms"][1] < (INPUT_SLEEP_S + WEIGHT_SLEEP_S) * 1e3
    assert WEIGHT_SLEEP_S * 1e3 <= columns["weight_pass_ms"][1] < (WEIGHT_SLEEP_S + INPUT_SLEEP_S) * 1e3
    assert units[1][1].weight.grad is None  # the parameters' gradients are left as they were


def test_units_take_turns_so_a_burst_of_load_falls_on_one_round():
    torch.manual_seed(0)
    calls: list[str] = []
    units = [(name, SlowLinear(calls, name)) for name in ("a", "b", "c")]
    x = torch.randn(4, 8, requires_grad=True)  # every unit has an I
    forward = lambda: units[2][1](units[1][1](units[0][1](x)))  # noqa: E731
    timed = split_backward_columns(units, forward, repeats=2)
    forwards = calls[3 : 3 + 3 * 3]  # after the capturing forward: one untimed round and two timed ones
    assert forwards == ["a", "b", "c"] * 3
    assert all(ms >= INPUT_SLEEP_S * 1e3 for ms in timed["input_pass_ms"])
