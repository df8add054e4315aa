"""The fork server preloads the toolkit's worker module while the toolkit's files are as it saw them, and is
restarted when they change: an edit reaches the next run."""

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import pipeswift_lab as psl
from pipeswift_lab.runner import launcher
from pipeswift_lab.runner.processes import forkserver_pid

pytestmark = pytest.mark.processes


def _run():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    part = psl.partition(psl.Profile.synthetic(fwd_ms=[0.1, 0.1], bwd_ms=[0.2, 0.2]), 2, m=2)
    return psl.run(
        model, (torch.randn(4, 8), torch.randn(4, 8)), nn.functional.mse_loss, part, 2, steps=1, progress=False
    )


def test_an_edit_to_the_toolkit_restarts_the_fork_server_and_nothing_else_does():
    from multiprocessing import forkserver

    _run()
    first = forkserver_pid()
    assert launcher.WORKER_MODULE in forkserver._forkserver._preload_modules
    _run()
    assert forkserver_pid() == first  # nothing changed: the same server, its workers start with the toolkit loaded
    edited = Path(launcher.__file__)
    before = edited.stat()
    fingerprint = launcher.package_fingerprint()
    try:
        os.utime(edited, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
        assert launcher.package_fingerprint() != fingerprint
        _run()
        assert forkserver_pid() not in (None, first)  # a new server, which imported the edited files
    finally:
        os.utime(edited, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert launcher.package_fingerprint() == fingerprint
