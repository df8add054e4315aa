"""A local run's rendezvous, listening on loopback only.

torch's c10d rendezvous hosts two ``TCPStore`` servers in the launching process: the rendezvous
store, and the store it shares with the workers (``_create_tcp_store_server``). Both listen on
every interface (``*:PORT``), and a c10d store has no authentication, so on a shared machine
anyone on the network could join or disturb a run. torch has no option for the address a store
binds to; it does take a socket that already listens (``TCPStore(master_listen_fd=...)``). So a
local run binds its sockets to ``127.0.0.1`` itself:

* :func:`loopback_store` hosts the rendezvous store; the agent connects to it as a client
  (``rdzv_configs={"is_host": False}``);
* :func:`loopback_rendezvous` registers torch's own c10d handler under another name, with the
  workers' shared store made by :func:`loopback_store` too (the one method it overrides), and
  ``local_addr="127.0.0.1"`` tells
  the workers to reach it there. gloo's sockets already bind to the address the workers use.

Multi-node launches (``torchrun``) keep torch's c10d rendezvous: it binds where the user says,
and belongs on a trusted network.
"""

from __future__ import annotations

import datetime
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

#: The one address a local run listens on.
LOOPBACK = "127.0.0.1"
#: The name a local run's rendezvous is registered under in torch's handler registry.
BACKEND = "pipeswift-loopback"


def loopback_store(timeout_s: float = 300.0) -> TCPStore:
    """A c10d ``TCPStore`` server listening on ``127.0.0.1`` only (port chosen by the OS); returns the store.

    It closes with its last reference.
    """
    from torch.distributed import TCPStore

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((LOOPBACK, 0))
        listener.listen(128)
        port = listener.getsockname()[1]
    except OSError:
        listener.close()
        raise
    return TCPStore(
        LOOPBACK,
        port,
        is_master=True,
        multi_tenant=True,
        master_listen_fd=listener.detach(),
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=max(1.0, float(timeout_s))),
    )


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's c10d rendezvous handler (its configs parsed by torch), with the workers' shared store on loopback."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler, create_handler

    class LoopbackRendezvousHandler(DynamicRendezvousHandler):
        def _create_tcp_store_server(self, master_addr: str | None, master_port: int | None) -> TCPStore:
            return loopback_store(self.settings.timeout.join.total_seconds())

        def get_backend(self) -> str:
            return BACKEND

    backend, store = create_backend(params)
    settings = create_handler(store, backend, params).settings
    return LoopbackRendezvousHandler.from_backend(
        settings.run_id,
        store,
        backend,
        settings.min_nodes,
        settings.max_nodes,
        params.local_addr,
        settings.timeout,
        keep_alive_interval=int(settings.keep_alive_interval.total_seconds()),
        keep_alive_max_attempt=settings.keep_alive_max_attempt,
    )


def loopback_rendezvous() -> str:
    """Register the loopback rendezvous with torch's elastic launcher (once per process); returns its backend name."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _create_handler)  # the same creator again is a no-op
    return BACKEND


__all__ = ["BACKEND", "LOOPBACK", "loopback_rendezvous", "loopback_store"]
