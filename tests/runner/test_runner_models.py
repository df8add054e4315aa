"""The models this project ships run as real pipelines: every reference model, every schedule, at P=2.

Tiny sizes and two steps; each run is compared with single-process training on the same
micro-batches (the mean of the m micro-batch losses) within 1e-5 relative.
"""

import copy

import pytest
import torch

from pipeswift_lab import Launch, models
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.runner import run

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it

LR = 0.05
TINY = {
    "gpt": dict(vocab_size=11, seq_len=6, d_model=8, n_layers=2, n_heads=2, mlp_ratio=2),
    "vit": dict(image_size=8, patch_size=4, channels=3, d_model=8, n_layers=2, n_heads=2, mlp_ratio=2, num_classes=5),
    "mlp": dict(widths=(6, 8, 8, 8, 3)),
}
SCHEDULES = {
    "GPipe": 1,
    "1F1B": 1,
    "Interleaved1F1B": 2,
    "LoopedBFS": 2,
    "InterleavedZeroBubble": 2,
    "ZBVZeroBubble": 2,
    "DualPipeV": 2,
}


def optimizer(params):
    return torch.optim.SGD(params, lr=LR)


def reference_state(setup, m, steps):
    ref = copy.deepcopy(setup.model)
    opt = optimizer(list(ref.parameters()))
    for _ in range(steps):
        opt.zero_grad()
        pairs = zip(setup.inputs.tensor_split(m), setup.targets.tensor_split(m))
        torch.stack([setup.loss_fn(ref(x), y) for x, y in pairs]).mean().backward()
        opt.step()
    return ref.state_dict()


def assert_close(got, want, rtol=1e-5):
    assert list(got) == list(want)
    for key in want:
        err = ((got[key] - want[key]).norm() / want[key].norm().clamp_min(1e-12)).item()
        assert err <= rtol, f"{key}: relative error {err:.3g}"


@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("name", ["gpt", "vit", "mlp"])
def test_every_reference_model_runs_every_schedule_at_p2(name, schedule):
    setup = models.reference(name, batch_size=8, **TINY[name])
    n_layers = len(setup.model)
    assert n_layers == 4
    v, m, steps = SCHEDULES[schedule], 4, 2  # DualPipeV needs m >= 2P
    profile = Profile.synthetic(fwd_ms=[1.0] * n_layers, bwd_ms=[2.0] * n_layers)
    part = partition(profile, 2, method="uniform", v=v, schedule=schedule, m=m)
    result = run(
        setup.model,
        (setup.inputs, setup.targets),
        setup.loss_fn,
        part,
        m,
        steps=steps,
        optimizer=optimizer,
        progress=False,
        launch=Launch(timeout_s=120),
    )
    assert_close(result.state_dict(), reference_state(setup, m, steps))


@pytest.mark.parametrize("bounds", [[(0, 1), (1, 4)], [(0, 3), (3, 4)]], ids=["after-patch-embedding", "before-head"])
def test_vit_splits_that_send_a_transposed_view(bounds):
    """The patch embedding returns ``flatten(2).transpose(1, 2)``, a non-contiguous view: it must still cross a
    boundary."""
    setup = models.reference("vit", batch_size=4, **TINY["vit"])
    profile = Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4)
    part = Partition.from_bounds(profile, bounds, schedule="1F1B", m=2)
    result = run(
        setup.model,
        (setup.inputs, setup.targets),
        setup.loss_fn,
        part,
        2,
        steps=2,
        optimizer=optimizer,
        progress=False,
        launch=Launch(timeout_s=120),
    )
    assert_close(result.state_dict(), reference_state(setup, 2, 2))
