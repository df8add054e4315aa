"""Checkpoint files: DCP state keyed by the model's names, an atomic commit, checksums, retention.

The saver here is a real process writing with the same functions the workers use (a rank file
needs no process group), forked from one that imported them once; the kill test SIGKILLs a real saving process at
random moments and checks that what is left is either the previous checkpoint or the new one, never a corrupt one.
"""

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
from torch import nn

from pipeswift_lab.runner import Checkpoint, CheckpointError, latest_checkpoint, load_checkpoint
from pipeswift_lab.runner import checkpoint as ckpt

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it

SAVER = textwrap.dedent("""
    import os, sys, time, torch
    import torch._dynamo  # an optimizer imports it when first made (~1.5 s): here once, not in every saver
    from pathlib import Path
    from torch import nn
    from pipeswift_lab.runner import checkpoint as ckpt
    from pipeswift_lab.runner.checkpoint_files import Stager
    from pipeswift_lab.runner.rank.background_writer import RankWriter, SaveJob
    from pipeswift_lab.runner.rank.state_files import rank_flat_state

    def save(root, steps):
        model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        keys = list(model.state_dict())

        def commit(job, records):
            ckpt.commit(job.tmp_dir, {"step": job.step, "state_keys": keys}, records, keep=2, live="t")
            print(job.step, flush=True)

        writer = RankWriter(0, 1, {"pp_rank": 0, "replica": 0}, commit)
        stager = None
        for step in range(1, steps + 1):
            writer.wait()  # one save in flight: the staging buffer is free again
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(step))
            flat = rank_flat_state(0, model, opt, "cpu")
            stager = stager or Stager(flat, "cpu")
            staged = stager.stage(flat)
            tmp = ckpt.new_tmp_dir(root, step, "t")
            writer.submit(SaveJob(step=step, kind="periodic", tmp_dir=tmp, staged=staged, started_ns=time.time_ns(),
                                  staging_ms=0.0, waited=False))
            with torch.no_grad():  # training goes on while the write runs in the background
                for p in model.parameters():
                    p.add_(1000.0)
        writer.wait()

    for line in sys.stdin:  # "ROOT STEPS OUT": fork a saver that prints each committed step to OUT
        root, steps, out = line.split()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                sys.stdout = open(out, "w", buffering=1)
                save(Path(root), int(steps))
                code = 0
            finally:
                os._exit(code)
        print(pid, flush=True)
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
""")


@pytest.fixture(scope="module")
def saver():
    """One interpreter that imports torch and the writer once (~2 s) and forks a saving process on request."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SAVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    yield proc
    proc.stdin.close()
    proc.wait(timeout=30)


def save_steps(saver, root, steps):
    """Start a saving process for ``steps`` checkpoints under ``root``; return its pid and the file it prints each
    committed step to. :func:`exit_code` waits for it."""
    out = root.parent / f"{root.name}.out"
    out.write_text("")
    saver.stdin.write(f"{root} {steps} {out}\n")
    saver.stdin.flush()
    return int(saver.stdout.readline()), out


def exit_code(saver):
    """The exit code of the saving process last started (minus the number of the signal that killed it)."""
    return int(saver.stdout.readline())


@pytest.fixture(scope="module")
def three_saves(saver, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    save_steps(saver, root, 3)
    assert exit_code(saver) == 0
    return root


def test_layout_manifest_and_retention(three_saves):
    names = sorted(p.name for p in three_saves.iterdir())
    assert names == ["step-00000002", "step-00000003"]  # keep=2, no .tmp- left
    latest = latest_checkpoint(three_saves)
    assert isinstance(latest, Checkpoint) and latest.step == 3
    manifest = json.loads((latest.path / "manifest.json").read_text())
    assert set(manifest["files"]) == {".metadata", "rank-00000.bin"}
    assert all(len(info["sha256"]) == 64 for info in manifest["files"].values())
    df = latest.df
    assert list(df.columns) == ["name", "bytes", "sha_ok"] and df["sha_ok"].all()
    assert latest.bytes == df["bytes"].sum() > 64 * 256 * 4


def test_state_dict_has_model_keys_and_values(three_saves):
    latest = load_checkpoint(three_saves)
    state = latest.state_dict()
    assert list(state) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert all(torch.equal(t, torch.full_like(t, 3.0)) for t in state.values())
    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))
    latest.load_into(model)
    assert torch.equal(model[1].bias, torch.full((64,), 3.0))
    assert load_checkpoint(three_saves / "step-00000002").step == 2


def test_a_checkpoint_from_latest_checkpoint_loads_and_is_checked_again(tmp_path, three_saves):
    import shutil

    found = latest_checkpoint(three_saves)
    loaded = load_checkpoint(found)  # psl.load_checkpoint(psl.latest_checkpoint(root))
    assert isinstance(loaded, Checkpoint) and loaded.step == 3 and loaded.path == found.path
    assert all(torch.equal(t, torch.full_like(t, 3.0)) for t in loaded.state_dict().values())
    root = tmp_path / "copy"
    shutil.copytree(three_saves, root)
    copied = latest_checkpoint(root)
    data = copied.path / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))  # changed after latest_checkpoint checked it
    with pytest.raises(CheckpointError, match=r"rank-00000\.bin does not match its SHA-256"):
        load_checkpoint(copied)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert latest_checkpoint(empty) is None
    with pytest.raises(CheckpointError, match=r"load_checkpoint\(None\): there is no checkpoint to load"):
        load_checkpoint(latest_checkpoint(empty))


def test_corrupt_file_is_skipped_with_a_warning_naming_it(tmp_path, three_saves):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(three_saves, root)
    data = root / "step-00000003" / "rank-00000.bin"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.warns(UserWarning, match=r"rank-00000\.bin does not match its SHA-256"):
        latest = latest_checkpoint(root)
    assert latest.step == 2
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        load_checkpoint(root / "step-00000003")


def test_uncommitted_and_foreign_directories_are_never_loaded(tmp_path, three_saves):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(three_saves, root)
    (root / "step-00000009").mkdir()  # a directory without a manifest: not a checkpoint
    (root / ".tmp-step-00000010-deadbeef").mkdir()
    assert latest_checkpoint(root).step == 3
    with pytest.raises(CheckpointError, match="no manifest.json"):
        load_checkpoint(root / "step-00000009")


@pytest.mark.parametrize(
    "content, match", [(None, "does not exist"), ("file", "not a directory"), ("empty", "holds no complete checkpoint")]
)
def test_bad_paths(tmp_path, content, match):
    path = tmp_path / "x"
    if content == "file":
        path.write_text("x")
    elif content == "empty":
        path.mkdir()
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path)
    with pytest.raises(TypeError, match="path must be a str, an os.PathLike or a Checkpoint"):
        load_checkpoint(3)


def test_unreadable_manifest(tmp_path, three_saves):
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(three_saves, root)
    (root / "step-00000003" / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_checkpoint(root / "step-00000003")


def test_another_model_lists_names_and_shapes(three_saves):
    latest = load_checkpoint(three_saves)
    other = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(64, 2))
    with pytest.raises(CheckpointError) as info:
        latest.load_into(other)
    message = str(info.value)
    assert "not in the checkpoint (2): ['2.bias', '2.weight']" in message
    assert "0.weight [128, 64] in the model vs [256, 64] in the checkpoint" in message


def test_kill_during_a_background_write_never_leaves_a_corrupt_checkpoint(saver, tmp_path):
    """SIGKILL a process at random moments while its writer thread saves: the newest complete checkpoint always
    verifies, holds its step's state, and is the newest one committed."""
    rng = random.Random(0)
    killed_mid_save = 0
    for trial in range(6):  # 30% of random kills miss every save
        root = tmp_path / f"kill-{trial}"
        pid, out = save_steps(saver, root, 10_000)
        deadline = time.monotonic() + 120
        while not out.read_text().strip():  # at least one save committed
            assert time.monotonic() < deadline, "the saver committed nothing"
            time.sleep(0.001)
        if trial % 2:  # every other kill lands within a few ms of a save's start: some kill lands mid-save
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(p.name.startswith(".tmp-") for p in root.iterdir()):
                time.sleep(0.001)
            time.sleep(rng.uniform(0.0, 0.002))
        else:
            time.sleep(rng.uniform(0.0, 0.3))
        os.kill(pid, signal.SIGKILL)
        assert exit_code(saver) == -signal.SIGKILL  # killed while saving, not ended on its own
        killed_mid_save += any(p.name.startswith(".tmp-") for p in root.iterdir())
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a checksum mismatch would warn
            latest = latest_checkpoint(root)
        assert latest is not None and latest.path == ckpt.complete_checkpoints(root)[0]  # the newest committed
        state = latest.state_dict()
        assert all(torch.equal(t, torch.full_like(t, float(latest.step))) for t in state.values())  # as staged
    assert killed_mid_save >= 1, "no kill landed during a save; the trial says nothing"


def test_step_dir_names():
    assert ckpt.step_dir_name(12) == "step-00000012"
    assert os.path.basename(ckpt.new_tmp_dir("/r", 12)).startswith(".tmp-step-00000012-")
