"""The zoo (tests/model_zoo.py): every decoder family of the installed transformers that it lists, mixtures of experts
among them, trained at P=2 on the meta device from its ``save_pretrained`` folder (and eager, for the families in
``EAGER``), each equal to the family's ``from_pretrained`` model trained in one process; the trained model written back
as the family writes it.

When a transformers release breaks a family (a forward that branches on its device, a renamed or fused checkpoint
tensor), this file says so first. Runs use SGD: the micro-batch sums round differently from one batch (below 1e-8),
which Adam's normalized step would make 1e-7 to 1e-6.
"""

import glob

import pytest
import torch
from model_zoo import FAMILIES, MOE, STORED_PER_EXPERT, build, halves, model_class
from tiny_transformers import M, lm_loss, single_process, tokens
from torch import nn

from pipeswift_lab import Launch
from pipeswift_lab.runner import make_spec, run
from pipeswift_lab.runner.stages.traced import trace

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


#: The families also trained eager (the caller's model, its weights shipped by the caller). Both paths trace the
#: same way (fake tensors, a meta model either way) and build the same stages; what differs is where a rank reads
#: its tensors: the caller's own state dict by its own names (the same for every family), or the family's checkpoint
#: with its stored names (renamed, per expert, fused), which every family runs below. So the eager run is kept for a
#: tied head and for experts stored fused, not repeated for all 22: a plain decoder (Llama) and experts stored one
#: tensor per expert (Mixtral) run eager in test_layouts_hf.py, Llama in test_hf_models.py too.
EAGER = ("Qwen2", "GptOss")


def worst(got, want):
    assert sorted(got) == sorted(want)
    return max((got[k] - want[k]).abs().max().item() for k in want)


def stored_names(folder):
    from safetensors import safe_open

    return {k for f in glob.glob(f"{folder}/*.safetensors") for k in safe_open(f, "pt").keys()}


@pytest.mark.processes
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_trains_from_its_checkpoint_on_meta_as_from_pretrained_does(family, tmp_path):
    model = build(family)
    model.save_pretrained(tmp_path / "hf")
    reference = model_class(family).from_pretrained(tmp_path / "hf")
    x, y = tokens()
    want = single_process(reference, x, y, 3, optimizer=sgd)
    part = halves(model)
    kw = dict(steps=3, optimizer=sgd, progress=False, launch=Launch(timeout_s=240))
    if family in EAGER:
        eager = run(model, (x, y), lm_loss, part, M, **kw)
        assert worst(eager.state_dict(), want) <= 1e-5
    meta = run(build(family, "meta"), (x, y), lm_loss, part, M, weights=tmp_path / "hf", **kw)
    assert worst(meta.state_dict(), want) <= 1e-5
    # written back as the family writes it: its names (per-expert tensors, a renamed head), read by from_pretrained
    meta.save_pretrained(tmp_path / "trained")
    assert stored_names(tmp_path / "trained") == stored_names(tmp_path / "hf")
    back = model_class(family).from_pretrained(tmp_path / "trained").state_dict()
    assert worst(back, meta.state_dict()) == 0.0


def stage_keys(spec):
    """Every traced stage's ``state_dict`` keys, from the split the ranks get (the caller's, unpickled)."""
    traced = spec.traced
    pipe = trace(spec.model, traced.example, traced.split_names, torch.device("cpu"), traced.split)
    return [list(pipe.get_stage_module(s).state_dict()) for s in range(pipe.num_stages)]


def layer_of(name):
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1]) if "layers" in parts else None


@pytest.mark.parametrize("family", list(MOE) + ["GPTNeoX"])
def test_each_stage_reads_only_the_stored_tensors_of_its_own_layers(family, tmp_path):
    model = build(family)
    model.save_pretrained(tmp_path / "hf")
    x, y = tokens()
    part = halves(model)
    spec = make_spec(build(family, "meta"), (x, y), lm_loss, part, M, weights=tmp_path / "hf")
    stored = stored_names(tmp_path / "hf")
    traced_keys = stage_keys(spec)
    per_stage = [spec.weights.stored_names([k for k in keys if k in spec.weights]) for keys in traced_keys]
    assert set(per_stage[0]) | set(per_stage[1]) == stored  # every stored tensor is read
    tied = spec.weights.stored_names([g.canonical for g in spec.tied])  # a tied head: the embedding, by both ends
    assert set(per_stage[0]) & set(per_stage[1]) == set(tied)  # and nothing else by two stages
    for s, names in enumerate(per_stage):  # a decoder layer's tensors, experts and all, are read by its stage alone
        assert {layer_of(n) for n in names} - {None} == {layer_of(n) for n in part.layer_names[s]} - {None}
    reference = model_class(family).from_pretrained(tmp_path / "hf").state_dict()
    for keys in traced_keys:  # what a rank reads is what from_pretrained loads
        keys = [k for k in keys if k in spec.weights]  # not the rotary tables, which no checkpoint holds
        got = spec.weights.read(keys, "cpu", spec.model)
        assert worst(got, {k: reference[k] for k in keys}) == 0.0
    if family in STORED_PER_EXPERT:  # the experts are stored one tensor per expert, the model holds them fused
        assert spec.weights.converted and all(len(c.sources) >= 4 for c in spec.weights.converted.values())
    if family in ("GPTNeoX", "GraniteMoe"):  # stored under other names
        assert spec.weights.renamed


def test_a_checkpoint_from_pretrained_would_refuse_is_refused_naming_the_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    model = build("Mixtral")
    model.save_pretrained(tmp_path / "hf")
    state = load_file(str(tmp_path / "hf" / "model.safetensors"))
    x, y = tokens()
    meta, part = build("Mixtral", "meta"), halves(model)
    broken = dict(state)
    del broken["model.layers.1.self_attn.q_proj.weight"]
    broken["model.layers.1.extra.weight"] = torch.zeros(2)
    broken["model.layers.1.block_sparse_moe.experts.3.w1.weight"] = torch.zeros(64, 31)
    save_file(broken, str(tmp_path / "broken.safetensors"))
    with pytest.raises(ValueError) as refused:
        make_spec(meta, (x, y), lm_loss, part, M, weights=tmp_path / "broken.safetensors")
    message = str(refused.value)
    assert "not in the weights (1): ['model.layers.1.self_attn.q_proj.weight']" in message
    assert "only in the weights (1): ['model.layers.1.extra.weight']" in message
    # the fused tensor an expert of the wrong shape would make, named by the model's name and the stored ones
    assert "conversion cannot make (1): model.layers.1.mlp.experts.gate_up_proj" in message
    assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in message


class DeviceBranch(nn.Module):
    """A forward that takes another op on the CPU than elsewhere, as transformers' MoE histogram does."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x):
        h = self.first(x)
        h = h.tanh() if h.device.type == "cpu" else h.sigmoid()
        return self.second(h)


def test_a_stage_is_traced_with_the_branch_of_the_device_it_runs_on():
    model = DeviceBranch()
    pipe = trace(model, torch.randn(2, 8), ("second",), torch.device("cpu"))
    ops = {str(n.target) for s in range(pipe.num_stages) for n in pipe.get_stage_module(s).graph.nodes}
    assert any("tanh" in op for op in ops) and not any("sigmoid" in op for op in ops)
    with torch.device("meta"):
        on_meta = DeviceBranch()
    pipe = trace(on_meta, torch.randn(2, 8), ("second",), torch.device("cpu"))  # a meta model traced for the CPU
    ops = {str(n.target) for s in range(pipe.num_stages) for n in pipe.get_stage_module(s).graph.nodes}
    assert any("tanh" in op for op in ops) and not any("sigmoid" in op for op in ops)
    assert all(t.is_meta for s in range(pipe.num_stages) for t in pipe.get_stage_module(s).state_dict().values())
    from pipeswift_lab.core.fake_device import is_fake

    assert all(t.is_meta and not is_fake(t) for t in on_meta.state_dict().values())  # each keeps its own tensors
    assert not any(t.is_meta or is_fake(t) for t in model.state_dict().values())


class Gated(nn.Module):
    """A block whose forward reads a tensor's value (an ``if`` on it): torch.export cannot capture it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        h = self.linear(x)
        return h if h.sum() > 0 else -h


def test_a_forward_the_tracer_cannot_capture_is_refused_naming_its_module():
    model = nn.ModuleDict({"first": nn.Linear(8, 8), "gated": Gated()})

    class Holder(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = model

        def forward(self, x):
            return self.blocks["gated"](self.blocks["first"](x))

    with pytest.raises(ValueError, match=r'(?s)it failed in blocks\.gated \(Gated\).*split="manual"'):
        trace(Holder(), torch.randn(2, 8), ("blocks.gated",), torch.device("cpu"))
