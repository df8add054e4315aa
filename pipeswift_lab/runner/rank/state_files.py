"""One rank's side of a checkpoint: its layers, optimizer state and RNG states, written and read with DCP.

Every rank saves and loads its own stages' state by the *full model's* names (``get_state_dict``
with ``flatten_optimizer_state_dict=True``, as torchtitan does for pipeline stages), so a
checkpoint written by P ranks loads into any other partition. A tied weight is stored once,
under its canonical name (:mod:`~pipeswift_lab.runner.stages.tied`). The directory layout,
the atomic commit and reading a checkpoint back live in :mod:`~pipeswift_lab.runner.checkpoint`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checkpoint import MODEL, OPTIM, RNG, sha256_of
from ..stages.tied import canonical_state, spread_canonical

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.state_dict import StateDictOptions


def _state_options() -> StateDictOptions:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def rng_states(device: torch.device | str) -> dict[str, torch.Tensor]:
    """This rank's RNG states as tensors: the CPU generator, and the CUDA one on a GPU rank."""
    import torch

    states = {"cpu": torch.get_rng_state()}
    if getattr(device, "type", "cpu") == "cuda":  # pragma: no cover - needs GPUs
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def save_rank_state(
    tmp_dir: Path,
    rank: int,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    group: ProcessGroup | None,
    step: int | None = None,
    fault: dict[str, Any] | None = None,
    aliases: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Write this rank's layers, optimizer state and RNG states into ``tmp_dir`` with DCP (a collective).

    ``aliases`` (``{alias: canonical}``, the names of tied weights) store a shared tensor once, under its canonical
    name, whichever names the rank holds it by (DCP writes a key that several ranks hold once).

    ``fault`` is a :func:`~pipeswift_lab.runner.faults.write_fault` the run carries, matched against ``step`` (steps
    done).

    Returns ``{"files": {name: {"bytes", "sha256"}}, "save_ms"}`` for this rank's own files,
    hashed right after DCP wrote (and fsynced) them.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from ..faults import raise_write_fault

    t0 = time.perf_counter()
    raise_write_fault(fault, step, rank, tmp_dir)
    untouched = not optimizer.state  # get_state_dict initializes an empty state with a zero-lr step: undo it after
    model_sd, optim_sd = get_state_dict(module, optimizer, options=_state_options())
    aliases = aliases or {}
    state = {
        MODEL: canonical_state(model_sd, aliases),
        OPTIM: canonical_state(optim_sd, aliases),
        RNG: {f"rank{rank}": rng_states(device)},
    }
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_dir), sync_files=True), process_group=group)
    if untouched:
        optimizer.state.clear()
    save_ms = (time.perf_counter() - t0) * 1e3
    files = {}
    for path in sorted(tmp_dir.glob(f"__{rank}_*.distcp")):
        files[path.name] = {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
    return {"files": files, "save_ms": save_ms, "state_bytes": state_bytes(state)}


def restore_rank_state(
    path: Path,
    rank: int,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    group: ProcessGroup | None,
    restore_rng: bool,
    aliases: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Load this rank's layers and optimizer state (by name) from the checkpoint at ``path`` (a collective).

    A tied weight is read under its canonical name (``aliases``: ``{alias: canonical}``) into every name the rank
    holds it by.

    With ``restore_rng`` (same partition as the saver) the rank's RNG states are restored too.
    Returns ``{"restore_ms", "bytes"}``: the wall time and the bytes of state this rank loaded.
    """
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    t0 = time.perf_counter()
    model_sd, optim_sd = get_state_dict(module, optimizer, options=_state_options())
    rng = {f"rank{rank}": {k: torch.empty_like(v) for k, v in rng_states(device).items()}} if restore_rng else {}
    aliases = aliases or {}
    state: dict[str, Any] = {MODEL: canonical_state(model_sd, aliases), OPTIM: canonical_state(optim_sd, aliases)}
    if restore_rng:
        state[RNG] = rng
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), process_group=group)
    spread_canonical(state[MODEL], model_sd, aliases)
    spread_canonical(state[OPTIM], optim_sd, aliases)
    set_state_dict(module, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=_state_options())
    if restore_rng:
        saved = rng[f"rank{rank}"]
        torch.set_rng_state(saved["cpu"])
        if "cuda" in saved:  # pragma: no cover - needs GPUs
            torch.cuda.set_rng_state(saved["cuda"], device)

    return {"restore_ms": (time.perf_counter() - t0) * 1e3, "bytes": state_bytes(state)}


def state_bytes(obj: object) -> int:
    """Bytes of the tensors in a (nested) state dict: what a rank's parameters and optimizer state weigh."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    return 0


__all__ = ["restore_rank_state", "rng_states", "save_rank_state", "state_bytes"]
