"""The run's optimizer, measured: its state and the temporaries of its step, per implementation."""

import pytest
import torch

from pipeswift_lab.runner.optimizer_memory import measure_optimizer_memory


@pytest.mark.parametrize(
    "factory, states, per_largest, per_total",
    [
        (lambda p: torch.optim.Adam(p, foreach=False), 2, 5 / 3, 1 / 3),  # two per tensor, the last one's quotient
        (lambda p: torch.optim.Adam(p, foreach=True), 2, 0, 1),  # one sqrt of every state at once
        (lambda p: torch.optim.AdamW(p, fused=True), 2, 0, 0),  # one kernel, no temporaries
        (lambda p: torch.optim.SGD(p, lr=0.1), 0, 0, 0),
        (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), 1, 0, 0),
    ],
)
def test_state_and_temporaries(factory, states, per_largest, per_total):
    measured = measure_optimizer_memory(factory)
    assert measured.states == pytest.approx(states)
    assert measured.per_largest == pytest.approx(per_largest, abs=1e-3)
    assert measured.per_total == pytest.approx(per_total, abs=1e-3)


def test_any_optimizer_is_measured():
    rmsprop = measure_optimizer_memory(lambda p: torch.optim.RMSprop(p))  # one square average; its step's temporaries
    assert rmsprop.states == pytest.approx(1.0) and rmsprop.transient(1000, 4000) > 0


def test_name_says_the_implementation():
    assert measure_optimizer_memory(lambda p: torch.optim.Adam(p, foreach=True)).name == "Adam (foreach)"
    assert measure_optimizer_memory(lambda p: torch.optim.SGD(p, lr=0.1)).name == "SGD"
    assert measure_optimizer_memory(lambda p: torch.optim.AdamW(p, fused=True)).name == "AdamW (fused)"
