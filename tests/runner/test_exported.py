"""The caller's exported program travels in the spec, and a rank's stages split from it are the stages an export of
its own would give, without exporting (pipeswift_lab/runner/stages/exported.py)."""

import pytest
import torch
from model_zoo import build, halves
from tiny_transformers import M, lm_loss, tokens

from pipeswift_lab.runner import make_spec
from pipeswift_lab.runner.stages.exported import loaded
from pipeswift_lab.runner.stages.traced import trace

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def described(pipe):
    """Each stage's code, tensors (name, shape, dtype) and the shapes its placeholders and output carry."""
    out = []
    for s in range(pipe.num_stages):
        stage = pipe.get_stage_module(s)
        nodes = [n for n in stage.graph.nodes if n.op in ("placeholder", "output")]
        vals = [tuple(n.meta["val"].shape) for n in nodes if n.op == "placeholder"]
        outputs = [tuple(n.meta["val"].shape) for n in nodes[-1].all_input_nodes]
        tensors = {k: (tuple(t.shape), t.dtype, t.is_meta) for k, t in stage.state_dict().items()}
        out.append((stage.code, tensors, vals, outputs))
    return out


@pytest.mark.parametrize("family", ["Qwen2", "Mixtral", "GptOss"])  # a tied head; experts; sinks and biased experts
def test_a_rank_splits_the_callers_program_without_exporting(family, monkeypatch):
    model = build(family, "meta")
    x, y = tokens()
    spec = make_spec(model, (x, y), lm_loss, halves(build(family)), M)
    traced = spec.traced
    assert isinstance(traced.exported, bytes)
    assert all(t.is_meta for t in loaded(traced.exported).state_dict.values())  # no values travel, only shapes
    cpu = torch.device("cpu")
    exporting = described(trace(spec.model, traced.example, traced.split_names, cpu))

    def refused(*args, **kwargs):
        raise AssertionError("the rank exported the model")

    monkeypatch.setattr(torch.export, "export", refused)
    with pytest.raises(ValueError) as exporting_again:  # the check below would see an export
        trace(spec.model, traced.example, traced.split_names, cpu)
    chain, error = [], exporting_again.value
    while error is not None:
        chain, error = chain + [str(error)], error.__cause__
    assert "the rank exported the model" in chain
    split = described(trace(spec.model, traced.example, traced.split_names, cpu, traced.exported))
    assert split == exporting


def test_a_setting_changed_between_two_runs_is_traced_again():
    """The ranks run the program the caller traced, so a cached one must follow what the forward depends on."""
    model = build("Llama")
    x, y = tokens()
    part = halves(model)
    first = make_spec(model, (x, y), lm_loss, part, M).traced.exported
    assert make_spec(model, (x, y), lm_loss, part, M).traced.exported is first  # the same model: traced once
    model.config._attn_implementation = "eager" if model.config._attn_implementation != "eager" else "sdpa"
    changed = make_spec(model, (x, y), lm_loss, part, M).traced.exported
    assert changed is not first
    model.model.layers[0].self_attn.scaling = 0.5  # a plain setting of one module
    assert make_spec(model, (x, y), lm_loss, part, M).traced.exported is not changed
