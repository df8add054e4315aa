"""Weights on disk (safetensors, sharded safetensors, DCP, the toolkit's checkpoints) read by name, and every way
``weights=`` or a meta model can be wrong refused before launch, naming the problem."""

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn

from pipeswift_lab.core.meta_device import initial_values, is_meta_model, materialize, name_seed
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.runner import load_spec, make_spec, run
from pipeswift_lab.runner.weights import INDEX_FILE, check_weights, open_weights, write_weights

PART = Partition.from_bounds(Profile.synthetic(fwd_ms=[1.0] * 3, bwd_ms=[1.0] * 3), [(0, 1), (1, 3)])


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def meta_mlp():
    with torch.device("meta"):
        return mlp()


def data():
    return torch.randn(8, 4), torch.randn(8, 2)


def sharded(tmp_path, state, split_at):
    """``state`` as two safetensors shards with Hugging Face's index."""
    keys = list(state)
    shards = {"model-00001-of-00002.safetensors": keys[:split_at], "model-00002-of-00002.safetensors": keys[split_at:]}
    for name, part in shards.items():
        save_file({k: state[k].contiguous() for k in part}, str(tmp_path / name))
    index = {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}
    (tmp_path / INDEX_FILE).write_text(json.dumps(index))
    return tmp_path


def test_every_kind_is_indexed_without_reading_tensors_and_reads_only_the_keys_asked(tmp_path):
    state = mlp().state_dict()
    write_weights(state, tmp_path / "one" / "model.safetensors")
    sharded((tmp_path / "shards").resolve() if (tmp_path / "shards").mkdir() is None else None, state, 2)
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    dcp.save({"model": state}, checkpoint_id=str(tmp_path / "nested"), no_dist=True)
    sources = {
        "file": open_weights(tmp_path / "one" / "model.safetensors"),
        "dir": open_weights(tmp_path / "one"),
        "shards": open_weights(tmp_path / "shards"),
        "index": open_weights(tmp_path / "shards" / INDEX_FILE),
        "dcp": open_weights(tmp_path / "dcp"),
    }
    for name, source in sources.items():
        assert {k: v[0] for k, v in source.shapes.items()} == {k: tuple(t.shape) for k, t in state.items()}, name
        got = source.read(["2.weight"])
        assert list(got) == ["2.weight"] and torch.equal(got["2.weight"], state["2.weight"]), name
    shards = sources["shards"]
    assert shards.files["0.weight"].endswith("00001-of-00002.safetensors")
    assert shards.files["2.bias"].endswith("00002-of-00002.safetensors")
    nested = check_weights(open_weights(tmp_path / "nested"), state, {})
    assert nested.prefix == "model." and torch.equal(nested.read(["0.bias"])["0.bias"], state["0.bias"])


def test_a_tied_weight_is_found_under_whichever_name_the_file_has(tmp_path):
    embed = nn.Embedding(5, 3)
    model = nn.ModuleDict({"embed": embed, "head": nn.Linear(3, 5, bias=False)})
    model["head"].weight = embed.weight
    write_weights({"head.weight": embed.weight.detach()}, tmp_path / "w.safetensors")
    source = check_weights(
        open_weights(tmp_path / "w.safetensors"), model.state_dict(), {"head.weight": "embed.weight"}
    )
    assert "embed.weight" in source and "head.weight" in source
    assert torch.equal(source.read(["embed.weight"])["embed.weight"], embed.weight.detach())


def test_names_and_shapes_that_do_not_match_are_named(tmp_path):
    state = mlp().state_dict()
    wrong = {**state, "2.weight": torch.zeros(3, 8), "extra.bias": torch.zeros(2)}
    del wrong["0.bias"]
    write_weights(wrong, tmp_path / "w.safetensors")
    with pytest.raises(ValueError) as err:
        check_weights(open_weights(tmp_path / "w.safetensors"), state, {})
    message = str(err.value)
    assert "not in the weights (1): ['0.bias']" in message
    assert "only in the weights (1): ['extra.bias']" in message
    assert "2.weight [2, 8] in the model vs [3, 8] in the weights" in message


def test_a_dtype_conversion_is_stated(tmp_path):
    state = mlp().state_dict()
    write_weights({k: t.to(torch.bfloat16) for k, t in state.items()}, tmp_path / "w.safetensors")
    with pytest.warns(
        UserWarning, match=r"converted to the model's dtype as they load \(torch.bfloat16 -> torch.float32\)"
    ):
        check_weights(open_weights(tmp_path / "w.safetensors"), state, {})


def test_paths_that_hold_no_weights_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_weights(tmp_path / "nothing")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not a .safetensors file"):
        open_weights(tmp_path / "notes.txt")
    with pytest.raises(ValueError, match="holds no checkpoint this reads"):
        open_weights(tmp_path)
    with pytest.raises(TypeError, match="weights must be a path"):
        open_weights(3)


def test_run_refuses_bad_weights_before_any_process_starts(tmp_path):
    state = mlp().state_dict()
    write_weights({k: v for k, v in state.items() if k != "2.bias"}, tmp_path / "w.safetensors")
    with pytest.raises(ValueError, match=r"not in the weights \(1\): \['2.bias'\]"):
        run(meta_mlp(), data(), nn.functional.mse_loss, PART, 2, steps=1, weights=tmp_path / "w.safetensors")
    write_weights(state, tmp_path / "ok.safetensors")
    with pytest.raises(ValueError, match="give only one of them"):
        run(
            mlp(),
            data(),
            nn.functional.mse_loss,
            PART,
            2,
            steps=1,
            weights=tmp_path / "ok.safetensors",
            resume_from=tmp_path,
        )


class Scale(nn.Module):
    """Holds a parameter and has no reset_parameters."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(2))

    def forward(self, x):
        return x * self.gain


def test_a_meta_model_nothing_can_initialize_is_refused_naming_the_module():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2), Scale())
    part = Partition.from_bounds(Profile.synthetic(fwd_ms=[1.0] * 3, bwd_ms=[1.0] * 3), [(0, 1), (1, 3)])
    with pytest.raises(ValueError, match=r"no reset_parameters\(\): 2 \(Scale, holding gain\)"):
        make_spec(model, data(), nn.functional.mse_loss, part, 2)
    spec = make_spec(
        model,
        data(),
        nn.functional.mse_loss,
        part,
        2,
        init=lambda m: [nn.init.ones_(p) for p in m.parameters(recurse=False)],
    )
    assert spec.init is not None and spec.weights is None
    with pytest.raises(TypeError, match="init must be a callable"):
        make_spec(model, data(), nn.functional.mse_loss, part, 2, init="ones")


def test_a_meta_model_is_checked_on_meta_and_its_stage_errors_named():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(7, 2))
    with pytest.raises(ValueError, match=r"stage 1 \(layers 1..1 \(1\)\) cannot take the output of stage 0"):
        make_spec(
            model,
            data(),
            nn.functional.mse_loss,
            PART.__class__.from_bounds(Profile.synthetic(fwd_ms=[1.0] * 2, bwd_ms=[1.0] * 2), [(0, 1), (1, 2)]),
            2,
        )


def test_the_spec_carries_structure_and_the_weights_go_beside_it_once(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 2))
    spec = make_spec(model, (torch.randn(8, 256), torch.randn(8, 2)), nn.functional.mse_loss, PART, 2)
    path = spec.save(tmp_path / "job.pkl")
    weights = tmp_path / "job.safetensors"
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert weights.stat().st_size >= model_bytes
    assert path.stat().st_size < model_bytes / 4  # the model's 257 KiB of weights are not in the spec
    loaded = load_spec(path)
    assert is_meta_model(loaded.model) and loaded.weights is not None
    assert loaded.weights.path == str(weights)
    got = loaded.weights.read(["2.weight"])["2.weight"]
    assert torch.equal(got, model[2].weight.detach())


def test_a_stage_filled_by_initialization_is_the_same_whatever_else_is_built():
    """Each submodule's RNG is seeded by its name: the stages of P=2 and P=4 start from the same tensors."""
    whole = meta_mlp()
    values = initial_values(whole, ["0.weight", "2.weight"], torch.device("cpu"), 7, None)
    alone = meta_mlp()
    stage = nn.Sequential()
    stage.add_module("2", alone[2])
    materialize(stage, torch.device("cpu"), lambda keys: initial_values(alone, keys, torch.device("cpu"), 7, None))
    assert torch.equal(stage.state_dict()["2.weight"], values["2.weight"])
    assert not torch.equal(values["0.weight"][:2, :2], values["2.weight"][:2, :2])
    assert name_seed(7, "2") != name_seed(8, "2") != name_seed(7, "0")


def test_materialize_keeps_ties_and_real_buffers(tmp_path):
    class Rotary(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("freq", torch.arange(3.0), persistent=False)

    with torch.device("meta"):
        embed = nn.Embedding(5, 3)
        model = nn.ModuleDict({"embed": embed, "head": nn.Linear(3, 5, bias=False)})
    model["head"].weight = embed.weight
    model["rotary"] = Rotary()
    assert model["rotary"].freq.device.type == "cpu"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        materialize(model, torch.device("cpu"), lambda keys: {k: torch.full((5, 3), 2.0) for k in keys})
    assert model["head"].weight is model["embed"].weight
    assert torch.equal(model["embed"].weight, torch.full((5, 3), 2.0))
    assert torch.equal(model["rotary"].freq, torch.arange(3.0))


def test_a_tensor_the_init_leaves_unset_is_named():
    model = meta_mlp()
    with pytest.raises(RuntimeError, match=r"initializing 2 \(Linear\) left \['bias', 'weight'\] unset"):
        initial_values(model, ["2.weight", "2.bias"], torch.device("cpu"), 0, lambda module: None)


def test_weights_without_a_model_buffer_that_no_checkpoint_holds_are_accepted(tmp_path):
    """A non-persistent buffer (a rotary table) is in no checkpoint, and a traced stage's checkpoint may hold it."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)

        def forward(self, x):
            return self.lin(x) * self.scale

    model = Scaled()
    write_weights({**model.state_dict(), "scale": model.scale}, tmp_path / "w.safetensors")
    from pipeswift_lab.runner.weights import check_run_weights

    source = check_run_weights(model, tmp_path / "w.safetensors", None)
    assert "lin.weight" in source and "scale" in source
