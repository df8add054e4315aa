"""What one rank is given: :class:`RankInputs`, made by :func:`~pipeswift_lab.runner.rank.worker.run_rank`, and its
place in the mesh, :class:`RankMesh`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

    from ..spec import RunSpec

__all__ = ["RankInputs", "RankMesh"]


class RankMesh:
    """Where this process sits in the ``(pp, dp, fsdp, tp)`` mesh (:mod:`~pipeswift_lab.core.layout`), and the process
    groups and sub-meshes it trains with.

    With one process per pipeline rank (``D == fsdp == tp == 1``) there is no mesh: ``pp_rank == rank`` and every
    group is None (the default group). Otherwise the world is a 4-D ``DeviceMesh`` of shape ``(P, D, fsdp, tp)``,
    the tensor-parallel ranks adjacent (torchtitan's order):

    * ``pp_group`` — the ``P`` ranks of this process's pipeline, which send to each other;
    * ``replica_group`` — the ``D`` copies of this rank's stages, whose gradients DDP averages (``fsdp == tp == 1``);
    * ``shard_mesh`` — what FSDP2 shards over: ``(dp, fsdp)`` (HSDP: replicated over ``dp``, sharded over ``fsdp``)
      when ``D > 1``, else ``(fsdp,)``; ``None`` when FSDP is not applied (``fsdp == 1`` and ``tp == 1``, or
      ``D == 1`` and ``fsdp == 1``);
    * ``tp_mesh`` — the ``tp`` ranks that split each sharded module (``None`` for ``tp == 1``);
    * ``data_group`` — the ``D * fsdp`` processes that read different slices of the batch (same pipeline and
      tensor-parallel rank): the loss is averaged over them.
    """

    def __init__(self, rank: int, P: int, D: int, device_type: str, fsdp: int = 1, tp: int = 1) -> None:
        from ...core.layout import MESH_DIMS, coordinates

        self.rank, self.P, self.D, self.fsdp, self.tp = rank, P, D, fsdp, tp
        where = coordinates(rank, P, D, fsdp, tp)
        self.pp_rank, self.replica, self.fsdp_rank, self.tp_rank = where.pp, where.dp, where.fsdp, where.tp
        self.data_rank = where.data_rank(fsdp)
        self.pp_group: ProcessGroup | None = None
        self.replica_group: ProcessGroup | None = None
        self.data_group: ProcessGroup | None = None
        self.shard_mesh: DeviceMesh | None = None
        self.tp_mesh: DeviceMesh | None = None
        if D * fsdp * tp == 1:
            return
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (P, D, fsdp, tp), mesh_dim_names=MESH_DIMS)
        self.pp_group = mesh.get_group("pp")
        if D * fsdp > 1:
            self.data_group = mesh["dp", "fsdp"]._flatten("data").get_group()
        if fsdp == 1 and tp == 1:
            self.replica_group = mesh.get_group("dp")
        elif D > 1:
            self.shard_mesh = mesh["dp", "fsdp"]
        elif fsdp > 1:
            self.shard_mesh = mesh["fsdp"]
        if tp > 1:
            self.tp_mesh = mesh["tp"]

    @property
    def coordinates(self) -> dict[str, int]:
        """``{"pp", "dp", "fsdp", "tp"}``: this process's place in the mesh."""
        return {"pp": self.pp_rank, "dp": self.replica, "fsdp": self.fsdp_rank, "tp": self.tp_rank}


@dataclass(frozen=True, kw_only=True)
class RankInputs:
    """Everything one rank's training loop (:func:`~pipeswift_lab.runner.rank.train_loop.train`) starts from."""

    spec: RunSpec
    """The run: model, data, optimizer factory, stage plan, job options."""
    topo: RankMesh
    """Where this process sits: global rank, its mesh coordinates, and their process groups."""
    world: int
    """Processes in the run: ``P * D * fsdp * tp``."""
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
    build_stages: Callable[[RunSpec, RankMesh, torch.device], list[Any]]
    """Makes this rank's ``PipelineStage`` objects."""
    make_schedule: Callable[[RunSpec, list[Any]], Any]
    """Makes torch's schedule over those stages."""
    resident_start_bytes: int | None = None
    """The process's resident size before it read the spec: the interpreter's own (``None`` without ``/proc``)."""

    @property
    def rank(self) -> int:
        """The global rank."""
        return self.topo.rank
