"""What one rank is given: :class:`RankInputs`, made by :func:`~pipeswift_lab.runner.rank.worker.run_rank`, and its
place in the mesh, :class:`Topology`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from ..spec import RunSpec

__all__ = ["RankInputs", "Topology"]


class Topology:
    """Where this process sits in the ``("dp", "pp")`` mesh: global ``rank``, pipeline rank ``pp_rank``, ``replica``.

    With ``D == 1`` there is no mesh: ``pp_rank == rank``, ``replica == 0`` and both groups are
    None (the default group). With ``D > 1`` the world is a 2-D ``DeviceMesh`` of shape
    ``(D, P)``: replica ``d`` is the global ranks ``d*P .. d*P+P-1`` (its stages talk point to
    point inside ``pp_group``); ``replica_group`` holds the ``D`` copies of this rank's stages,
    whose gradients DDP averages.
    """

    def __init__(self, rank: int, P: int, D: int, device_type: str) -> None:
        self.rank, self.P, self.D = rank, P, D
        self.pp_rank, self.replica = rank % P, rank // P
        self.pp_group: ProcessGroup | None = None
        self.replica_group: ProcessGroup | None = None
        if D > 1:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(device_type, (D, P), mesh_dim_names=("dp", "pp"))
            self.pp_group, self.replica_group = mesh.get_group("pp"), mesh.get_group("dp")


@dataclass(frozen=True, kw_only=True)
class RankInputs:
    """Everything one rank's training loop (:func:`~pipeswift_lab.runner.rank.train_loop.train`) starts from."""

    spec: RunSpec
    """The run: model, data, optimizer factory, stage plan, job options."""
    topo: Topology
    """Where this process sits: global rank, pipeline rank, replica, and their process groups."""
    world: int
    """Processes in the run: ``P * D``."""
    device: torch.device
    """This rank's device (its GPU, or the CPU)."""
    out_dir: Path
    """The run directory: logs, checkpoints log, progress, the gathered result."""
    progress: bool
    """Write the steps done to ``out_dir/progress`` (from the rank holding the last stage)."""
    gather_group: ProcessGroup | None
    """The group of the collectives on CPU objects (a gloo group beside NCCL; ``None``: the default group)."""
    proc_start_ns: int | None
    """Wall-clock start of this process (``None`` where ``/proc`` cannot tell)."""
    entered_ns: int
    """Wall clock when the runner was entered (python and torch imported)."""
    build_stages: Callable[[RunSpec, Topology, torch.device], list[Any]]
    """Makes this rank's ``PipelineStage`` objects."""
    make_schedule: Callable[[RunSpec, list[Any]], Any]
    """Makes torch's schedule over those stages."""
    resident_start_bytes: int | None = None
    """The process's resident size before it read the spec: the interpreter's own (``None`` without ``/proc``)."""

    @property
    def rank(self) -> int:
        """The global rank."""
        return self.topo.rank
