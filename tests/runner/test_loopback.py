"""A local run accepts connections only from this machine: every socket its processes listen on is bound to loopback."""

import threading
import time

import psutil
import pytest
import torch
from sleep_layers import SleepLayer
from torch import nn

from pipeswift_lab import Launch
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.runner import run
from pipeswift_lab.runner.loopback import LOOPBACK, loopback_store

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it


def listening_sockets(stop: threading.Event, found: set) -> None:
    """Until ``stop``: add ``(is_caller, address)`` for each socket this process or a descendant listens on."""
    me = psutil.Process()
    while not stop.is_set():
        pids = {me.pid} | {child.pid for child in me.children(recursive=True)}
        for conn in psutil.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
                found.add((conn.pid == me.pid, conn.laddr.ip))
        time.sleep(0.02)


@pytest.mark.parametrize("start_method", ["forkserver", "subprocess"])
def test_a_local_run_listens_on_loopback_only(start_method):
    model = nn.Sequential(*[SleepLayer(40, 40) for _ in range(4)])  # ~0.3 s a step: time to see every socket
    part = Partition.from_bounds(
        Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[1.0] * 4), [(0, 2), (2, 4)], schedule="1F1B"
    )
    stop, found = threading.Event(), set()
    watcher = threading.Thread(target=listening_sockets, args=(stop, found))
    watcher.start()
    try:
        run(
            model,
            (torch.randn(4, 3), torch.randn(4, 3)),
            nn.functional.mse_loss,
            part,
            2,
            steps=4,
            progress=False,
            launch=Launch(timeout_s=120, start_method=start_method),
        )
    finally:
        stop.set()
        watcher.join()
    assert {is_caller for is_caller, _ in found} == {True, False}  # the rendezvous stores and the workers' gloo sockets
    assert {address for _, address in found} == {LOOPBACK}, found


def test_the_store_listens_on_loopback_and_closes_with_its_last_reference():
    store = loopback_store(10)
    mine = [
        c
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port
    ]
    assert [c.laddr.ip for c in mine] == [LOOPBACK]
    store.set("key", "value")
    assert store.get("key") == b"value"
    port = store.port
    del store
    assert not [
        c
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
