"""A saved spec is code: its header is checked before anything is unpickled."""

import json
import os
import pickle

import pytest
import torch
from torch import nn

from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.runner import load_spec, make_spec
from pipeswift_lab.runner.spec import SPEC_MAGIC, spec_header


class Tripwire:
    """Unpickling it creates ``path``: evidence that a pickle ran code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Linear(4, 2))
    part = Partition.from_bounds(Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[1.0] * 4), [(0, 2), (2, 4)])
    spec = make_spec(model, (torch.randn(8, 4), torch.randn(8, 2)), nn.functional.mse_loss, part, 2, steps=3)
    return spec, spec.save(tmp_path / "job.pkl")


def test_the_header_names_format_versions_and_checksum_and_the_spec_round_trips(saved):
    spec, path = saved
    header = spec_header(path)
    assert (
        header["format"] == "pipeswift_lab.RunSpec"
        and header["pipeswift_lab"] == __import__("pipeswift_lab").__version__
    )
    assert header["bytes"] == path.stat().st_size - path.read_bytes().index(b"\n") - 1 and len(header["sha256"]) == 64
    loaded = load_spec(path)
    assert loaded.steps == 3 and loaded.state_keys == spec.state_keys
    assert all(t.is_meta for t in loaded.model.state_dict().values())  # the spec carries structure, not weights
    read = loaded.weights.read(spec.state_keys)
    assert all(torch.equal(read[k], t) for k, t in spec.model.state_dict().items())


def test_the_weights_are_written_once_beside_the_spec_and_move_with_its_folder(saved, tmp_path):
    spec, _ = saved
    path = tmp_path / "a" / "job.pkl"
    path.parent.mkdir()
    beside = spec.with_weights_beside(
        path
    )  # as run(launch=Launch(save_spec=...)) does before it launches the same spec
    written = path.with_suffix(".safetensors").stat().st_mtime_ns
    assert beside.with_weights_beside(path) is beside
    beside.save(path)
    assert path.with_suffix(".safetensors").stat().st_mtime_ns == written  # named, not written again
    os.rename(path.parent, tmp_path / "b")
    loaded = load_spec(tmp_path / "b" / "job.pkl")
    read = loaded.weights.read(spec.state_keys)
    assert all(torch.equal(read[k], t) for k, t in spec.model.state_dict().items())


def test_a_pickle_without_the_header_is_refused_before_it_runs(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "evil.pkl").write_bytes(pickle.dumps(Tripwire(marker)))
    with pytest.raises(ValueError, match=r"evil\.pkl.*no pipeswift_lab spec header.*nothing was unpickled"):
        load_spec(tmp_path / "evil.pkl")
    assert not marker.exists()


def test_a_changed_payload_is_refused_before_it_runs(saved, tmp_path):
    _, path = saved
    data = path.read_bytes()
    header_line = data[: data.index(b"\n") + 1]
    marker = tmp_path / "ran"
    evil = pickle.dumps(Tripwire(marker))
    path.write_bytes(header_line + evil)  # the header of a real spec, another payload
    with pytest.raises(ValueError, match=r"job\.pkl.*does not match the checksum.*nothing was unpickled"):
        load_spec(path)
    path.write_bytes(data[:-10])  # cut short
    with pytest.raises(ValueError, match="does not match the checksum"):
        load_spec(path)
    assert not marker.exists()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"format": "other"}, "'format': 'other'"),
        ({"version": 1}, "'version': 1"),
        ({"pipeswift_lab": "0.0.1"}, "'pipeswift_lab': '0.0.1'"),
        ({"sha256": None}, "no payload checksum"),
    ],
)
def test_a_header_for_another_format_or_version_is_refused(saved, change, message):
    _, path = saved
    data = path.read_bytes()
    end = data.index(b"\n")
    header = {**json.loads(data[len(SPEC_MAGIC) : end]), **change}
    path.write_bytes(SPEC_MAGIC + json.dumps(header).encode() + data[end:])
    with pytest.raises(ValueError, match=message):
        load_spec(path)


def test_an_unreadable_header_line_is_refused(tmp_path):
    (tmp_path / "s.pkl").write_bytes(SPEC_MAGIC + b"{not json\n" + os.urandom(16))
    with pytest.raises(ValueError, match="not valid JSON"):
        load_spec(tmp_path / "s.pkl")
