"""Which devices a run's ranks use, and how many CPU ranks this machine can take."""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from ..core.checks import check_choice

__all__ = ["CPU_RANKS_PER_CORE", "BACKENDS", "available_cores", "resolve_devices"]

#: CPU ranks allowed per available core: gloo ranks block (not spin) while they wait, so a
#: 4x oversubscription still trains (a P x fsdp x tp layout of 8 processes on 2 cores); above
#: :data:`TIMED_RANKS_PER_CORE` the ranks time-slice and a warning says the timings are not the layout's.
CPU_RANKS_PER_CORE = 4
#: CPU ranks per core up to which measured timelines stand for the layout.
TIMED_RANKS_PER_CORE = 2
#: Process-group backends a run may ask for (``None`` picks one).
BACKENDS = ("gloo", "nccl")


def available_cores() -> int:
    """CPU cores this process may use (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS/Windows
        return os.cpu_count() or 1


def _cuda_indices(devices: Sequence[int | str | torch.device], P: int) -> tuple[int, ...]:
    """The CUDA device index of every entry of ``devices`` (one per rank, no GPU twice)."""
    indices = []
    for d in devices:
        dev = torch.device(d) if not isinstance(d, int) else torch.device("cuda", d)
        if dev.type != "cuda" or dev.index is None:
            raise ValueError(
                f"devices={list(devices)!r}: every entry must be a CUDA device index or 'cuda:i'; got {d!r}"
            )
        indices.append(dev.index)
    if len(indices) != P:
        raise ValueError(f"devices={list(devices)!r} lists {len(indices)} devices but the partition has P={P} ranks")
    if len(set(indices)) != len(indices):
        raise ValueError(f"devices={list(devices)!r} repeats a GPU; each rank needs its own")
    return tuple(indices)


def resolve_devices(
    P: int, backend: str | None, devices: object, what: str | None = None
) -> tuple[str, str, tuple[int, ...] | None]:
    """Pick ``(backend, device_type, cuda_device_per_rank)`` and refuse what this machine cannot run.

    ``devices``: ``None`` (one GPU per rank when there are GPUs, CPU processes otherwise),
    ``"cpu"``, ``"cuda"`` (GPUs ``0..P-1``) or a list of ``P`` CUDA device indices.
    ``backend``: ``None`` (``nccl`` on CUDA, ``gloo`` on CPU), ``"gloo"`` or ``"nccl"``. ``what`` names the
    ranks in the message when there are too many for this machine's cores (default ``P=...``).
    """
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is not None:
        check_choice("backend", backend, BACKENDS)
    indices: tuple[int, ...] | None
    if devices is None:
        device_type = "cuda" if n_gpus and backend != "gloo" else "cpu"
        indices = tuple(range(P)) if device_type == "cuda" else None
    elif isinstance(devices, str) and devices in ("cpu", "cuda"):
        device_type = devices
        indices = tuple(range(P)) if devices == "cuda" else None
    elif isinstance(devices, (list, tuple)):
        device_type, indices = "cuda", _cuda_indices(devices, P)
    else:
        raise TypeError(f"devices must be None, 'cpu', 'cuda' or a list of CUDA device indices; got {devices!r}")
    if device_type == "cuda":
        return _check_cuda(P, backend, devices, indices or (), n_gpus), "cuda", indices
    return _check_cpu(P, backend, what), "cpu", None


def _check_cuda(P: int, backend: str | None, devices: object, indices: tuple[int, ...], n_gpus: int) -> str:
    """The backend of CUDA ranks on ``indices``: this machine must have those GPUs; ``nccl`` only."""
    if n_gpus == 0:
        raise ValueError(f"devices={devices!r} asks for CUDA but torch sees no GPU here; use devices='cpu'")
    if max(indices) >= n_gpus:
        raise ValueError(
            f"P={P} ranks need GPUs {list(indices)} but this machine has {n_gpus} (cuda device_count); "
            "use fewer ranks or devices='cpu'"
        )
    backend = backend or "nccl"
    if backend != "nccl":
        raise ValueError(f"backend={backend!r} cannot send CUDA tensors between stages; use backend='nccl' with GPUs")
    return backend


def _check_cpu(P: int, backend: str | None, what: str | None) -> str:
    """The backend of ``P`` CPU ranks: ``gloo`` only, and no more ranks than the cores allow."""
    backend = backend or "gloo"
    if backend != "gloo":
        raise ValueError(f"backend={backend!r} needs GPUs; CPU ranks use backend='gloo'")
    cores = available_cores()
    if P > CPU_RANKS_PER_CORE * cores:
        raise ValueError(
            f"{what or f'P={P}'} CPU ranks is more than this machine can run: it has {cores} cores and the runner "
            f"allows {CPU_RANKS_PER_CORE} ranks per core ({CPU_RANKS_PER_CORE * cores})"
        )
    if P > TIMED_RANKS_PER_CORE * cores:
        import warnings

        warnings.warn(
            f"{what or f'P={P}'} CPU ranks on {cores} cores: more than {TIMED_RANKS_PER_CORE} per core time-slice, "
            "so the run trains correctly but its measured times are not the layout's",
            stacklevel=2,
        )
    return backend
