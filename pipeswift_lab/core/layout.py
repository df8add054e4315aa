"""The layout of a job: ``P`` pipeline ranks, ``D`` replicas, ``fsdp`` shards inside a replica, ``tp`` tensor-parallel
ranks, in ``P · D · fsdp · tp`` processes.

The processes form a 4-D mesh ordered ``(pp, dp, fsdp, tp)`` as torchtitan orders its mesh
(``torchtitan/distributed/parallel_dims.py``: pp, dp_replicate, dp_shard, cp, tp): the last dimension varies
fastest, so a tensor-parallel group is ``tp`` adjacent global ranks (inside one node when ``tp`` divides the GPUs
of a node) and the pipeline dimension is the outermost, the one whose point-to-point traffic crosses nodes.

What each process holds of a stage's training state (Rajbhandari et al., *ZeRO*, SC 2020; the FSDP2 behaviour under
``torch.distributed.pipelining`` measured in this project, ``docs/parallelism.md``):

* tensor parallelism divides the parameters the plan shards (:class:`LayerSharding` ``tp_param_bytes``) by ``tp``;
  the others stay whole on every tensor-parallel rank;
* FSDP2 under a pipeline schedule keeps each stage's parameters and accumulated gradients unsharded for the whole
  step (it all-gathers them before the first forward and reduce-scatters once, at ``REDUCE_GRAD``), so its memory
  is ZeRO-1-like: unsharded weights and gradients, the sharded parameters beside them, and the optimizer state
  sharded ``fsdp`` ways (replicated over the ``D`` replicas of HSDP).
"""

from __future__ import annotations

from dataclasses import dataclass

from .checks import check_int

__all__ = ["MESH_DIMS", "Coordinates", "coordinates", "global_rank", "state_bytes_per_rank"]

#: The mesh's dimensions, outermost first.
MESH_DIMS: tuple[str, ...] = ("pp", "dp", "fsdp", "tp")


@dataclass(frozen=True)
class Coordinates:
    """Where one process sits in the ``(pp, dp, fsdp, tp)`` mesh."""

    pp: int
    """Pipeline rank."""
    dp: int
    """Replica."""
    fsdp: int
    """FSDP shard inside the replica."""
    tp: int
    """Tensor-parallel rank."""

    def data_rank(self, fsdp: int) -> int:
        """Which slice of the global batch this process reads: ``dp * fsdp + fsdp_rank`` (the tensor-parallel ranks
        of one group read the same slice)."""
        return self.dp * fsdp + self.fsdp


def coordinates(rank: int, P: int, D: int = 1, fsdp: int = 1, tp: int = 1) -> Coordinates:
    """The mesh coordinates of global ``rank`` in a ``P · D · fsdp · tp`` job (``tp`` varies fastest)."""
    P, D, fsdp, tp = (check_int(n, v, minimum=1) for n, v in (("P", P), ("D", D), ("fsdp", fsdp), ("tp", tp)))
    rank = check_int("rank", rank, minimum=0)
    if rank >= P * D * fsdp * tp:
        raise ValueError(f"rank={rank} is outside a job of P*D*fsdp*tp = {P}*{D}*{fsdp}*{tp} processes")
    return Coordinates(pp=rank // (D * fsdp * tp), dp=rank // (fsdp * tp) % D, fsdp=rank // tp % fsdp, tp=rank % tp)


def global_rank(
    pp: int, dp: int = 0, fsdp_rank: int = 0, tp_rank: int = 0, *, D: int = 1, fsdp: int = 1, tp: int = 1
) -> int:
    """The global rank at mesh coordinates ``(pp, dp, fsdp_rank, tp_rank)``: the inverse of :func:`coordinates`."""
    return ((pp * D + dp) * fsdp + fsdp_rank) * tp + tp_rank


def state_bytes_per_rank(
    param_bytes: float,
    tp_param_bytes: float,
    *,
    tp: int = 1,
    fsdp: int = 1,
    weight_factor: float = 1.0,
    grad_factor: float = 1.0,
    optimizer_factor: float = 2.0,
) -> dict[str, float]:
    """One process's share of a stage's training state: ``{"weights", "grads", "optimizer"}`` in bytes.

    ``param_bytes`` are the stage's parameter bytes in the profile's dtype, ``tp_param_bytes`` those the
    tensor-parallel plan shards; ``weight_factor``, ``grad_factor`` and ``optimizer_factor`` are bytes per profiled
    parameter byte of the weights the stage computes with, of its gradients and of its optimizer state (master
    weights included): with an fp32 profile and Adam, 1, 1 and 2. Under FSDP (``fsdp > 1``) the sharded parameters
    (``1 / fsdp``) are held beside the unsharded ones, the gradients stay unsharded until the step's one
    reduce-scatter, and the optimizer state is sharded ``fsdp`` ways."""
    per_tp = (param_bytes - tp_param_bytes) + tp_param_bytes / tp
    sharded = per_tp / fsdp if fsdp > 1 else 0.0
    return {
        "weights": (per_tp + sharded) * weight_factor,
        "grads": per_tp * grad_factor,
        "optimizer": per_tp / fsdp * optimizer_factor,
    }
