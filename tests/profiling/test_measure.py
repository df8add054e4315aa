"""Tests for pipeswift_lab.profiling.measure: in-place per-layer timing, memory, state, persistence, bad input.

Timing logic is checked with layers that sleep a known time in forward and (through a
custom autograd Function) in backward; sleeps never return early, so lower bounds are
exact. A loaded machine wakes a sleep arbitrarily late, so there is no upper bound on a
unit's time but the one attribution itself makes: a unit that is not charged with another
unit's (or the glue's) sleep measures less than that sleep.
"""

import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sleep_layers import Sleep, SleepBackward
from torch import nn

from pipeswift_lab.profiling.measure import profile, profile_step
from pipeswift_lab.profiling.table import COLUMNS, Profile
from pipeswift_lab.profiling.units import select_units

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Residual(nn.Module):
    """Embedding, ModuleList of residual sleeping blocks, in-place ReLU, LM head tied to the embedding,
    and a keyword-only argument in forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.ModuleList([Sleep(0.040, 0.0), Sleep(0.0, 0.050)])
        self.act = nn.ReLU(inplace=True)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens, *, scale=1.0):
        x = self.embed(tokens)
        for block in self.blocks:
            x = self.act(x + block(x))
        return self.head(x) * scale


def at_least(measured, sleep_ms):
    return measured >= sleep_ms - 0.5


@pytest.fixture(scope="module")
def sleepy():
    torch.manual_seed(0)
    model = nn.Sequential(Sleep(0.040, 0.010), Sleep(0.005, 0.050))
    return model, torch.randn(4, 8)


@pytest.fixture(scope="module")
def sleepy_profile(sleepy):
    model, x = sleepy
    return profile(model, x, repeats=3, warmup=1, progress=False)


# -- timing attribution ---------------------------------------------------------------------
def test_sequential_sleeps_are_attributed_to_their_layers(sleepy_profile):
    df = sleepy_profile.df
    assert list(df.columns[: len(COLUMNS)]) == list(COLUMNS)
    assert sleepy_profile.layer_names == ("0", "1") and sleepy_profile.n_layers == 2
    assert list(df["type"]) == ["Sleep", "Sleep"] and list(df["calls"]) == [1, 1]
    for got, want in zip(df["fwd_ms"], (40, 5)):
        assert at_least(got, want), (got, want)
    for got, want in zip(df["bwd_ms"], (10, 50)):
        assert at_least(got, want), (got, want)
    assert df["fwd_ms"].iloc[1] < 40 and df["bwd_ms"].iloc[0] < 50  # neither is charged with the other's long sleep
    assert np.allclose(df["total_ms"], df["fwd_ms"] + df["bwd_ms"])
    assert sleepy_profile.total_ms == pytest.approx(df["total_ms"].sum())
    assert 0 < sleepy_profile.coverage <= 1.1  # the layers lie inside the step (how much of it: the glue's, the load's)
    assert sleepy_profile.cv >= 0 and sleepy_profile.step_ms >= 105 - 0.5  # every sleep is in the step
    assert len(sleepy_profile.step_samples_ms) == 3
    assert sleepy_profile.meta["repeats"] == 3 and sleepy_profile.meta["warmup"] == 1
    assert sleepy_profile.meta["batch_shape"] == [4, 8] and sleepy_profile.meta["batch_size"] == 4
    assert sleepy_profile.meta["device"] == "cpu" and sleepy_profile.meta["timer"] == "perf_counter_ns"
    assert sleepy_profile.meta["dtype"] == "float32" and sleepy_profile.meta["torch_version"] == torch.__version__
    assert (df["peak_bytes"] >= 0).all() and (df["transient_bytes"] >= 0).all()  # measured on CPU too


def test_residual_modulelist_tied_kwargs_inplace_model():
    model = Residual()
    tokens = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(0))
    prof = profile(
        model,
        tokens,
        layers=["embed", "blocks.*", "act", "head"],
        sample_kwargs={"scale": 2.0},
        repeats=3,
        warmup=1,
        progress=False,
    )
    df = prof.df.set_index("name")
    # rows in execution order; the in-place ReLU runs after each block
    assert prof.layer_names == ("embed", "blocks.0", "act", "blocks.1", "head")
    assert df.loc["act", "calls"] == 2 and df.loc["blocks.0", "calls"] == 1
    assert at_least(df.loc["blocks.0", "fwd_ms"], 40) and df.loc["blocks.1", "fwd_ms"] < 40
    assert df.loc["blocks.0", "bwd_ms"] < 50 and at_least(df.loc["blocks.1", "bwd_ms"], 50)
    # the tied weight's gradient accumulation runs after the embedding's backward: it must not stretch
    # the head's window over the blocks' backward (50 ms)
    for name in ("head", "embed", "act"):
        assert df.loc[name, "bwd_ms"] < 50 and df.loc[name, "fwd_ms"] < 40
    # tied weight counted in both units (each pipeline stage holds a copy); meta counts it once
    assert df.loc["head", "params"] == 80 and df.loc["embed", "params"] == 80
    assert prof.meta["model_params"] == 80 + 2 * 72
    # in-place ReLU saves its (4, 5, 8) float32 result on each call, the storage of the residual sum made after the
    # block before it: that block holds it (a stage holds each storage once), the ReLU allocates nothing
    assert df.loc["act", "activation_bytes"] == 0
    assert df.loc["blocks.0", "activation_bytes"] == df.loc["blocks.1", "activation_bytes"] == 4 * 5 * 8 * 4
    assert df.loc["act", "output_bytes"] == 2 * 4 * 5 * 8 * 4
    assert df.loc["head", "output_bytes"] == 4 * 5 * 10 * 4
    assert prof.meta["model"] == "Residual"


def test_glue_between_units_is_not_attributed_to_them():
    class Glued(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            time.sleep(0.040)  # forward glue
            x = SleepBackward.apply(self.a(x), 0.0)
            x = SleepBackward.apply(x, 0.050)  # backward glue between a and b
            return self.b(x)

    prof = profile(Glued(), torch.randn(4, 8), layers=["a", "b"], repeats=3, warmup=1, progress=False)
    assert (prof.df["fwd_ms"] < 40).all() and (prof.df["bwd_ms"] < 50).all()  # neither glue sleep is charged
    assert prof.step_ms > 90 - 0.5
    assert prof.coverage < 1  # the glue is in the step and in no unit


def test_shared_block_called_twice_adds_its_calls():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Sleep(0.020, 0.015)
            self.out = nn.Linear(8, 2)

        def forward(self, x):
            return self.out(self.block(self.block(x)))

    prof = profile(Twice(), torch.randn(2, 8), layers=["block", "out"], repeats=3, warmup=1, progress=False)
    row = prof.df.set_index("name").loc["block"]
    assert row["calls"] == 2
    assert at_least(row["fwd_ms"], 40) and at_least(row["bwd_ms"], 30)  # both calls' sleeps


def test_units_are_ordered_by_execution_not_registration():
    class Reversed(nn.Module):
        def __init__(self):
            super().__init__()
            self.last, self.first = nn.Linear(4, 2), nn.Linear(3, 4)

        def forward(self, x):
            return self.last(self.first(x))

    prof = profile(Reversed(), torch.randn(2, 3), layers=["last", "first"], repeats=1, warmup=0, progress=False)
    assert prof.layer_names == ("first", "last")
    assert list(prof.df["params"]) == [16, 10] and list(prof.df["param_bytes"]) == [64, 40]


def test_activation_and_output_bytes_are_measured_exactly():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(inplace=True), nn.Linear(32, 4))
    prof = profile(model, torch.randn(8, 16), repeats=1, warmup=0, progress=False)
    # a layer holds what it allocates and the backward needs, each storage once: the first Linear saves the sample
    # (made before the step: no layer's), returns 8x32 that the in-place ReLU saves as its result and the last Linear
    # as its input (one storage, the first Linear's); the last returns the 8x4 output
    assert list(prof.df["activation_bytes"]) == [8 * 32 * 4, 0, 8 * 4 * 4]
    assert list(prof.df["output_bytes"]) == [8 * 32 * 4, 8 * 32 * 4, 8 * 4 * 4]
    # a cut before the ReLU or the last Linear sends the 8x32 tensor (floating: its gradient comes back), which the
    # forward keeps anyway
    assert list(prof.df["cut_bytes"]) == list(prof.df["cut_grad_bytes"]) == [0, 8 * 32 * 4, 8 * 32 * 4]
    assert list(prof.df["cut_freed_bytes"]) == [0, 0, 0]
    assert list(prof.df["params"]) == [16 * 32 + 32, 0, 32 * 4 + 4]


class Collect(nn.Module):
    """Runs the garbage collector in its forward while memory is measured (a dispatch mode counts every storage), as
    the interpreter may at any allocation."""

    def forward(self, x):
        import gc

        from torch.utils._python_dispatch import _get_current_dispatch_mode

        if _get_current_dispatch_mode() is not None:
            gc.collect()
        return x


def test_garbage_left_by_earlier_work_does_not_change_what_a_layer_is_measured_to_allocate():
    """Tensors held only by a reference cycle (what an earlier test or notebook cell left behind) used to be counted
    as alive before the step and freed when the collector next ran, in the middle of a layer's forward: the bytes it
    kept came out negative and its transient grew by the garbage's size (the order-dependent test_run_memory)."""
    import gc

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), Collect(), nn.Tanh(), nn.Linear(32, 4))
    sample = torch.randn(8, 16)
    columns = ["transient_bytes", "peak_bytes", "activation_bytes", "accumulate_transient_bytes"]
    clean = profile(model, sample, repeats=1, warmup=0, progress=False).df[columns]
    gc.disable()  # the garbage stays until a collection: the Collect layer's, or the profiler's own
    try:
        for _ in range(4):
            cycle = [torch.zeros(1 << 18)]  # 1 MiB each, freed only by the collector
            cycle.append(cycle)
        del cycle
        dirty = profile(model, sample, repeats=1, warmup=0, progress=False).df[columns]
    finally:
        gc.enable()
    assert dirty.equals(clean), (clean, dirty)
    assert dirty["transient_bytes"].max() < 1 << 18


def test_a_storage_two_ops_save_is_held_once_by_the_layer_that_allocated_it():
    """tanh saves its output and the next Linear saves the same tensor as its input: one storage, held by the tanh's
    layer (which allocated it). tanh's backward needs its output, not its input: the first Linear's output is freed
    (a cut before the tanh sends it, and only the sending stage keeps it)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    prof = profile(model, torch.randn(8, 16), repeats=1, warmup=0, progress=False)
    assert list(prof.df["activation_bytes"]) == [0, 8 * 32 * 4, 8 * 4 * 4]
    assert list(prof.df["cut_freed_bytes"]) == [0, 8 * 32 * 4, 0]


class Scale(nn.Module):
    """``2 * x``: saves nothing for its backward (the gradient is a constant times the incoming one)."""

    def forward(self, x):
        return 2 * x


def test_what_a_cut_sends_and_what_only_the_sending_stage_keeps():
    """A cut before ``Scale`` sends the Linear's output, which the whole model's forward frees once ``Scale`` has read
    it: a pipeline's sending stage keeps it anyway (torch holds a stage's outputs for its backward)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), Scale(), nn.Linear(32, 4))
    prof = profile(model, torch.randn(8, 16), repeats=1, warmup=0, progress=False)
    assert list(prof.df["activation_bytes"]) == [0, 8 * 32 * 4, 8 * 4 * 4]  # Scale's output is saved by the Linear
    assert list(prof.df["cut_bytes"]) == [0, 8 * 32 * 4, 8 * 32 * 4]
    assert list(prof.df["cut_freed_bytes"]) == [0, 8 * 32 * 4, 0]


class SharedMask(nn.Module):
    """A mask made once before the blocks and read by each: every cut between blocks sends it beside the hidden
    state (a skip connection, as a Hugging Face model's causal mask)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        h = self.embed(x)
        mask = (x > 0).float()  # made outside any layer, after the first one started: that layer's stage makes it
        for block in self.blocks:
            h = block(h) * mask
        return h


def test_a_value_every_later_layer_reads_crosses_every_cut():
    x = torch.randn(4, 8)
    prof = profile(SharedMask(), x, layers=["embed", "blocks.*"], repeats=1, warmup=0, progress=False)
    hidden, mask = 4 * 8 * 4, 4 * 8 * 4
    assert list(prof.df["cut_bytes"]) == [0, hidden + mask, hidden + mask, hidden + mask]
    assert list(prof.df["cut_grad_bytes"]) == [0, hidden + mask, hidden + mask, hidden + mask]  # float: gradients
    assert prof.meta["input_bytes"] == 4 * 8 * 4


def test_loss_fn_and_target_are_used():
    calls = []

    def loss_fn(output, target):
        calls.append((tuple(output.shape), tuple(target.shape)))
        time.sleep(0.06)  # the loss is outside the layers: it lowers coverage
        return F.mse_loss(output, target)

    model = nn.Sequential(Sleep(0.005, 0.005, width=3))
    prof = profile(
        model, torch.randn(2, 3), target=torch.randn(2, 3), loss_fn=loss_fn, repeats=2, warmup=1, progress=False
    )
    assert calls == [((2, 3), (2, 3))] * 5  # warmup, 2 repeats, and the two untimed memory steps
    assert prof.meta["loss"] == "loss_fn"
    assert prof.coverage < 0.5


def test_inplace_modification_of_a_saved_tensor_is_still_detected():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            a = self.lin(x).sigmoid()
            a.mul_(2)  # sigmoid saved its output: autograd must refuse
            return a

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        profile(nn.Sequential(Bad()), torch.randn(2, 4), repeats=1, warmup=0, progress=False)


def test_profile_step_attributes_a_custom_step():
    torch.manual_seed(0)
    model = nn.Sequential(Sleep(0.020, 0.020), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    runs = []
    before = model[1].weight.detach().clone()

    def step():
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        time.sleep(0.040)  # outside the model
        runs.append(1)

    prof = profile_step(model, step, repeats=3, warmup=2, progress=False)
    assert len(runs) == 5 and not torch.equal(model[1].weight, before)  # it really trains
    assert prof.meta["source"] == "step" and prof.meta["batch_shape"] == [4, 8]
    first = prof.df.iloc[0]
    assert at_least(first["fwd_ms"], 20) and at_least(first["bwd_ms"], 20)
    assert first["fwd_ms"] < 40 and first["bwd_ms"] < 40  # the step's own 40 ms sleep, outside the model, is not
    assert prof.step_ms >= 80 - 0.5 and 0 < prof.coverage < 1  # it is in the step (about 40 ms of 80 in the units)


# -- the model comes back untouched -------------------------------------------------------------
def test_model_state_is_restored_exactly():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.ReLU(inplace=True), nn.Linear(8, 3))
    model[0].bias.requires_grad_(False)
    model.eval()
    model[2].train()  # mixed flags
    x = torch.randn(5, 6)
    model(x).sum().backward()  # existing gradients
    seen = []
    model[4].register_forward_hook(lambda m, a, o: seen.append(1))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {name: p.grad for name, p in model.named_parameters()}
    grad_values = {name: None if g is None else g.clone() for name, g in grads.items()}
    flags = [m.training for m in model.modules()]
    requires = [p.requires_grad for p in model.parameters()]
    buffers = {name: b for name, b in model.named_buffers()}
    hooks = [
        (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks), len(m._backward_pre_hooks))
        for m in model.modules()
    ]
    rng = torch.get_rng_state()

    profile(model, x, repeats=2, warmup=1, progress=False)

    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    for name, p in model.named_parameters():
        assert p.grad is grads[name]
        assert (p.grad is None) or torch.equal(p.grad, grad_values[name])
    assert [m.training for m in model.modules()] == flags
    assert [p.requires_grad for p in model.parameters()] == requires
    assert all(b is buffers[name] for name, b in model.named_buffers())
    assert [
        (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks), len(m._backward_pre_hooks))
        for m in model.modules()
    ] == hooks
    assert torch.equal(torch.get_rng_state(), rng)
    # the user's hook ran during the steps, the two memory steps and the split-backward measure (one forward of the
    # model, then the unit alone: once for what I keeps, six times to time I and W), and is still there
    assert len(seen) == 13
    model(x)
    assert len(seen) == 14
    # no saved-tensor hooks left behind: autograd's own in-place check works again
    a = torch.randn(3, requires_grad=True).sigmoid()
    a.mul_(2)
    with pytest.raises(RuntimeError, match="inplace"):
        a.sum().backward()


def test_state_is_restored_after_a_failure():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(5, 2))
    model.eval()
    with pytest.raises(ValueError):
        profile(model, torch.randn(2, 4), progress=False)
    assert not model.training and not model[0].training
    assert all(len(m._forward_hooks) == 0 and len(m._forward_pre_hooks) == 0 for m in model.modules())
    assert all(p.grad is None for p in model.parameters())


# -- persistence and display ------------------------------------------------------------------
def test_csv_round_trip_keeps_df_and_meta(sleepy_profile, tmp_path):
    path = tmp_path / "p.csv"
    sleepy_profile.to_csv(path)
    back = Profile.read_csv(path)
    assert back == sleepy_profile
    assert (
        back.meta == sleepy_profile.meta and back.coverage == sleepy_profile.coverage and back.cv == sleepy_profile.cv
    )
    assert back.layer_names == ("0", "1")  # digit names stay strings
    assert back.df["peak_bytes"].tolist() == sleepy_profile.df["peak_bytes"].tolist()


def test_plot_and_html(sleepy_profile):
    import matplotlib.pyplot as plt

    ax = sleepy_profile.plot()
    assert len(ax.patches) == 2 * sleepy_profile.n_layers  # forward and backward bars
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "1"]
    assert len(ax.figure.axes) == 2  # the memory twin axis
    assert "coverage" in ax.get_title()
    plt.close(ax.figure)
    html = sleepy_profile._repr_html_()
    assert "coverage" in html and "fwd_ms" in html and "Sleep" in html
    assert "coverage" in repr(sleepy_profile)


# -- bad input --------------------------------------------------------------------------------
class NotSequential(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.head = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            dict(layers=None),
            ValueError,
            r"layers=None takes the children of an nn.Sequential, but model is a NotSequential; "
            r".*layers=\['embed', 'blocks\.\*', 'head', 'unused'\]",
        ),
        (
            dict(layers=["blocks.*", "tail"]),
            ValueError,
            r"layers pattern 'tail' matches no submodule of the NotSequential; "
            r"available names: 'embed', 'blocks', 'head', 'unused'",
        ),
        (dict(layers=["blocks.9"]), ValueError, r"available names: 'blocks.0', 'blocks.1'"),
        (dict(layers=["blocks", "blocks.0"]), ValueError, r"layers overlap: 'blocks.0' is inside 'blocks'"),
        (dict(layers=["embed", "unused"]), ValueError, r"layers \['unused'\] never ran in the step"),
        (dict(layers=[]), ValueError, r"layers=\[\] is invalid"),
        (dict(layers=[3]), TypeError, "layers entries must be str"),
        (dict(layers="embed", repeats=0), ValueError, "repeats=0 is invalid; it must be >= 1"),
        (dict(layers="embed", repeats=2.0), TypeError, "repeats must be an integer"),
        (dict(layers="embed", warmup=-1), ValueError, "warmup=-1 is invalid; it must be >= 0"),
        (dict(layers="embed", target=torch.zeros(2)), ValueError, "target was given without loss_fn"),
        (dict(layers="embed", loss_fn="mse"), TypeError, "loss_fn must be callable"),
        (
            dict(layers="embed", loss_fn=lambda out: out * 2),
            ValueError,
            r"loss_fn must return a scalar tensor; it returned shape \[2, 2\]",
        ),
        (
            dict(layers="embed", loss_fn=F.cross_entropy, target=torch.zeros(3, dtype=torch.long)),
            ValueError,
            r"loss_fn failed on the model output \(shapes \[\[2, 2\]\]\) and target \(shapes \[\[3\]\]\): "
            r"ValueError: Expected input batch_size \(2\) to match target batch_size \(3\)",
        ),
        (
            dict(layers="embed", device="meta"),
            ValueError,
            "device='meta' is not supported by the profiler; use a 'cpu' or 'cuda' device",
        ),
        (dict(layers="embed", progress="yes"), TypeError, "progress must be True or False"),
    ],
)
def test_bad_input_messages(kwargs, error, message):
    with pytest.raises(error, match=message):
        profile(NotSequential(), torch.randn(2, 4), **{"warmup": 0, "repeats": 1, **kwargs})


def test_sample_that_does_not_fit_names_layer_and_shapes():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(30, 4))
    message = (
        r"the sample does not fit the model: RuntimeError at layer '2' \(Linear\) "
        r"with input shapes \{'input': \[8, 32\]\} "
        r"and parameter shapes \{'weight': \[4, 30\], 'bias': \[4\]\}; sample shapes \[\[8, 16\]\]"
    )
    with pytest.raises(ValueError, match=message):
        profile(model, torch.randn(8, 16), progress=False)


def test_sample_failure_inside_a_unit_names_the_inner_layer():
    model = NotSequential()
    model.blocks[1] = nn.Sequential(nn.Linear(4, 3), nn.Linear(5, 4))
    with pytest.raises(
        ValueError, match=r"in unit 'blocks.1' at layer 'blocks.1.1' \(Linear\) with input shapes \{'input': \[2, 3\]\}"
    ):
        profile(model, torch.randn(2, 4), layers=["embed", "blocks.*", "head"], progress=False)


def test_model_without_trainable_parameters_is_refused():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    model.requires_grad_(False)
    with pytest.raises(ValueError, match=r"model \(Sequential\) has no trainable parameters"):
        profile(model, torch.randn(1, 2))


def test_other_bad_calls():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module; got function"):
        profile(lambda x: x, torch.randn(1))
    with pytest.raises(ValueError, match="profile needs a sample input"):
        profile(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="step must be a callable"):
        profile_step(nn.Sequential(nn.Linear(2, 2)), 3)


def test_select_units_glob_stays_within_a_segment():
    model = NotSequential()
    model.blocks[0] = nn.Sequential(nn.Linear(4, 4))
    assert [n for n, _ in select_units(model, ["blocks.*"])] == ["blocks.0", "blocks.1"]
    assert [n for n, _ in select_units(model, ["*"])] == ["embed", "blocks", "head", "unused"]
    assert [n for n, _ in select_units(nn.Sequential(nn.Linear(1, 1), nn.ReLU()), None)] == ["0", "1"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA path: needs a GPU")
def test_cuda_path_uses_events_and_reports_peak_memory():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).cuda()
    prof = profile(model, torch.randn(64, 256, device="cuda"), repeats=3, warmup=1, progress=False)
    assert prof.meta["timer"] == "cuda_events" and prof.meta["device"].startswith("cuda")
    assert (prof.df["fwd_ms"] > 0).all() and (prof.df["bwd_ms"] > 0).all()
    assert prof.df["peak_bytes"].notna().all() and (prof.df["peak_bytes"] >= 0).all()
    assert 0.3 < prof.coverage < 1.5


# -- memory -------------------------------------------------------------------------------------
def test_memory_step_counts_saved_tensors_outputs_weight_gradients_and_the_loss():
    # Linear(16 -> 32) on 8 rows: saves its 8x16 input (the sample, not counted: it existed before), returns 8x32;
    # its backward allocates the 32x16 weight and 32 bias gradients (the first micro-batch: they become .grad)
    # and the 8x16 input gradient is not needed (the sample does not require grad)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    prof = profile(model, x, target=y, loss_fn=F.mse_loss, repeats=1, warmup=0, progress=False)
    first, second = prof.df.iloc[0], prof.df.iloc[1]
    assert first["output_bytes"] == 8 * 32 * 4 and first["largest_param_bytes"] == 32 * 16 * 4
    assert first["peak_bytes"] >= 8 * 32 * 4  # its forward keeps its output
    assert first["transient_bytes"] == (32 * 16 + 32) * 4  # exactly its weight gradients, made in its backward
    assert second["transient_bytes"] == (4 * 32 + 4) * 4 + 8 * 32 * 4  # weight gradients and the input gradient
    # mse_loss keeps an 8x4 tensor for its backward, whose gradient of the output is 8x4 again
    assert 8 * 4 * 4 <= prof.meta["loss_activation_bytes"] <= 8 * 4 * 4 + 16
    assert 8 * 4 * 4 <= prof.meta["loss_transient_bytes"] <= 8 * 4 * 4 + 16
    step_only = profile_step(model, lambda: F.mse_loss(model(x), y).backward(), repeats=1, warmup=0, progress=False)
    assert step_only.df["peak_bytes"].isna().all()  # the user's own step runs as many times as asked, no more
