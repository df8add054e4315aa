"""Tied weights across pipeline stages, kept in sync as Megatron-LM keeps its shared embedding.

A model that uses one parameter in two places (GPT-2's token embedding and LM head, a
``F.linear(h, self.embed.weight)`` head) lands that parameter in two stages once it is cut.
Every stage that holds it keeps a copy; the copies start equal, and after every step's
backward their gradients are summed between the stages that hold them, before the optimizer
step, so every copy takes the same update and a run equals single-process training
(Shoeybi et al., *Megatron-LM*, 2019, §3; Narayanan et al., SC 2021, keep the first and last
stage's embedding copies in sync the same way). A stage that holds a copy it never uses adds
a zero gradient.

A :class:`TiedGroup` is found for every parameter object of the model (all of its names, in
``named_parameters(remove_duplicate=False)`` order) that more than one stage holds under any
of its names. Its first name is the *canonical* one: checkpoints store the tensor once under
it, and :func:`with_aliases` gives every alias back in ``model.state_dict()``'s keys.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...core.meta_device import alias_map, parameter_names

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class TiedGroup:
    """One parameter shared by several stages: its ``names`` in the model and the ``stages`` that hold a copy."""

    names: tuple[str, ...]
    """Every name of the parameter in ``model.named_parameters(remove_duplicate=False)``, canonical first."""
    stages: tuple[int, ...]
    """The stages holding a copy under any of the names, ascending."""

    @property
    def canonical(self) -> str:
        """The name the checkpoints store the tensor under."""
        return self.names[0]


def tied_groups(model: nn.Module, stage_tensors: Sequence[Mapping[str, torch.Tensor]]) -> tuple[TiedGroup, ...]:
    """The parameters of ``model`` that more than one stage holds; ``stage_tensors[s]`` is stage ``s``'s state dict.

    Raises ``ValueError`` when a stage's copy does not have the model's shape (it could not be
    kept in sync with the others).
    """
    shapes = dict(model.named_parameters(remove_duplicate=False))
    found = []
    for names in parameter_names(model):
        stages = tuple(s for s, tensors in enumerate(stage_tensors) if any(n in tensors for n in names))
        if len(stages) < 2:
            continue
        want = tuple(shapes[names[0]].shape)
        for s in stages:
            for n in names:
                if n in stage_tensors[s] and tuple(stage_tensors[s][n].shape) != want:
                    raise ValueError(
                        f"tied weights {list(names)}: stage {s} holds {n!r} with shape "
                        f"{list(stage_tensors[s][n].shape)}, the model's tensor is {list(want)}; copies of different "
                        "shapes cannot be kept in sync. Tie the parameters by object (head.weight = embed.weight) "
                        "or untie them"
                    )
        found.append(TiedGroup(names, stages))
    return tuple(found)


def unheld_keys(model: nn.Module, stage_tensors: Sequence[Mapping[str, torch.Tensor]]) -> list[str]:
    """The keys of ``model.state_dict()`` that no stage holds under any name of their tensor
    (``stage_tensors[s]``: stage ``s``'s state dict).

    A parameter reachable under two names (BERT's ``cls.predictions.bias``, an alias of
    ``cls.predictions.decoder.bias``) is held when a stage holds either: torch's tracer keeps
    one name, and :func:`with_aliases` gives the other back.
    """
    held = set().union(*(set(tensors) for tensors in stage_tensors))
    names_of = {name: group for group in parameter_names(model) for name in group}
    return [k for k in model.state_dict() if not any(n in held for n in names_of.get(k, (k,)))]


def with_aliases(
    state: Mapping[str, torch.Tensor], keys: Sequence[str], names: Iterable[tuple[str, ...]]
) -> dict[str, torch.Tensor]:
    """``state`` keyed by ``keys`` (``model.state_dict()``'s), a name of a shared parameter taken from any copy held.

    ``names`` are the parameters' names (:func:`parameter_names`); the names of one parameter
    map to one tensor, as in the model. Raises ``KeyError`` naming a key no copy provides.
    """
    names = [group for group in names if len(group) > 1]
    names_of = {name: group for group in names for name in group}
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        if key in state:
            out[key] = state[key]
            continue
        source = next((n for n in names_of.get(key, ()) if n in state), None)
        if source is None:
            raise KeyError(key)
        out[key] = state[source]
    for group in names:  # one tensor per parameter, as model.state_dict() has
        held = [n for n in group if n in out]
        for n in held[1:]:
            out[n] = out[held[0]]
    return out


def canonical_key(key: str, aliases: dict[str, str]) -> str:
    """``key`` of a model or a flattened optimizer state dict (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``)
    with a tied weight's alias FQN replaced by its canonical one."""
    if key in aliases:
        return aliases[key]
    for prefix in ("state.", "param_groups."):
        if key.startswith(prefix):
            rest = key[len(prefix) :]
            for alias in sorted(aliases, key=len, reverse=True):
                if rest.startswith(alias + "."):
                    return prefix + aliases[alias] + rest[len(alias) :]
    return key


def canonical_state(state: dict[str, Any], aliases: dict[str, str]) -> dict[str, Any]:
    """``state`` with every key under its canonical name (:func:`canonical_key`), a tied tensor once (the first)."""
    if not aliases:
        return dict(state)
    out: dict[str, Any] = {}
    for key, value in state.items():
        out.setdefault(canonical_key(key, aliases), value)
    return out


def spread_canonical(loaded: dict[str, Any], state: dict[str, Any], aliases: dict[str, str]) -> None:
    """Copy what DCP loaded under canonical names (``loaded``) into every key of ``state`` that maps to it."""
    for key, value in list(state.items()):
        source = loaded[canonical_key(key, aliases)]
        if source is value:
            continue
        if hasattr(value, "copy_") and hasattr(source, "shape"):
            value.copy_(source)
        else:
            state[key] = source


def unify_copies(module: nn.Module, groups: Iterable[TiedGroup]) -> None:
    """Make every name of a tied group that ``module`` holds point to one parameter object (its first copy).

    torch's tracer can leave a stage two copies of one tensor under two names (one of them
    unused); after this a stage holds each tied tensor once, as the model did.
    """
    for g in groups:
        held = [(n, p) for n, p in module.named_parameters(remove_duplicate=False) if n in g.names]
        if len(held) < 2:
            continue
        keep = held[0][1]
        for name, _ in held[1:]:
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            owner._parameters[attr] = keep


def unique_parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The parameters of ``modules``, each object once, in order (what an optimizer takes)."""
    seen: set[int] = set()
    out = []
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


class TiedGradients:
    """Sums the gradients of every tied group's copies between the stages that hold them, every step.

    Built on every rank, in the same order (it creates one process group per tied group that
    spans several pipeline ranks, per replica): ``groups`` from the spec, ``stage_modules`` the
    rank's ``{stage: module}`` (unwrapped from DDP), ``stage_to_rank`` the plan's placement,
    ``P``/``D``/``replica`` the mesh. With ``D > 1`` DDP has averaged each copy over the
    replicas already, so the sum runs inside one replica.
    """

    def __init__(
        self,
        groups: Sequence[TiedGroup],
        stage_modules: Mapping[int, nn.Module],
        stage_to_rank: Sequence[int],
        *,
        P: int,
        D: int,
        replica: int,
    ) -> None:
        import torch.distributed as dist

        from ...core.layout import global_rank

        self.copies: list[list[nn.Parameter]] = []
        self.process_groups: list[ProcessGroup | None] = []
        for g in groups:
            ranks = sorted({stage_to_rank[s] for s in g.stages})
            mine: ProcessGroup | None = None
            if len(ranks) > 1:
                for d in range(D):  # every rank creates every group, in one order
                    pg = dist.new_group([global_rank(r, d, D=D) for r in ranks])  # the (pp, dp, ...) mesh's ranks
                    if d == replica:
                        mine = pg
            params: list[nn.Parameter] = []
            for s in g.stages:
                if s not in stage_modules:
                    continue
                named = dict(stage_modules[s].named_parameters(remove_duplicate=False))
                p = next((named[n] for n in g.names if n in named), None)
                if p is not None and all(p is not q for q in params):
                    params.append(p)
            self.copies.append(params)
            self.process_groups.append(mine if params else None)

    def sync(self) -> None:
        """Give every copy the sum of all copies' gradients (a missing gradient counts as zero)."""
        import torch.distributed as dist

        for params, pg in zip(self.copies, self.process_groups):
            if not params:
                continue
            total = torch.zeros_like(params[0])
            for p in params:
                if p.grad is not None:
                    total += p.grad
            if pg is not None:
                dist.all_reduce(total, group=pg)
            for p in params:
                p.grad = total if p is params[0] else total.clone()


__all__ = [
    "alias_map",
    "canonical_key",
    "canonical_state",
    "parameter_names",
    "spread_canonical",
    "tied_groups",
    "TiedGradients",
    "TiedGroup",
    "unify_copies",
    "unheld_keys",
    "unique_parameters",
    "with_aliases",
]
