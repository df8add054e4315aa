"""Fixtures shared by the unit tests."""

import os

import pytest
import torch


def pytest_configure(config):
    """One intra-op thread in every test process and in what it starts (notebook kernels, subprocesses): the suite
    runs three workers on a 2-core machine, where a second OpenMP thread per process only waits at barriers for a
    descheduled core (a tiny matmul then takes ~15 ms). A run's own ranks set their threads themselves."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for timing tests: on a shared 2-core machine OpenMP barriers wait for a
    descheduled second thread and make even a tiny matmul take ~15 ms, noise far above the sleeps."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def processes_are_marked(request, monkeypatch):
    """A test that starts a run's worker processes carries the ``processes`` mark (``pytest -m "not processes"``, the
    fast inner loop, skips it): an unmarked test that launches fails here, naming the mark."""
    if request.node.get_closest_marker("processes") is not None:
        return
    from pipeswift_lab.runner import launcher

    def refuse(*args, **kwargs):
        raise AssertionError(
            f"{request.node.nodeid} starts worker processes but is not marked processes: add "
            "`pytestmark = pytest.mark.processes` to its module (or @pytest.mark.processes to the test)"
        )

    monkeypatch.setattr(launcher, "_start_agent", refuse)


@pytest.fixture(autouse=True)
def close_figures():
    """Close every matplotlib figure a test opened, so the suite never holds more than a test's worth."""
    yield
    import sys

    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")


#: The traced jobs' size: 8 blocks of width 256, batch 64, m=4, 4 profiled steps after 2 unprofiled.
TRACED_JOB = {"m": 4, "steps": 4}


@pytest.fixture(scope="session")
def interleaved_traces(tmp_path_factory):
    """A folder of ``tensorboard_trace_handler`` traces of a plain torch Interleaved1F1B job (P=2, v=2)."""
    from torch_jobs import torch_job

    return torch_job(tmp_path_factory.mktemp("interleaved"), "Interleaved1F1B", "--microbatches", 4, "--active", 4)


@pytest.fixture(scope="session")
def gpipe_traces(tmp_path_factory):
    """``export_chrome_trace`` files of a plain torch GPipe job (P=2)."""
    from torch_jobs import torch_job

    return torch_job(tmp_path_factory.mktemp("gpipe"), "GPipe", "--microbatches", 4, "--active", 4, "--chrome")
