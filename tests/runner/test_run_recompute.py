"""Activation recomputation in the stages (pipeswift_lab.core.recompute): the choices are checked before
launch, and a run that recomputes trains to the same parameters, bit for bit, as one that does not, dropout on."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeswift_lab.core.recompute import SAVED_OPS, plan_recompute
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.measure import profile
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.runner import make_spec, run


class Block(nn.Module):
    """A pre-LN FFN block with dropout: ``x + drop(down(gelu(up(ln(x)))))``."""

    def __init__(self, d=16, p=0.1):
        super().__init__()
        self.ln, self.up, self.down, self.drop = (
            nn.LayerNorm(d),
            nn.Linear(d, 4 * d),
            nn.Linear(4 * d, d),
            nn.Dropout(p),
        )

    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(self.ln(x)))))


def model():
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(4)])


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 5, 16, generator=g), torch.randn(8, 5, 16, generator=g)


STAGES = (("0", "1"), ("2", "3"))
#: The partitions' layers (named as the model's blocks) and costs: what a partition needs here, without profiling the
#: model for it (the runs measure their own times and memory; the profiler's recompute columns are tested below)
LAYERS = Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4, name=["0", "1", "2", "3"])


def test_the_choices_name_the_layers_of_each_stage():
    assert plan_recompute(None, STAGES) is None
    assert plan_recompute("full", STAGES).layers == STAGES and plan_recompute("full", STAGES).modes == ("full",) * 2
    assert plan_recompute("selective", STAGES).modes == ("selective", "selective")
    chosen = plan_recompute({1: ["*"], 0: ["1"]}, STAGES)
    assert chosen.modes == ("full", "full") and chosen.layers == (("1",), ("2", "3"))
    per_stage = plan_recompute({0: "selective"}, STAGES)
    assert per_stage.layer_modes() == {"0": "selective", "1": "selective"} and per_stage.stage_mode(1) == ""
    assert torch.ops.aten.mm.default in SAVED_OPS and torch.ops.aten.gelu.default not in SAVED_OPS


@pytest.mark.parametrize(
    "bad, error, message",
    [
        ("some", ValueError, r"recompute='some' is not one of \['full', 'selective'\]"),
        ({2: ["0"]}, ValueError, r"recompute has stage 2; the partition has stages 0..1"),
        ({0: ["blocks.*"]}, ValueError, r"recompute\[0\] names 'blocks.\*', which matches none of stage 0's layers"),
        ({0: "0"}, ValueError, r"recompute\[0\]='0' is not one of \['full', 'selective'\]"),
        (["full"], TypeError, r"recompute must be None, 'full', 'selective' or a dict"),
    ],
)
def test_a_bad_choice_is_refused_before_launch(bad, error, message):
    x, y = batch()
    with pytest.raises(error, match=message):
        make_spec(model(), (x, y), F.mse_loss, partition(LAYERS, 2), 4, recompute=bad)


#: The runs of :func:`trained`, one per (schedule, recompute): a run is deterministic, so tests share it
_TRAINED = {}


def trained(schedule, recompute):
    key = (schedule, repr(recompute))
    if key not in _TRAINED:
        x, y = batch()
        v = 2 if schedule in ("Interleaved1F1B", "ZBVZeroBubble") else 1
        part = Partition.from_bounds(LAYERS, ((0, 1), (1, 2), (2, 3), (3, 4)) if v == 2 else ((0, 2), (2, 4)), v=v,
                                     schedule=schedule, m=4)  # fmt: skip
        adam = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
        _TRAINED[key] = run(model(), (x, y), F.mse_loss, part, 4, steps=3, optimizer=adam, progress=False,
                            recompute=recompute)  # fmt: skip
    return _TRAINED[key]


@pytest.mark.processes
@pytest.mark.parametrize(
    "schedule, recompute",
    [("1F1B", "selective"), ("GPipe", "full"), ("Interleaved1F1B", "full"), ("ZBVZeroBubble", "selective")],
)
def test_recomputing_trains_to_the_same_parameters_bit_for_bit(schedule, recompute):
    """Dropout is on: the recomputed forward draws the masks the first one drew (the checkpoint restores the random
    state), or the parameters would differ; the zero-bubble schedules recompute in both their I and W passes."""
    plain, again = trained(schedule, None), trained(schedule, recompute)
    got, want = again.state_dict(), plain.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert again.meta["recompute"] == recompute


@pytest.mark.processes
def test_full_recomputation_holds_less_and_a_dict_picks_layers():
    plain, full = trained("GPipe", None), trained("GPipe", "full")
    first = trained("GPipe", {0: ["0"]})  # only the first block of stage 0
    held = {name: r.memory.set_index("rank")["measured_activations_before_backward_bytes"] for name, r in
            (("plain", plain), ("full", full), ("first", first))}  # fmt: skip
    assert (held["full"] < held["plain"]).all()
    assert held["full"][0] < held["first"][0] < held["plain"][0] and held["first"][1] == held["plain"][1]
    assert all(torch.equal(first.state_dict()[k], plain.state_dict()[k]) for k in plain.state_dict())


@pytest.fixture(scope="module")
def wide_blocks():
    """Four width-64 blocks without dropout, a batch, and their profile with the recompute columns (one for both
    schedules)."""
    torch.manual_seed(0)
    net = nn.Sequential(*[Block(d=64, p=0.0) for _ in range(4)])
    x, y = torch.randn(16, 32, 64), torch.randn(16, 32, 64)
    prof = profile(net, x[:4], target=y[:4], loss_fn=F.mse_loss, warmup=1, repeats=1, progress=False, recompute=True)
    return net, x, y, prof


@pytest.mark.processes
@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_the_run_predicts_its_memory_recomputed(schedule, wide_blocks):
    """RunResult.memory replays the layers as they cost recomputed (the profile's recompute columns); under the
    zero-bubble schedules what an I pass computes again is held until its W."""
    net, x, y, prof = wide_blocks
    v = 2 if schedule == "ZBVZeroBubble" else 1
    part = partition(prof, 2, v=v, schedule=schedule, m=4)
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-3)  # noqa: E731
    peaks = {}
    for recompute in (None, "full"):
        result = run(net, (x, y), F.mse_loss, part, 4, steps=2, optimizer=adam, progress=False, recompute=recompute)
        assert (result.memory["error"].abs() <= 0.10).all(), result.memory[["rank", "error", "term_off"]]
        peaks[recompute] = result.memory["measured_peak_bytes"]
    assert (peaks["full"] < peaks[None]).all()


@pytest.fixture(scope="module")
def llama_profiled():
    """A LlamaForCausalLM as built (KV cache on), a batch, its loss, and its profile with the recompute columns (one
    for both schedules)."""
    from tiny_transformers import VOCAB, llama

    model = llama()
    assert model.config.use_cache
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, VOCAB, (8, 16), generator=g), torch.randint(0, VOCAB, (8, 16), generator=g)

    def lm_loss(out, target):
        return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())

    prof = profile(model, x[:2], target=y[:2], loss_fn=lm_loss, layers="auto", warmup=1, repeats=1, progress=False,
                   recompute=True)  # fmt: skip
    assert model.config.use_cache  # given back as it was
    return model, x, y, lm_loss, prof


@pytest.mark.processes
@pytest.mark.parametrize("schedule, recompute", [("1F1B", "selective"), ("ZBVZeroBubble", "full")])
def test_a_hf_llama_recomputes_as_profiled_and_trains_bit_for_bit(schedule, recompute, llama_profiled):
    """A LlamaForCausalLM with its KV cache on, as built: the profiler and the runner train it with the cache off (a
    cache grown in the forward would make the recomputed forward differ), its blocks are recomputed per stage, and
    the parameters equal those of the run without, bit for bit; the profile says what each block keeps."""
    model, x, y, lm_loss, prof = llama_profiled
    assert model.config.use_cache
    blocks = prof.df[prof.df["name"].str.startswith("model.layers.")]
    assert (blocks["full_activation_bytes"] < blocks["selective_activation_bytes"]).all()
    assert (blocks["selective_activation_bytes"] < blocks["activation_bytes"]).all()
    part = partition(prof, 2, v=2 if schedule == "ZBVZeroBubble" else 1, schedule=schedule, m=4)
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-3)  # noqa: E731
    plain, again = (run(model, (x, y), lm_loss, part, 4, steps=2, optimizer=adam, progress=False, recompute=rc)
                    for rc in (None, recompute))  # fmt: skip
    want, got = plain.state_dict(), again.state_dict()
    assert list(got) == list(model.state_dict())
    assert all(torch.equal(got[k], want[k]) for k in want)
