"""The caller's split travels in the spec, and a rank's stages unpickled from it are the stages a trace of its own
would give, without tracing (pipeswift_lab/runner/stages/shipped.py)."""

import subprocess
import sys
import textwrap

import pytest
import torch
from model_zoo import build, halves
from tiny_transformers import M, lm_loss, tokens
from torch import nn

from pipeswift_lab.runner import make_spec
from pipeswift_lab.runner.stages.shipped import pickled_split, unpickled_split
from pipeswift_lab.runner.stages.traced import trace

pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def described(pipe):
    """Each stage's code, every graph of its submodules, its tensors (name, shape, dtype, meta) and the shapes its
    placeholders and output carry; the split graph that joins the stages."""
    out = []
    for s in range(pipe.num_stages):
        stage = pipe.get_stage_module(s)
        nodes = [n for n in stage.graph.nodes if n.op in ("placeholder", "output")]
        vals = [tuple(n.meta["val"].shape) for n in nodes if n.op == "placeholder"]
        outputs = [tuple(n.meta["val"].shape) for n in nodes[-1].all_input_nodes]
        graphs = [(name, type(m).__name__, str(getattr(m, "graph", None))) for name, m in stage.named_modules()]
        tensors = {k: (tuple(t.shape), t.dtype, t.is_meta) for k, t in stage.state_dict().items()}
        out.append((stage.code, graphs, tensors, vals, outputs))
    return out, str(pipe.split_gm.graph)


@pytest.mark.parametrize("family", ["Qwen2", "Mixtral", "GptOss"])  # a tied head; experts; sinks and biased experts
def test_a_rank_unpickles_the_callers_split_without_tracing(family, monkeypatch):
    model = build(family, "meta")
    x, y = tokens()
    spec = make_spec(model, (x, y), lm_loss, halves(build(family)), M)
    traced = spec.traced
    assert isinstance(traced.split, bytes) and traced.split_device == "cpu"
    shipped = unpickled_split(traced.split)
    assert all(t.is_meta for t in shipped.split_gm.state_dict().values())  # no values travel, only shapes
    cpu = torch.device("cpu")
    tracing = described(trace(spec.model, traced.example, traced.split_names, cpu))

    def refused(*args, **kwargs):
        raise AssertionError("the rank exported the model")

    monkeypatch.setattr(torch.export, "export", refused)
    with pytest.raises(ValueError) as tracing_again:  # the check below would see a trace
        trace(spec.model, traced.example, traced.split_names, cpu)
    chain, error = [], tracing_again.value
    while error is not None:
        chain, error = chain + [str(error)], error.__cause__
    assert "the rank exported the model" in chain
    assert described(trace(spec.model, traced.example, traced.split_names, cpu, traced.split)) == tracing


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.second(self.first(x).relu())


def test_a_split_naming_an_operator_this_process_lacks_is_traced_here_instead(tmp_path):
    """A split whose graph calls an operator registered in the caller only (a library the rank has not imported)."""
    made = tmp_path / "split.pkl"
    script = textwrap.dedent(
        f"""
        import torch
        from torch import nn
        from pipeswift_lab.runner.stages.shipped import pickled_split
        from pipeswift_lab.runner.stages.traced import trace

        @torch.library.custom_op("pslcaller::twice", mutates_args=())
        def twice(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        twice.register_fake(lambda x: torch.empty_like(x))

        class Custom(nn.Module):
            def __init__(self):
                super().__init__()
                self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 4)

            def forward(self, x):
                return self.second(twice(self.first(x)))

        pipe = trace(Custom(), torch.randn(2, 4), ("second",), torch.device("cpu"))
        open({str(made)!r}, "wb").write(pickled_split(pipe))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    split = made.read_bytes()
    assert b"pslcaller" in split
    assert unpickled_split(split) is None  # not registered here
    pipe = trace(Plain(), torch.randn(2, 4), ("second",), torch.device("cpu"), split)  # traced here instead
    ops = {str(n.target) for n in pipe.get_stage_module(0).graph.nodes}
    assert any("relu" in op for op in ops) and not any("pslcaller" in op for op in ops)


def test_a_split_that_does_not_pickle_travels_as_nothing():
    pipe = trace(Plain(), torch.randn(2, 4), ("second",), torch.device("cpu"))
    pipe.get_stage_module(0).graph.nodes.__iter__().__next__().meta["note"] = lambda: None  # a local function
    assert pickled_split(pipe) is None


def test_a_setting_changed_between_two_runs_is_traced_again():
    """The ranks run the split the caller traced, so a cached one must follow what the forward depends on."""
    model = build("Llama")
    x, y = tokens()
    part = halves(model)
    first = make_spec(model, (x, y), lm_loss, part, M).traced.split
    assert make_spec(model, (x, y), lm_loss, part, M).traced.split is first  # the same model: traced once
    model.config._attn_implementation = "eager" if model.config._attn_implementation != "eager" else "sdpa"
    changed = make_spec(model, (x, y), lm_loss, part, M).traced.split
    assert changed is not first
    model.model.layers[0].self_attn.scaling = 0.5  # a plain setting of one module
    assert make_spec(model, (x, y), lm_loss, part, M).traced.split is not changed


def interpreted(pipe):
    """``{stage: [names of the submodules still run by torch.fx.Interpreter]}`` and how many can be."""
    out, total = {}, 0
    for s in range(pipe.num_stages):
        runners = {n: m for n, m in pipe.get_stage_module(s).named_modules() if hasattr(m, "_run_with_interpreter")}
        total += len(runners)
        out[s] = [n for n, m in runners.items() if m._run_with_interpreter]
    return out, total


def test_the_stages_run_their_generated_code_but_where_a_node_is_named_self():
    from tiny_transformers import bert

    llama = build("Llama")
    x, _ = tokens()
    pipe = trace(llama, x[:2], ("model.layers.1",), torch.device("cpu"))
    still, total = interpreted(pipe)
    assert total > 10 and still == {0: [], 1: []}
    assert not interpreted(unpickled_split(pickled_split(pipe)))[0][0]  # so do the ranks' copies
    pipe = trace(bert(), x[:2], ("bert.encoder.layer.2",), torch.device("cpu"))
    still, _ = interpreted(pipe)
    # BertAttention calls its submodule `self`: its generated forward(self, ...) would rebind self
    assert still[0] == ["bert.encoder.layer.0.attention", "bert.encoder.layer.1.attention"]
    assert still[1] == ["bert.encoder.layer.2.attention", "bert.encoder.layer.3.attention"]
