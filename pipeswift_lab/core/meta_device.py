"""Models on the meta device: their structure travels, their tensors are made where they are used, then filled.

A pipeline stage (:mod:`pipeswift_lab.runner.rank.stage_build`) and a unit profiled on its own
(:mod:`pipeswift_lab.profiling.unit_by_unit`) are made from a model's structure the same way.
The spec carries the model with every tensor of its ``state_dict`` on the meta device
(:func:`structure_reducer`), whatever the caller's model held, so a rank unpickles code and
shapes, never weights. Each rank then makes only its stages' tensors (``Module.to_empty``, as
torchtitan builds its stages: meta device, ``to_empty``, then fill) and fills them in one of two
ways (:func:`materialize`):

* **from weights** (:class:`~pipeswift_lab.runner.weights.WeightSource`): only the stage's keys are
  read (a tied weight under whichever of its names the file has);
* **by initialization** (:func:`initial_values`): every submodule of the *original* model that owns
  one of the stage's tensors is made on the device and initialized by ``init(module)`` when given,
  else by a Hugging Face model's own ``_init_weights(module)``, else by ``module.reset_parameters()``.
  Its RNG is seeded from the run's seed and the submodule's name, so a tensor starts the same
  whatever the partition, P or the rank that builds it.

Buffers that are not in the ``state_dict`` (a rotary embedding's ``inv_freq``) travel by value when
the caller's model holds them; when they are on meta they are initialized with their module.

A module split over tensor-parallel ranks while still on meta holds DTensors: :func:`materialize` fills each one's
local part (:func:`local_box`: a ``Shard(d)`` placement is ``torch.chunk``'s piece along ``d``), from the part
``fill`` gives or cut from the whole tensor it gives.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = [
    "Box",
    "InitFn",
    "alias_map",
    "parameter_names",
    "check_initializable",
    "shard_box",
    "initial_values",
    "init_owner",
    "is_meta_model",
    "local_box",
    "materialize",
    "meta_tensor",
    "name_seed",
    "shape_pass",
    "structure_reducer",
    "unfilled_buffers",
]

#: ``init(module)``: fills the tensors ``module`` itself holds (called under ``torch.no_grad``).
InitFn = Callable[[nn.Module], None]
#: A part of a tensor: one ``slice`` per dimension (``tensor[box]``).
Box = tuple[slice, ...]


def parameter_names(model: nn.Module) -> list[tuple[str, ...]]:
    """Every parameter object of ``model`` as the tuple of its names, in registration order (a tied parameter has
    several)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [tuple(names) for names in groups.values()]


def alias_map(model: nn.Module) -> dict[str, str]:
    """``{alias: canonical name}`` of every parameter of ``model`` with several names (:func:`parameter_names`): each
    name but the first maps to the first."""
    return {alias: group[0] for group in parameter_names(model) for alias in group[1:]}


def is_meta_model(model: nn.Module) -> bool:
    """Whether any tensor of ``model``'s ``state_dict`` is on the meta device."""
    return any(t.is_meta for t in model.state_dict(keep_vars=True).values())


@contextmanager
def shape_pass(
    model: nn.Module, device: torch.device | str = "cpu", *copies: nn.Module
) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """Run ``model``'s forward (or its ``copies``') for shapes only when it is on the meta device; yields
    ``lift(tensor)``, which turns an input into what that forward takes.

    A meta model runs with fake tensors on ``device`` (:func:`~pipeswift_lab.core.fake_device.faked_on`): a meta
    tensor has no values, and a forward that reads one (Hugging Face's check for packed sequences calls ``.item()``)
    sees it is being traced and skips the read; a forward that branches on its device takes the branch ``device``
    takes (on ``meta`` a mixture of experts picks kernels the CPU does not run). A model with real tensors runs as
    it is and ``lift`` returns its input."""
    if not is_meta_model(model):
        yield lambda t: t
        return
    from .fake_device import faked_on

    with faked_on([model, *copies], torch.device(device), run=True) as lift:
        yield lift


def meta_tensor(shape: tuple[int, ...], dtype: torch.dtype, parameter: bool, requires_grad: bool) -> torch.Tensor:
    """An empty tensor on the meta device (an ``nn.Parameter`` when ``parameter``); what the spec unpickles in place
    of every ``state_dict`` tensor."""
    t = torch.empty(shape, dtype=dtype, device="meta")
    return nn.Parameter(t, requires_grad=requires_grad) if parameter else t


def structure_reducer(model: nn.Module) -> Callable[[Any], Any]:
    """A pickler's ``reducer_override`` step for ``model``: each tensor of its ``state_dict`` pickles as
    :func:`meta_tensor` (shape, dtype, parameter or not); any other object gives ``NotImplemented``.

    A tied parameter is one object, so it stays one after unpickling."""
    ids = {id(t) for t in model.state_dict(keep_vars=True).values()}

    def reduce(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and id(obj) in ids:
            parameter = isinstance(obj, nn.Parameter)
            return meta_tensor, (tuple(obj.shape), obj.dtype, parameter, bool(obj.requires_grad))
        return NotImplemented

    return reduce


def name_seed(seed: int, name: str) -> int:
    """The RNG seed of the submodule ``name`` in a run seeded ``seed`` (a 63-bit digest of both)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _hf_root(model: nn.Module) -> Any:
    """The model when it is a Hugging Face ``PreTrainedModel`` (it knows its own ``_init_weights``), else None."""
    init = getattr(model, "_init_weights", None)
    return model if callable(init) and hasattr(model, "config") else None


def init_owner(model: nn.Module, module: nn.Module, init: InitFn | None) -> None:
    """Initialize the tensors ``module`` (a submodule of ``model``) itself holds: ``init(module)``, a Hugging Face
    model's ``_init_weights(module)``, or ``module.reset_parameters()``."""
    with torch.no_grad():
        if init is not None:
            init(module)
            return
        root = _hf_root(model)
        if root is not None:
            root._init_weights(module)
            return
        module.reset_parameters()  # type: ignore[operator]


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        **{n: p for n, p in module._parameters.items() if p is not None},
        **{n: b for n, b in module._buffers.items() if b is not None},
    }


def check_initializable(model: nn.Module, init: InitFn | None, names: Iterable[str] | None = None) -> None:
    """Refuse a meta model that nothing can initialize: with no ``init`` and no Hugging Face ``_init_weights``, every
    submodule holding a meta tensor (of ``names``, when given: those no weights hold) must have
    ``reset_parameters``. Raises ``ValueError`` naming the first ones."""
    if init is not None:
        if not callable(init):
            raise TypeError(f"init must be a callable init(module); got {type(init).__name__}")
        return
    if _hf_root(model) is not None:
        return
    only = None if names is None else set(names)
    lacking = []
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        held = [n for n, t in _own_tensors(module).items() if t.is_meta and (only is None or prefix + n in only)]
        if held and not callable(getattr(module, "reset_parameters", None)):
            lacking.append(f"{name or '(the model)'} ({type(module).__name__}, holding {', '.join(held)})")
    if lacking:
        what = "no weights= were given" if only is None else "the weights do not hold every tensor"
        raise ValueError(
            f"the model is on the meta device and {what}, so each rank initializes those of its stage; "
            f"{len(lacking)} submodules hold tensors and have no reset_parameters(): {'; '.join(lacking[:8])}. "
            "Give weights= (a safetensors or DCP checkpoint), or init=fn, where fn(module) fills the tensors the "
            "module holds"
        )


def unfilled_buffers(module: nn.Module) -> list[str]:
    """Names of ``module``'s buffers outside its ``state_dict`` that are on the meta device (initialized with their
    submodule, as no checkpoint holds them)."""
    persistent = set(module.state_dict(keep_vars=True))
    return [n for n, b in module.named_buffers() if b.is_meta and n not in persistent]


def initial_values(
    model: nn.Module, keys: Iterable[str], device: torch.device, seed: int, init: InitFn | None
) -> dict[str, torch.Tensor]:
    """``{key: tensor}`` for ``keys`` (names in ``model``): each owning submodule of ``model`` is made on ``device``
    (unless a stage made its tensors already: an ``nn.Sequential``'s stage shares the model's modules) and
    initialized (:func:`init_owner`) with its RNG seeded by :func:`name_seed`; a tied weight's other names take its
    canonical name's tensor, in ``model`` too. The submodules keep their tensors (the caller frees them).

    The floating tensors asked for are set to NaN before the init runs: one the init leaves untouched (a Hugging
    Face release whose ``_init_weights`` does not cover a module, a parameter a parent module owns) raises
    ``RuntimeError`` naming it, instead of training on whatever memory ``to_empty`` gave."""
    aliases = alias_map(model)
    ties = _tensor_names(model)
    keys = list(keys)
    wanted: dict[str, set[str]] = {}
    for key in keys:
        owner, _, attr = aliases.get(key, key).rpartition(".")
        wanted.setdefault(owner, set()).add(attr)
    values: dict[str, torch.Tensor] = {}
    for owner, attrs in wanted.items():
        module = model.get_submodule(owner)
        if any(t.is_meta for t in _own_tensors(module).values()):
            kept = {n: b for n, b in module._buffers.items() if b is not None and not b.is_meta}
            module.to_empty(device=device, recurse=False)
            for n, b in kept.items():
                module._buffers[n] = b.to(device)
        own = _own_tensors(module)
        with torch.no_grad():
            for attr in attrs:
                if own[attr].is_floating_point():
                    own[attr].fill_(float("nan"))
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(name_seed(seed, owner))
            init_owner(model, module, init)
        own = _own_tensors(module)
        untouched = sorted(a for a in attrs if own[a].is_floating_point() and bool(own[a].isnan().any()))
        if untouched:
            raise RuntimeError(
                f"initializing {owner or 'the model'} ({type(module).__name__}) left {untouched} unset: its init does "
                "not fill them. Give weights= that hold them, or init=fn, where fn(module) fills the tensors the "
                "module holds"
            )
        prefix = f"{owner}." if owner else ""
        values.update({prefix + n: t for n, t in own.items()})
    _retie(model, ties)  # to_empty gave the owner a tensor of its own: its other names (a tied head) follow it
    return {key: values[aliases.get(key, key)] for key in keys}


def _tensor_names(module: nn.Module) -> list[tuple[str, tuple[str, ...]]]:
    """Every parameter and buffer object of ``module`` as ``(kind, its names)``, registration order (a tied tensor
    has several names)."""
    groups: dict[int, tuple[str, list[str]]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), ("parameter", []))[1].append(name)
    for name, b in module.named_buffers(remove_duplicate=False):
        groups.setdefault(id(b), ("buffer", []))[1].append(name)
    return [(kind, tuple(names)) for kind, names in groups.values()]


def _retie(module: nn.Module, names: list[tuple[str, tuple[str, ...]]]) -> None:
    """Make every name of one tensor (``names`` from :func:`_tensor_names` before ``to_empty``) point to one object
    again: ``to_empty`` from meta makes a new tensor per module that holds it."""
    for kind, group in names:
        if len(group) < 2:
            continue
        table = "_parameters" if kind == "parameter" else "_buffers"
        first_owner, _, first_attr = group[0].rpartition(".")
        keep = getattr(module.get_submodule(first_owner) if first_owner else module, table)[first_attr]
        for name in group[1:]:
            owner, _, attr = name.rpartition(".")
            getattr(module.get_submodule(owner) if owner else module, table)[attr] = keep


def shard_box(shape: Sequence[int], dim: int, rank: int, n: int) -> Box:
    """The part of a tensor of ``shape`` that rank ``rank`` of ``n`` holds when it is split along ``dim`` as
    ``torch.chunk`` splits it (DTensor's ``Shard(dim)``): pieces of ``ceil(size / n)``, the last ones shorter or
    empty. Returns a slice per dimension, whole but ``dim``."""
    return _narrowed([(0, int(size)) for size in shape], dim, rank, n)


def _narrowed(ranges: list[tuple[int, int]], dim: int, rank: int, n: int) -> Box:
    lo, hi = ranges[dim]
    size = hi - lo
    piece = -(-size // n)
    start = min(rank * piece, size)
    ranges[dim] = (lo + start, lo + min(start + piece, size))
    return tuple(slice(a, b) for a, b in ranges)


def _is_dtensor(tensor: object) -> bool:
    if "torch.distributed.tensor" not in sys.modules:  # nothing made one
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local_box(tensor: torch.Tensor) -> Box | None:
    """The part of the whole tensor a DTensor holds on this rank (its placements applied in mesh order: ``Shard(d)``
    narrows dimension ``d`` as :func:`shard_box`, ``Replicate`` keeps it whole); ``None`` for a plain tensor.

    Raises ``ValueError`` for a placement that is not one of those (``Partial``, a strided shard) and
    ``RuntimeError`` when the part's shape is not the DTensor's local shape."""
    if not _is_dtensor(tensor):
        return None
    from torch.distributed.tensor import Replicate, Shard

    mesh, placements = tensor.device_mesh, tensor.placements  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate()
    ranges = [(0, int(size)) for size in tensor.shape]
    box: Box = tuple(slice(a, b) for a, b in ranges)
    for mesh_dim, placement in enumerate(placements):
        if type(placement) is Shard:
            if coordinate is None:
                raise RuntimeError("this rank is not in the DTensor's mesh: it holds no part of it")
            dim = placement.dim % tensor.ndim
            box = _narrowed(ranges, dim, coordinate[mesh_dim], mesh.size(mesh_dim))
        elif not isinstance(placement, Replicate):
            raise ValueError(f"cannot tell the part of a tensor placed {placement} (Shard(d) and Replicate are read)")
    with torch.no_grad():
        local = tensor.to_local()  # type: ignore[attr-defined]
    if tuple(b.stop - b.start for b in box) != tuple(local.shape):
        raise RuntimeError(f"the part {box} of a {tuple(tensor.shape)} tensor is not its local {tuple(local.shape)}")
    return box


def _fill_one(target: torch.Tensor, value: torch.Tensor) -> int:
    """Copy ``value`` into ``target``; a DTensor ``target`` takes it into its local part, ``value`` being that part
    or the whole tensor (then cut to the part). Returns the bytes filled."""
    if _is_dtensor(target) and not _is_dtensor(value):
        local = target.to_local()  # type: ignore[attr-defined]  # under no_grad: the local tensor itself
        if tuple(value.shape) != tuple(local.shape):
            box = local_box(target)
            assert box is not None
            value = value[box]
        target = local
    target.copy_(value)
    return target.numel() * target.element_size()


def materialize(
    module: nn.Module,
    device: torch.device,
    fill: Callable[[list[str]], Mapping[str, torch.Tensor]],
) -> int:
    """Make ``module``'s tensors on ``device`` (``to_empty``; buffers it holds for real, which travelled by value,
    are kept; tied tensors stay tied) and copy ``fill(keys)`` into them, for every other tensor: its ``state_dict``
    keys and its meta buffers. A key ``fill`` leaves out stays empty (a checkpoint restore fills it). A DTensor
    (a module split over tensor-parallel ranks on meta) takes ``fill``'s value into its local part: the value is
    that part (:func:`local_box`) or the whole tensor, then cut. Returns the bytes filled (this rank's)."""
    names = _tensor_names(module)
    kept = {n: b for n, b in module.named_buffers(remove_duplicate=False) if not b.is_meta}
    wanted = [k for k in module.state_dict(keep_vars=True) if k not in kept]
    wanted += [n for n in unfilled_buffers(module) if n not in wanted]
    module.to_empty(device=device)
    for name, buffer in kept.items():
        owner, _, attr = name.rpartition(".")
        (module.get_submodule(owner) if owner else module)._buffers[attr] = buffer.to(device)
    _retie(module, names)
    targets = {**dict(module.named_buffers(remove_duplicate=False)), **dict(module.state_dict(keep_vars=True))}
    filled = 0
    with torch.no_grad():
        for key, value in fill(wanted).items():
            target = targets[key]
            if target is value:
                filled += value.numel() * value.element_size()
            else:
                filled += _fill_one(target, value)
    return filled
