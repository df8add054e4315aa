"""One rank's side of a checkpoint: its layers, optimizer state and RNG states, as a flat state, and read back.

Every rank saves its own stages' state by the *full model's* names (``get_state_dict`` with
``flatten_optimizer_state_dict=True``, as torchtitan does for pipeline stages), so a checkpoint
written by P ranks loads into any other partition. A tied weight is stored once per rank, under
its canonical name (:mod:`~pipeswift_lab.runner.stages.tied`). With ``D > 1`` only replica 0 saves
the (replicated) training state; every rank saves its RNG states.

Restoring takes one of two paths:

* **the same topology** (same bounds, stage placement and world size): each rank reads the file its
  pipeline position wrote, straight into fresh tensors (one read per section), copies the model part into
  its layers and hands the optimizer part to ``Optimizer.load_state_dict``. No collective, no DCP
  planning, and no ``get_state_dict``, whose zero-learning-rate step initializes an empty optimizer
  state only to overwrite it;
* **another partition**: DCP's load, through a ``StorageReader`` over the rank files, regroups the
  state by name (``get_state_dict`` / ``set_state_dict``).

The file layout, the atomic commit and reading a checkpoint back live in
:mod:`~pipeswift_lab.runner.checkpoint_files` and :mod:`~pipeswift_lab.runner.checkpoint`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ..checkpoint_files import MODEL, OPTIM, RNG, flat_state, read_section
from ..stages.tied import canonical_key, canonical_state, spread_canonical

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    from ..checkpoint import Checkpoint


def _state_options(whole: bool = False) -> StateDictOptions:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True, full_state_dict=whole)


def rng_states(device: torch.device | str) -> dict[str, torch.Tensor]:
    """This rank's RNG states as tensors: the CPU generator, and the CUDA one on a GPU rank."""
    import torch

    states = {"cpu": torch.get_rng_state()}
    if getattr(device, "type", "cpu") == "cuda":  # pragma: no cover - needs GPUs
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def rank_flat_state(
    rank: int,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device | str,
    aliases: dict[str, str] | None = None,
    training_state: bool = True,
    direct: bool = False,
    whole: bool = False,
) -> dict[str, Any]:
    """This rank's checkpoint state, flattened into DCP's keys: ``model.<name>`` and ``optim.<...>`` (the full
    model's names, a tied weight under its canonical one; left out when not ``training_state``, as on a replica
    other than 0) and ``rng.rank<r>.<generator>``. The tensors are the live ones, not copies.

    ``direct`` reads the state without ``get_state_dict`` (:func:`direct_state_dicts`), when it can; the caller
    checks once that both agree (:func:`same_state`). ``whole`` gathers a sharded state (FSDP, tensor parallelism)
    into whole tensors first, a collective over the stage's processes: every one of them calls it, and those that
    do not keep the ``training_state`` drop it."""
    state: dict[str, Any] = {}
    if whole:
        gathered = torch_state_dicts(module, optimizer, whole=True)
    if training_state:
        found = direct_state_dicts(module, optimizer) if direct and not whole else None
        model_sd, optim_sd = gathered if whole else found if found is not None else torch_state_dicts(module, optimizer)
        aliases = aliases or {}
        state[MODEL] = canonical_state(model_sd, aliases)
        state[OPTIM] = canonical_state(optim_sd, aliases)
    state[RNG] = {f"rank{rank}": rng_states(device)}
    if any(isinstance(v, (dict, list)) for part in (MODEL, OPTIM) for v in state.get(part, {}).values()):
        return flat_state(state)  # nested values: DCP's own traversal names them
    return {f"{part}.{key}": value for part, values in state.items() for key, value in _items(part, values)}


def _items(part: str, values: dict[str, Any]) -> list[tuple[str, Any]]:
    if part == RNG:  # {"rank<r>": {generator: state}}
        return [(f"{r}.{name}", t) for r, states in values.items() for name, t in states.items()]
    return list(values.items())


def torch_state_dicts(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, whole: bool = False
) -> tuple[dict, dict]:
    """torch's ``get_state_dict`` of ``module`` and ``optimizer``, the optimizer's flattened by parameter name (sharded
    tensors gathered whole with ``whole``); an optimizer without state is left without (``get_state_dict``
    initializes it with a zero-lr step)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    untouched = not optimizer.state
    model_sd, optim_sd = get_state_dict(module, optimizer, options=_state_options(whole))
    if untouched:
        optimizer.state.clear()
    return model_sd, optim_sd


def direct_state_dicts(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict] | None:
    """What :func:`torch_state_dicts` returns, read straight from ``module.state_dict()`` and the optimizer's
    ``state`` and ``param_groups`` (torch's flattened keys ``state.<param>.<name>`` and
    ``param_groups.<param>.<hyperparameter>``, in its order) at a fraction of the cost; ``None`` for an optimizer
    without state yet, with nested state, or holding a parameter ``module`` does not name."""
    if not optimizer.state:
        return None
    names = parameter_fqns(module)
    state: dict[str, Any] = {}
    groups: dict[str, Any] = {}
    for group in optimizer.param_groups:
        hyper = [(k, v) for k, v in group.items() if k != "params"]
        for param in group["params"]:
            fqn = names.get(id(param))
            if fqn is None:
                return None
            for key, value in optimizer.state.get(param, {}).items():
                if isinstance(value, dict):
                    return None
                state[f"state.{fqn}.{key}"] = value
            groups.update((f"param_groups.{fqn}.{k}", v) for k, v in hyper)
    return module.state_dict(), {**state, **groups}


def parameter_fqns(module: torch.nn.Module, aliases: dict[str, str] | None = None) -> dict[int, str]:
    """``{id(parameter): name}`` of ``module``'s parameters, each by its first name (torch's optimizer-state key),
    mapped to its canonical name when ``aliases`` are given."""
    names: dict[int, str] = {}
    for name, param in module.named_parameters():
        names.setdefault(id(param), canonical_key(name, aliases) if aliases else name)
    return names


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two flat states hold the same keys in the same order, the same live tensors (storage, shape, dtype)
    and equal other values."""
    import torch

    if list(a) != list(b):
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.data_ptr() != y.data_ptr() or x.shape != y.shape or x.dtype != y.dtype:
                return False
        elif x != y:
            return False
    return True


def restore_rank_state(
    checkpoint: Checkpoint,
    rank: int,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    group: ProcessGroup | None,
    restore_rng: bool,
    aliases: dict[str, str] | None = None,
    pp_rank: int | None = None,
) -> dict[str, Any]:
    """Load this rank's layers and optimizer state (by name) from ``checkpoint``.

    ``restore_rng`` means the same topology as the saver's (same partition, placement and world size): the rank's
    RNG states are restored too, and when the checkpoint has rank files (format 2) the rank reads the file of its
    pipeline position (``pp_rank``, replica 0) directly. Otherwise DCP loads by name (a collective over ``group``).
    A tied weight is read under its canonical name (``aliases``: ``{alias: canonical}``) into every name the rank
    holds it by.

    Returns ``{"restore_ms", "bytes", "path"}``: the wall time, the bytes of state loaded, and ``"direct"`` or
    ``"dcp"``.
    """
    t0 = time.perf_counter()
    aliases = aliases or {}
    if restore_rng and checkpoint.ranks and pp_rank is not None:
        loaded = _restore_direct(checkpoint, rank, pp_rank, module, optimizer, device, aliases)
        if loaded is not None:
            return {"restore_ms": (time.perf_counter() - t0) * 1e3, "bytes": loaded, "path": "direct"}
    # another partition (or an optimizer state the direct read cannot rebuild): DCP's load by name
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ..checkpoint import storage_reader

    model_sd, optim_sd = get_state_dict(module, optimizer, options=_state_options())
    rng = {f"rank{rank}": {k: torch.empty_like(v) for k, v in rng_states(device).items()}} if restore_rng else {}
    state: dict[str, Any] = {MODEL: canonical_state(model_sd, aliases), OPTIM: canonical_state(optim_sd, aliases)}
    if restore_rng:
        state[RNG] = rng
    dcp.load(state, storage_reader=storage_reader(checkpoint), process_group=group)
    spread_canonical(state[MODEL], model_sd, aliases)
    spread_canonical(state[OPTIM], optim_sd, aliases)
    set_state_dict(module, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=_state_options())
    if restore_rng:
        _set_rng(rng[f"rank{rank}"], device)
    return {"restore_ms": (time.perf_counter() - t0) * 1e3, "bytes": state_bytes(state), "path": "dcp"}


def _restore_direct(
    checkpoint: Checkpoint,
    rank: int,
    pp_rank: int,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    aliases: dict[str, str],
) -> int | None:
    """Read this rank's state from the file its pipeline position wrote; ``None`` when the optimizer's state cannot
    be rebuilt from it without DCP (nested state names), and then nothing was changed."""
    records = {r["rank"]: r for r in checkpoint.ranks}
    own = records.get(rank)
    saver = next((r for r in checkpoint.ranks if r["pp_rank"] == pp_rank and r["replica"] == 0), None)
    if own is None or saver is None:
        return None
    optim_keys = [k for k in saver["tensors"] if k.startswith(OPTIM + ".")]
    optim_keys += [k for k in saver["objects"] if k.startswith(OPTIM + ".")]
    optim_flat = read_section(checkpoint.path / saver["file"], saver, optim_keys)
    optim_state = _optimizer_state_dict(optimizer, module, optim_flat, aliases)
    if optim_state is None:
        return None
    model_keys = {key: f"{MODEL}.{canonical_key(key, aliases)}" for key in module.state_dict()}
    model_flat = read_section(checkpoint.path / saver["file"], saver, sorted(set(model_keys.values())))
    module.load_state_dict({key: model_flat[flat] for key, flat in model_keys.items()})
    optimizer.load_state_dict(optim_state)
    rng_prefix = f"{RNG}.rank{rank}."
    rng = read_section(checkpoint.path / own["file"], own, [k for k in own["tensors"] if k.startswith(rng_prefix)])
    _set_rng({k[len(rng_prefix) :]: v for k, v in rng.items()}, device)
    return state_bytes(model_flat) + state_bytes(optim_flat)


def _optimizer_state_dict(
    optimizer: torch.optim.Optimizer, module: torch.nn.Module, flat: dict[str, Any], aliases: dict[str, str]
) -> dict[str, Any] | None:
    """``optimizer.state_dict()``'s form of a flattened optimizer state (torch's ``state.<param>.<name>`` and
    ``param_groups.<param>.<hyperparameter>`` keys), for this rank's parameters in the optimizer's order; ``None``
    when a key does not split into a parameter of ``module`` and one name."""
    names = parameter_fqns(module, aliases)
    known = set(names.values())
    per_param: dict[str, dict[str, Any]] = {}
    hyper: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        section, _, rest = key[len(OPTIM) + 1 :].partition(".")
        fqn, _, name = rest.rpartition(".")
        if fqn not in known or section not in ("state", "param_groups"):
            return None
        (per_param if section == "state" else hyper).setdefault(fqn, {})[name] = value
    state: dict[int, dict[str, Any]] = {}
    groups, index = [], 0
    for group in optimizer.param_groups:
        ids = []
        for param in group["params"]:
            held = names.get(id(param))
            if held is None:
                return None
            if held in per_param:
                state[index] = per_param[held]
            ids.append(index)
            index += 1
        first = names[id(group["params"][0])] if group["params"] else None
        if first not in hyper:
            return None
        groups.append({**hyper[first], "params": ids})
    return {"state": state, "param_groups": groups}


def _set_rng(saved: dict[str, torch.Tensor], device: torch.device) -> None:
    import torch

    torch.set_rng_state(saved["cpu"])
    if "cuda" in saved:  # pragma: no cover - needs GPUs
        torch.cuda.set_rng_state(saved["cuda"], device)


def state_bytes(obj: object) -> int:
    """Bytes of the tensors in a (nested) state dict: what a rank's parameters and optimizer state weigh."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    return 0


__all__ = [
    "direct_state_dicts",
    "parameter_fqns",
    "rank_flat_state",
    "restore_rank_state",
    "rng_states",
    "same_state",
    "state_bytes",
    "torch_state_dicts",
]
