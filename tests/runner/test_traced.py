"""Models that are not an nn.Sequential run through torch's tracer: residual blocks in a ModuleList, keyword arguments.

Real processes (gloo, two CPU ranks), tiny sizes, two steps. The partition comes from a
profile taken with ``layers=[...]``; the run must train like one process and return (and
checkpoint) the state under the original model's names.
"""

import copy

import pytest
import torch
from torch import nn

import pipeswift_lab as psl
from pipeswift_lab.fidelity.comparison import compare
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.measure import profile
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.runner import run

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it

LAYERS = ["embed", "blocks.*", "head"]


class Residual(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)

    def forward(self, x, *, scale=1.0):
        return x + scale * torch.tanh(self.lin(self.norm(x)))


class ResNet(nn.Module):
    """An embedding, residual blocks in a ModuleList called with a keyword argument, a head: not an nn.Sequential."""

    def __init__(self, d=8, n_blocks=4, n_in=6, n_out=3, tied=False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(n_in, d)
        self.blocks = nn.ModuleList([Residual(d) for _ in range(n_blocks)])
        self.head = nn.Linear(d, d if tied else n_out)
        if tied:
            self.head.weight = self.blocks[0].lin.weight  # one tensor used in two places

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, scale=0.5)
        return self.head(h)


def batch(n_out=3):
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 6, generator=g), torch.randn(8, n_out, generator=g)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(model, x, y, m, steps):
    ref = copy.deepcopy(model)
    opt = optimizer(list(ref.parameters()))
    for _ in range(steps):
        opt.zero_grad()
        torch.stack(
            [nn.functional.mse_loss(ref(a), b) for a, b in zip(x.tensor_split(m), y.tensor_split(m))]
        ).mean().backward()
        opt.step()
    return ref.state_dict()


def assert_close(got, want, rtol=1e-5):
    assert list(got) == list(want)
    for key in want:
        err = ((got[key] - want[key]).norm() / want[key].norm()).item()
        assert err <= rtol, f"{key}: relative error {err:.3g}"


@pytest.fixture(scope="module")
def resnet_profile():
    """The ResNet profiled with ``layers=[...]`` once for the tests that partition it (they only read it)."""
    x, y = batch()
    kwargs = dict(target=y[:2], loss_fn=nn.functional.mse_loss, layers=LAYERS, progress=False, warmup=1, repeats=2)
    return profile(ResNet(), x[:2], **kwargs)


def test_profile_partition_run_compare_on_a_modulelist_model(resnet_profile):
    model = ResNet()
    x, y = batch()
    # the measured profile with equal times: where a balance of measured times cuts moves with the load (under a busy
    # core it once put every block on the first stage); equal layers cut inside the ModuleList, the case under test
    prof = Profile(resnet_profile.df.assign(fwd_ms=1.0, bwd_ms=2.0), resnet_profile.meta)
    part = partition(prof, 2, schedule="1F1B", m=4)
    assert part.layer_names[1][0].startswith("blocks.")
    result = run(
        model,
        (x, y),
        nn.functional.mse_loss,
        part,
        4,
        steps=2,
        optimizer=optimizer,
        progress=False,
        launch=psl.Launch(timeout_s=120),
    )
    state = result.state_dict()
    assert list(state) == list(model.state_dict())
    assert_close(state, reference(model, x, y, 4, 2))
    assert set(result.timeline.df["kind"]) == {"F", "B"}
    comparison = compare(psl.simulate(part, m=4), result)
    assert comparison.step_ms[1] > 0
    result.load_into(ResNet())  # strict load: the keys are the original model's


@pytest.mark.parametrize("schedule", ["GPipe", "Interleaved1F1B", "ZBVZeroBubble"])
def test_traced_stages_run_under_every_kind_of_schedule(schedule):
    model = ResNet()
    x, y = batch()
    v = 1 if schedule == "GPipe" else 2
    names = ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    prof = Profile.synthetic(fwd_ms=[1.0] * 6, bwd_ms=[2.0] * 6)
    prof = Profile(prof.df.assign(name=names), prof.meta)
    bounds = [(0, 2), (2, 3), (3, 4), (4, 6)] if v == 2 else [(0, 3), (3, 6)]
    part = Partition.from_bounds(prof, bounds, v=v, schedule=schedule, m=4)
    result = run(
        model,
        (x, y),
        nn.functional.mse_loss,
        part,
        4,
        steps=2,
        optimizer=optimizer,
        progress=False,
        launch=psl.Launch(timeout_s=120),
    )
    assert_close(result.state_dict(), reference(model, x, y, 4, 2))


def test_a_traced_run_checkpoints_and_resumes_under_the_original_names(tmp_path, resnet_profile):
    model = ResNet()
    x, y = batch()
    prof = resnet_profile
    part = partition(prof, 2, schedule="1F1B", m=4)
    first = run(
        model,
        (x, y),
        nn.functional.mse_loss,
        part,
        4,
        steps=1,
        optimizer=optimizer,
        progress=False,
        checkpoint=tmp_path / "ck",
        launch=psl.Launch(timeout_s=120),
    )
    assert first.checkpoint is not None
    part3 = partition(prof, 2, schedule="GPipe", m=4, method="uniform")
    second = run(
        model,
        (x, y),
        nn.functional.mse_loss,
        part3,
        4,
        steps=2,
        optimizer=optimizer,
        progress=False,
        launch=psl.Launch(timeout_s=120),
        resume_from=tmp_path / "ck",
    )
    assert_close(second.state_dict(), reference(model, x, y, 4, 2))


def test_tied_weights_across_stages_are_kept_in_sync_and_train_like_one_process():
    model = ResNet(tied=True)  # head.weight is blocks.0.lin.weight
    x, y = batch(n_out=8)
    names = ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    prof = Profile.synthetic(fwd_ms=[1.0] * 6, bwd_ms=[2.0] * 6)
    prof = Profile(prof.df.assign(name=names), prof.meta)
    part = Partition.from_bounds(prof, [(0, 3), (3, 6)], schedule="1F1B", m=2)
    result = run(model, (x, y), nn.functional.mse_loss, part, 2, steps=2, optimizer=optimizer, progress=False)
    assert result.tied_weights.to_dict("records") == [
        {"names": ("blocks.0.lin.weight", "head.weight"), "stages": (0, 1), "ranks": (0, 1)}
    ]
    state = result.state_dict()
    assert_close(state, reference(model, x, y, 2, 2))
    assert state["head.weight"] is state["blocks.0.lin.weight"]  # one tensor, as in the model
    fresh = ResNet(tied=True)
    fresh.load_state_dict(state, strict=True)
    assert fresh.head.weight is fresh.blocks[0].lin.weight


def test_split_names_that_are_not_in_the_model_and_untraceable_models_are_refused():
    model = ResNet()
    x, y = batch()
    prof = Profile.synthetic(fwd_ms=[1.0] * 3, bwd_ms=[2.0] * 3)
    wrong = Profile(prof.df.assign(name=["embed", "layers.1", "head"]), prof.meta)
    part = Partition.from_bounds(wrong, [(0, 1), (1, 3)], schedule="1F1B", m=2)
    with pytest.raises(ValueError, match=r"'layers.1', which is not a submodule of the ResNet"):
        run(model, (x, y), nn.functional.mse_loss, part, 2, steps=1, progress=False)
    unnamed = Partition.from_bounds(
        Profile.synthetic(fwd_ms=[1.0] * 3, bwd_ms=[2.0] * 3), [(0, 1), (1, 3)], schedule="1F1B", m=2
    )
    with pytest.raises(ValueError, match=r"not a submodule"):
        run(model, (x, y), nn.functional.mse_loss, unnamed, 2, steps=1, progress=False)

    class DataDependent(ResNet):
        def forward(self, x):
            h = self.embed(x)
            for block in self.blocks:
                if h.sum() > 0:  # data-dependent control flow: torch.export cannot trace it
                    h = block(h)
            return self.head(h)

    ok = Partition.from_bounds(
        Profile(prof.df.assign(name=["embed", "blocks.2", "head"]), prof.meta), [(0, 1), (1, 3)], schedule="1F1B", m=2
    )
    with pytest.raises(ValueError, match=r"pipeline tracer cannot split the DataDependent.*split=\"manual\""):
        run(DataDependent(), (x, y), nn.functional.mse_loss, ok, 2, steps=1, progress=False)


class TracedViT(nn.Module):
    """The reference ViT's layers outside an nn.Sequential: its patch tokens are a transposed view at the first cut."""

    def __init__(self, seq):
        super().__init__()
        self.patch_embed = seq.patch_embed
        self.blocks = nn.ModuleList([seq.block_0, seq.block_1])
        self.head = seq.head

    def forward(self, images):
        h = self.patch_embed(images)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_a_traced_split_after_a_transposed_view_sends_it_contiguous():
    from pipeswift_lab import models

    setup = models.reference(
        "vit", batch_size=4, image_size=8, patch_size=4, d_model=8, n_layers=2, n_heads=2, num_classes=5
    )
    model = TracedViT(setup.model)
    prof = Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4)
    prof = Profile(prof.df.assign(name=["patch_embed", "blocks.0", "blocks.1", "head"]), prof.meta)
    part = Partition.from_bounds(prof, [(0, 1), (1, 4)], schedule="1F1B", m=2)
    result = run(
        model,
        (setup.inputs, setup.targets),
        setup.loss_fn,
        part,
        2,
        steps=2,
        optimizer=optimizer,
        progress=False,
        launch=psl.Launch(timeout_s=120),
    )
    ref = copy.deepcopy(model)
    opt = optimizer(list(ref.parameters()))
    for _ in range(2):
        opt.zero_grad()
        pairs = zip(setup.inputs.tensor_split(2), setup.targets.tensor_split(2))
        torch.stack([setup.loss_fn(ref(a), b) for a, b in pairs]).mean().backward()
        opt.step()
    assert_close(result.state_dict(), ref.state_dict())


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_traced_stages_with_two_replicas_train_like_one_process_on_the_global_batch(schedule):
    model = ResNet()
    x, y = batch()
    v = 2 if schedule == "Interleaved1F1B" else 1
    names = ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    prof = Profile(Profile.synthetic(fwd_ms=[1.0] * 6, bwd_ms=[2.0] * 6).df.assign(name=names), {})
    bounds = [(0, 2), (2, 3), (3, 4), (4, 6)] if v == 2 else [(0, 3), (3, 6)]
    part = Partition.from_bounds(prof, bounds, v=v, schedule=schedule, m=2)
    result = run(
        model,
        (x, y),
        nn.functional.mse_loss,
        part,
        2,
        steps=2,
        optimizer=optimizer,
        progress=False,
        launch=psl.Launch(timeout_s=120),
        D=2,
    )
    assert list(result.state_dict()) == list(model.state_dict())
    assert_close(result.state_dict(), reference(model, x, y, 4, 2))  # 2 replicas x 2 micro-batches of the global batch
    assert set(result.timeline.df["replica"]) == {0, 1}
    reduces = result.timeline.df.query("kind == 'REDUCE_GRAD'")  # the traced stage modules' all-reduce is timed too
    assert len(reduces) == 2 * 2 * 2 * v and result.allreduce_ms > 0  # steps x replicas x P x v
