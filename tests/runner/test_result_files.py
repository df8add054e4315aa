"""A RunResult saved and loaded: ``result.save(path)`` and ``load_result(path)`` give back what a user reads.

One real run (two ranks, a weight tied across them, periodic checkpoints) is saved once; every test reads that
directory or a copy of it.
"""

import hashlib
import json
import shutil
import warnings

import pytest
import torch
from pandas.testing import assert_frame_equal
from torch import nn

import pipeswift_lab as psl
from pipeswift_lab.core.costs import AssemblyModel, CheckpointModel
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.runner import ResultFileError, RunResult, load_result, run
from pipeswift_lab.runner.result_files import to_json

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it

NAMES = ["embed", "blocks.0", "blocks.1", "head"]
TABLES = ["ranks", "checkpoints", "segments", "rebalances", "memory", "assembly_phases", "tied_weights", "df"]


class TiedNet(nn.Module):
    """The head shares its weight with the first block: the two live on different ranks."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.embed = nn.Linear(6, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 8)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        self.head.weight = self.blocks[0].weight

    def forward(self, x):
        h = torch.tanh(self.embed(x))
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h)


def profile():
    prof = Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4)
    return Profile(prof.df.assign(name=NAMES), prof.meta)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``(the run's RunResult, the directory it was saved to)``."""
    g = torch.Generator().manual_seed(7)
    batch = torch.randn(8, 6, generator=g), torch.randn(8, 8, generator=g)
    part = Partition.from_bounds(profile(), [(0, 2), (2, 4)], schedule="1F1B", m=4)
    root = tmp_path_factory.mktemp("result")
    result = run(
        TiedNet(),
        batch,
        nn.functional.mse_loss,
        part,
        4,
        steps=6,
        progress=False,
        checkpoint=psl.Checkpointing(root / "ck", every=2),
        launch=psl.Launch(timeout_s=180),
    )
    return result, result.save(root / "saved")


def test_a_saved_run_loads_back_with_every_table_tensor_and_figure(saved):
    result, path = saved
    loaded = load_result(path)
    assert isinstance(loaded, RunResult)
    assert sorted(p.name for p in path.iterdir()) == sorted(
        ["result.json", "state.pt", "timeline.csv", "ranks.csv", "checkpoints.csv", "segments.csv", "rebalances.csv"]
    )
    assert len(result.checkpoints) >= 3 and len(result.tied_weights) == 1  # the tables hold something
    for name in TABLES:
        assert_frame_equal(getattr(loaded, name), getattr(result, name), check_exact=True, obj=name)
    assert_frame_equal(loaded.timeline.df, result.timeline.df, check_exact=True)
    assert loaded.timeline.source == "measured" and to_json(loaded.timeline.meta) == to_json(result.timeline.meta)
    assert_frame_equal(loaded.step_stats(), result.step_stats(), check_exact=True)
    for name in ("step_ms", "losses", "jct", "schedule", "P", "v", "m", "steps", "status", "checkpoint", "D"):
        assert getattr(loaded, name) == getattr(result, name), name
    assert loaded.steady_step_ms == result.steady_step_ms and loaded.probed_steps == result.probed_steps
    assert to_json(loaded.meta) == to_json(result.meta)
    assert loaded.meta["state_keys"] == result.meta["state_keys"] and loaded.meta["bounds"] == result.meta["bounds"]
    assert str(loaded) == str(result) and loaded._repr_html_() == result._repr_html_()
    state, want = loaded.state_dict(), result.state_dict()
    assert list(state) == list(want)
    assert all(torch.equal(state[k], want[k]) for k in want)
    assert state["head.weight"].data_ptr() == state["blocks.0.weight"].data_ptr()  # the tied weight is one tensor
    model = loaded.load_into(TiedNet())
    assert torch.equal(model.head.weight, want["head.weight"])
    assert loaded.plot().get_title() == result.plot().get_title()


def test_a_loaded_run_compares_and_calibrates_as_the_run_did(saved):
    result, path = saved
    loaded = load_result(path)
    part = Partition.from_bounds(profile(), [(0, 2), (2, 4)], schedule="1F1B", m=4)
    simulated = psl.simulate(part, m=4, schedule="1F1B")
    assert_frame_equal(psl.compare(simulated, loaded).df, psl.compare(simulated, result).df, check_exact=True)
    with warnings.catch_warnings():  # one run leaves some parameters at their defaults, and says so
        warnings.simplefilter("ignore")
        fitted, want = psl.calibrate([loaded], profile()), psl.calibrate([result], profile())
    assert_frame_equal(fitted.df, want.df, check_exact=True)
    assert AssemblyModel.calibrate([loaded]) == AssemblyModel.calibrate([result])
    with pytest.warns(UserWarning, match="nothing was restored"):
        fitted = CheckpointModel.calibrate([loaded])
    with pytest.warns(UserWarning, match="nothing was restored"):
        assert fitted == CheckpointModel.calibrate([result])


def test_the_state_file_loads_with_weights_only_and_the_manifest_is_plain_json(saved):
    result, path = saved
    state = torch.load(path / "state.pt", weights_only=True)
    assert set(state) == set(result.state_dict())
    assert all(torch.equal(state[k], v) for k, v in result.state_dict().items())
    manifest = json.loads((path / "result.json").read_text())
    assert manifest["format"] == "pipeswift_lab.run_result" and manifest["fields"]["P"] == 2
    assert manifest["step_ms"] == list(result.step_ms)
    assert set(manifest["files"]) == {p.name for p in path.iterdir()} - {"result.json"}


def copy_of(path, tmp_path):
    target = tmp_path / "copy"
    shutil.copytree(path, target)
    return target


@pytest.mark.parametrize("name", ["state.pt", "timeline.csv", "checkpoints.csv"])
def test_a_changed_or_missing_file_is_named(saved, tmp_path, name):
    _, path = saved
    changed = copy_of(path, tmp_path)
    raw = bytearray((changed / name).read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (changed / name).write_bytes(bytes(raw))
    with pytest.raises(ResultFileError, match=rf"{name}' does not match its size and SHA-256"):
        load_result(changed)
    (changed / name).unlink()
    with pytest.raises(ResultFileError, match=rf"{name}' is missing"):
        load_result(changed)


def test_an_unreadable_manifest_and_a_pickled_object_are_refused(saved, tmp_path):
    _, path = saved
    bad = copy_of(path, tmp_path)
    (bad / "result.json").write_text("{not json")
    with pytest.raises(ResultFileError, match=r"result\.json' cannot be read as JSON"):
        load_result(bad)
    (bad / "result.json").unlink()
    with pytest.raises(ResultFileError, match=r"result\.json' is missing"):
        load_result(bad)
    # a state file that holds a pickled object (code to run on load), listed with its true checksum
    forged = tmp_path / "forged"
    shutil.copytree(path, forged)
    torch.save({"weight": torch.zeros(2), "hook": Profile.synthetic(fwd_ms=[1.0], bwd_ms=[1.0])}, forged / "state.pt")
    manifest = json.loads((forged / "result.json").read_text())
    raw = (forged / "state.pt").read_bytes()
    manifest["files"]["state.pt"] = {"bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    (forged / "result.json").write_text(json.dumps(manifest))
    with pytest.raises(ResultFileError, match=r"state\.pt' cannot be loaded with weights_only=True"):
        load_result(forged)


def test_save_refuses_to_write_over_other_files(saved, tmp_path):
    result, path = saved
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds no saved result"):
        result.save(other)
    again = result.save(copy_of(path, tmp_path), overwrite=True)
    assert load_result(again).step_ms == result.step_ms
    with pytest.raises(FileExistsError, match="overwrite=True"):
        result.save(again)
    assert (other / "notes.txt").read_text() == "mine" and not list(tmp_path.glob(".tmp-*"))
