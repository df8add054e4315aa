"""Real pipeline runs: every schedule trains exactly like one process, in the order the simulator predicts.

Each run launches real worker processes (gloo, one CPU process per rank). The first launch
starts the fork server (torch preloaded); later launches take about a second, so every test
keeps to tiny models and two steps.
"""

import copy
import sys
import types

import pytest
import torch
from torch import nn

from pipeswift_lab import Launch
from pipeswift_lab.core.schedule_orders import compute_orders
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.runner import RunResult, run
from pipeswift_lab.simulation.timeline import Timeline

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it

LR = 0.1
BATCH = 8


class Block(nn.Module):
    """A layer defined in the test module: the workers cannot import it, so it travels by value."""

    def __init__(self, n_in, n_out, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = nn.Parameter(torch.randn(n_out, n_in, generator=g) / n_in**0.5)
        self.bias = nn.Parameter(torch.randn(n_out, generator=g) * 0.1)

    def forward(self, x):
        return torch.tanh(x @ self.weight.T + self.bias)


def make_model(n_layers, width=12, n_in=6, n_out=3):
    widths = [n_in] + [width] * (n_layers - 1) + [n_out]
    return nn.Sequential(*[Block(a, b, seed=i) for i, (a, b) in enumerate(zip(widths[:-1], widths[1:]))])


def make_batch(seed=0, n_in=6, n_out=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, n_in, generator=g), torch.randn(BATCH, n_out, generator=g)


def uniform_partition(n_layers, P, v, schedule, m=4):
    profile = Profile.synthetic(fwd_ms=[1.0] * n_layers, bwd_ms=[2.0] * n_layers)
    return partition(profile, P, method="uniform", v=v, schedule=schedule, m=m)


def reference_training(model, batch_of_step, loss_fn, m, steps, optimizer):
    """Plain single-process training on the same micro-batches: the mean of the m micro-batch losses."""
    ref = copy.deepcopy(model)
    opt = optimizer(list(ref.parameters()))
    losses = []
    for step in range(steps):
        x, y = batch_of_step(step)
        opt.zero_grad()
        loss = torch.stack([loss_fn(ref(xm), ym) for xm, ym in zip(x.tensor_split(m), y.tensor_split(m))]).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return ref.state_dict(), losses


def assert_same_parameters(got, want, rtol=1e-5):
    assert list(got) == list(want)
    for key in want:
        err = ((got[key] - want[key]).norm() / want[key].norm()).item()
        assert err <= rtol, f"{key}: relative error {err:.3g}"


def assert_orders_match(result, P, m, schedule, v, steps):
    expected = compute_orders(P, m, schedule, v)
    df = result.timeline.df
    for step in range(steps):
        for rank in range(P):
            rows = df[(df["step"] == step) & (df["rank"] == rank)].sort_values("start_ms")
            got = list(zip(rows["kind"], rows["stage"], rows["microbatch"]))
            assert got == [tuple(a) for a in expected[rank]], f"step {step} rank {rank}"


MULTI = {"Interleaved1F1B": 2, "LoopedBFS": 2, "InterleavedZeroBubble": 2, "ZBVZeroBubble": 2, "DualPipeV": 2}


@pytest.mark.parametrize(
    "schedule", ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
)
def test_every_schedule_at_p2_trains_like_one_process_in_the_predicted_order(schedule):
    P, v, m, steps = 2, MULTI.get(schedule, 1), 4, 2
    model = make_model(4)
    batch = make_batch()
    scale = 0.5  # a closure over a local: pickled by value

    def loss_fn(out, target):
        return scale * ((out - target) ** 2).mean()

    def optimizer(params):
        return torch.optim.SGD(params, lr=LR, momentum=0.9)

    part = uniform_partition(4, P, v, schedule)
    result = run(model, batch, loss_fn, part, m, steps=steps, optimizer=optimizer, launch=Launch(timeout_s=120))

    want_state, want_losses = reference_training(model, lambda step: batch, loss_fn, m, steps, optimizer)
    assert isinstance(result, RunResult)
    assert_same_parameters(result.state_dict(), want_state)
    assert result.losses == pytest.approx(want_losses, rel=1e-5)
    assert_orders_match(result, P, m, schedule, v, steps)

    tl = result.timeline
    assert isinstance(tl, Timeline) and tl.source == "measured"
    expected_kinds = {kind for actions in compute_orders(P, m, schedule, v).values() for kind, _, _ in actions}
    assert set(tl.df["kind"]) == expected_kinds
    assert ("I" in expected_kinds) == (schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"))
    assert set(tl.df["rank"]) == {0, 1} and set(tl.df["step"]) == {0, 1}
    assert len(tl.df) == steps * sum(len(a) for a in compute_orders(P, m, schedule, v).values())
    assert (tl.df["start_ms"] >= 0).all() and (tl.df["end_ms"] >= tl.df["start_ms"]).all()
    assert len(result.step_ms) == steps and all(t > 0 for t in result.step_ms)
    # every action of a step lies inside that step's window
    for step in range(steps):
        rows = tl.df[tl.df["step"] == step]
        start = result.meta["step_start_ms"][step]
        assert rows["start_ms"].min() >= start
        assert rows["end_ms"].max() <= start + result.step_ms[step] + 1e-6
    jct = result.jct
    assert jct.queue_s == 0 and jct.assembly_s > 0 and jct.training_s > 0 and jct.cleanup_s > 0
    assert jct.training_s * 1e3 == pytest.approx(result.meta["step_start_ms"][-1] + result.step_ms[-1], rel=1e-6)
    assert (result.schedule, result.P, result.v, result.m, result.steps) == (schedule, P, v, m, steps)
    assert result.backend == "gloo" and result.device_type == "cpu"


@pytest.mark.parametrize(
    "schedule", ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]
)
def test_every_schedule_at_p4_trains_like_one_process(schedule):
    P, v, m, steps = 4, MULTI.get(schedule, 1), 8, 2
    n_layers = P * v
    model = make_model(n_layers)
    batch = make_batch(1)
    part = uniform_partition(n_layers, P, v, schedule, m=m)
    result = run(
        model, batch, nn.functional.mse_loss, part, m, steps=steps, progress=False, launch=Launch(timeout_s=120)
    )
    want_state, want_losses = reference_training(
        model, lambda s: batch, nn.functional.mse_loss, m, steps, lambda p: torch.optim.SGD(p, lr=0.01)
    )
    assert_same_parameters(result.state_dict(), want_state)
    assert result.losses == pytest.approx(want_losses, rel=1e-5)
    assert_orders_match(result, P, m, schedule, v, steps)
    assert sorted(result.ranks["rank"]) == [0, 1, 2, 3]
    held = {r: tuple(s for s, rank in enumerate(part.stage_to_rank) if rank == r) for r in range(P)}
    assert {row.rank: tuple(row.stages) for row in result.ranks.itertuples()} == held


def test_objects_from_a_module_workers_cannot_import_and_per_step_data():
    """Model, loss, data and optimizer from a module created at run time, as a notebook cell's are."""
    source = """
import torch
from torch import nn

class Scale(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, n))
    def forward(self, x):
        return x * self.gain

def build():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 7), nn.GELU(), Scale(7), nn.Linear(7, 2))

def data(step):
    # unseeded randomness: the runner seeds torch's RNG to seed + step on every rank that draws
    return torch.randn(8, 5), torch.randn(8, 2)

def loss(out, target):
    return nn.functional.smooth_l1_loss(out, target)

def optimizer(params):
    return torch.optim.Adam(params, lr=1e-2)
"""
    module = types.ModuleType("cell_defined_module")
    exec(compile(source, "<cell>", "exec"), module.__dict__)
    sys.modules[module.__name__] = module
    try:
        model = module.build()
        part = Partition.from_bounds(Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[1.0] * 4), [(0, 2), (2, 4)])
        steps, m = 3, 2
        result = run(
            model,
            module.data,
            module.loss,
            part,
            m,
            steps=steps,
            optimizer=module.optimizer,
            progress=False,
            launch=Launch(timeout_s=120, instrument=False),
            seed=7,
        )
    finally:
        del sys.modules[module.__name__]

    def batch_of_step(step):  # what every rank drew: torch seeded to seed + step
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(7 + step)
            return module.data(step)

    want_state, want_losses = reference_training(model, batch_of_step, module.loss, m, steps, module.optimizer)
    assert_same_parameters(result.state_dict(), want_state)
    assert result.losses == pytest.approx(want_losses, rel=1e-5)
    assert result.timeline is None and not result.instrumented and len(result.step_ms) == steps
    trained = result.load_into(copy.deepcopy(model))
    assert torch.equal(trained[2].gain, result.state_dict()["2.gain"])


def test_an_iterable_of_batches_gives_one_batch_per_step():
    model = make_model(2)
    batches = [make_batch(seed) for seed in range(3)]
    part = Partition.from_bounds(
        Profile.synthetic(fwd_ms=[1.0, 1.0], bwd_ms=[1.0, 1.0]), [(0, 1), (1, 2)], schedule="GPipe"
    )
    result = run(
        model, iter(batches), nn.functional.mse_loss, part, 2, steps=3, progress=False, launch=Launch(timeout_s=120)
    )
    want_state, want_losses = reference_training(
        model, lambda s: batches[s], nn.functional.mse_loss, 2, 3, lambda p: torch.optim.SGD(p, lr=0.01)
    )
    assert_same_parameters(result.state_dict(), want_state)
    assert result.losses == pytest.approx(want_losses, rel=1e-5)
    df = result.df
    assert list(df.columns) == ["step", "step_ms", "loss"] and list(df["step"]) == [0, 1, 2]
    html = result._repr_html_()
    assert "GPipe" in html and "assembly_s" in html
    assert "RunResult GPipe P=2 m=2" in str(result)
    # a synthetic profile of times carries no bytes: the card says so instead of a 0 MiB prediction and a 100% error
    assert result.memory["predicted_peak_bytes"].isna().all() and result.memory["measured_peak_bytes"].gt(0).all()
    assert "not predicted: the profile has no byte columns" in str(result) and "memory_error_max" not in str(result)
    assert "not predicted: the profile has no byte columns" in html
    assert set(result.assembly_phases["phase"].str.split(" -> ").str[0]) >= {"launch", "processes started"}
    assert result.assembly_phases["seconds"].sum() == pytest.approx(result.jct.assembly_s, rel=1e-6)
