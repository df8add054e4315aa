"""Tests for ``layers="auto"`` (pipeswift_lab.profiling.units.auto_units): the repeated blocks of a model and the
modules with parameters before and after them, on small transformers models built from configs (no downloads)."""

import pytest
import tiny_transformers
import torch
from torch import nn

from pipeswift_lab.profiling.measure import profile
from pipeswift_lab.profiling.units import find_blocks, select_units

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LLAMA_UNITS = [
    "model.embed_tokens",
    "model.layers.0",
    "model.layers.1",
    "model.layers.2",
    "model.layers.3",
    "model.norm",
    "lm_head",
]
GPT2_UNITS = ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.h.2"]
GPT2_UNITS += ["transformer.ln_f", "lm_head"]


@pytest.fixture(scope="module")
def llama():
    return tiny_transformers.llama()


@pytest.fixture(scope="module")
def gpt2():
    return tiny_transformers.gpt2(n_layer=3)


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.linear(x))


class Tower(nn.Module):
    """A stem, a ModuleDict of three blocks (next to a two-Linear list that is shorter), a parameterless activation
    and a head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.pair = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.trunk = nn.ModuleDict({"first": Block(8), "second": Block(8), "third": Block(8)})
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.act(self.stem(x))
        for linear in self.pair:
            x = linear(x)
        for block in self.trunk.values():
            x = block(x)
        return self.head(x)


def names(units):
    return [n for n, _ in units]


def test_auto_finds_the_llama_decoder_layers(llama, capsys):
    assert names(select_units(llama, "auto")) == LLAMA_UNITS  # rotary_emb holds buffers only: not a unit
    line = (
        'layers="auto": 4 × LlamaDecoderLayer in model.layers, '
        "with model.embed_tokens before and model.norm, lm_head after\n"
    )
    assert capsys.readouterr().out == line


def test_auto_keeps_both_tied_gpt2_modules(gpt2, capsys):
    assert gpt2.lm_head.weight is gpt2.transformer.wte.weight  # tied, yet two modules: two units
    assert names(select_units(gpt2, "auto")) == GPT2_UNITS  # transformer.drop has no parameters
    line = (
        'layers="auto": 3 × GPT2Block in transformer.h, '
        "with transformer.wte, transformer.wpe before and transformer.ln_f, lm_head after\n"
    )
    assert capsys.readouterr().out == line


@pytest.mark.parametrize("model_name,expected", [("llama", LLAMA_UNITS), ("gpt2", GPT2_UNITS)])
def test_profile_with_auto_layers_runs_on_transformers_models(model_name, expected, input_ids, request, capsys):
    model = request.getfixturevalue(model_name)
    prof = profile(model, input_ids, layers="auto", warmup=1, repeats=2, progress=False)
    assert list(prof.layer_names) == expected
    assert prof.df["calls"].tolist() == [1] * len(expected)
    assert capsys.readouterr().out.startswith('layers="auto": ')


def test_auto_takes_the_longest_container_of_one_class_in_a_module_dict(capsys):
    model = Tower()
    expected = ["stem", "pair.0", "pair.1", "trunk.first", "trunk.second", "trunk.third", "head"]
    assert names(select_units(model, "auto")) == expected  # a ModuleList never runs itself: its children are units
    line = 'layers="auto": 3 × Block in trunk, with stem, pair.0, pair.1 before and head after\n'
    assert capsys.readouterr().out == line
    prof = profile(model, torch.randn(3, 4), layers="auto", warmup=1, repeats=2, progress=False)
    assert list(prof.layer_names) == expected


def test_auto_ties_go_to_the_shallowest_then_the_first():
    inner = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    outer = nn.ModuleList([nn.Tanh(), nn.Tanh()])
    model = nn.ModuleDict({"deep": nn.ModuleDict({"inner": inner}), "flat": outer})
    assert find_blocks(model) == ("flat", outer)
    first, second = nn.ModuleList([Block(2), Block(2)]), nn.ModuleList([Block(2), Block(2)])
    model = nn.Module()
    model.a, model.b = first, second
    assert find_blocks(model) == ("a", first)
    model = nn.ModuleDict({"a": first, "b": second})  # the root is itself a container of two ModuleLists
    assert find_blocks(model) == ("", model)


def test_auto_on_a_sequential_of_blocks_takes_its_children(capsys):
    model = nn.Sequential(Block(4), Block(4), Block(4))
    assert names(select_units(model, "auto")) == ["0", "1", "2"]
    assert capsys.readouterr().out == 'layers="auto": 3 × Block in the model itself\n'


def test_auto_without_repeated_blocks_says_what_it_looked_for():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model.extra = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])
    with pytest.raises(ValueError) as info:
        select_units(model, "auto")
    message = str(info.value)
    assert 'layers="auto" looked for repeated blocks' in message
    assert "at least 2 children of one class" in message
    assert "pass layers= a list of submodule names or glob patterns" in message
    assert "'0', '1', '2', 'extra'" in message and "extra.*" in message


def test_names_and_globs_are_unchanged(llama):
    assert names(select_units(llama, "model.layers.*")) == LLAMA_UNITS[1:5]
    assert names(select_units(llama, ["lm_head", "model.norm"])) == ["lm_head", "model.norm"]
    assert names(select_units(nn.Sequential(nn.Linear(1, 1), nn.ReLU()), None)) == ["0", "1"]
    with pytest.raises(ValueError, match="matches no submodule"):
        select_units(llama, ["auto"])  # a list entry is always a pattern


def test_auto_prints_and_orders_the_units_as_they_run(capsys):
    """OPT registers its decoder's final norm before its layers and runs it after them: the profile's rows and its
    printed line follow the run."""
    model = tiny_transformers.opt()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    names = [n for n, _ in select_units(model, "auto", announce=False)]
    assert names.index("model.decoder.final_layer_norm") < names.index("model.decoder.layers.0")  # registration
    prof = profile(model, ids, layers="auto", warmup=1, repeats=1, progress=False)
    blocks = [f"model.decoder.layers.{i}" for i in range(4)]
    order = ["model.decoder.embed_tokens", "model.decoder.embed_positions", *blocks, "model.decoder.final_layer_norm"]
    assert prof.df["name"].tolist() == [*order, "lm_head"]
    assert capsys.readouterr().out == (
        'layers="auto": 4 × OPTDecoderLayer in model.decoder.layers, with model.decoder.embed_tokens, '
        "model.decoder.embed_positions before and model.decoder.final_layer_norm, lm_head after\n"
    )


def test_auto_takes_an_encoder_decoders_two_stacks_and_leaves_out_what_never_runs(capsys):
    model = tiny_transformers.Seq2Seq(tiny_transformers.t5())
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    prof = profile(model, ids, layers="auto", warmup=1, repeats=1, progress=False)
    stack = lambda part: [f"model.{part}.embed_tokens", *(f"model.{part}.block.{i}" for i in range(2))]  # noqa: E731
    want = [*stack("encoder"), "model.encoder.final_layer_norm", *stack("decoder"), "model.decoder.final_layer_norm"]
    assert prof.df["name"].tolist() == [*want, "model.lm_head"]
    assert capsys.readouterr().out == (
        'layers="auto": 2 × T5Block in model.encoder.block and 2 × T5Block in model.decoder.block, with '
        "model.encoder.embed_tokens before and model.encoder.final_layer_norm, model.decoder.embed_tokens between "
        "and model.decoder.final_layer_norm, model.lm_head after; model.shared never ran in a forward and is left "
        "out\n"
    )
