"""Fixtures shared by the unit tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for timing tests: on a shared 2-core machine OpenMP barriers wait for a
    descheduled second thread and make even a tiny matmul take ~15 ms, noise far above the sleeps."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def close_figures():
    """Close every matplotlib figure a test opened, so the suite never holds more than a test's worth."""
    yield
    import sys

    if "matplotlib.pyplot" in sys.modules:
        sys.modules["matplotlib.pyplot"].close("all")
