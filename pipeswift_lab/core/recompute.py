"""Activation recomputation: which layers keep only their input, or their matrix multiplications' results, and
recompute the rest in the backward (what each stage of a run does, and what the profiler measures).

``run(..., recompute=...)`` takes:

* ``None`` — nothing is recomputed;
* ``"full"`` — every layer of every stage keeps only its input and runs its forward again in its
  backward (Chen et al., *Training Deep Nets with Sublinear Memory Cost*, 2016; Megatron-LM's
  full recomputation, torchtitan's per-layer activation checkpointing);
* ``"selective"`` — within every layer, the results of the matrix multiplications are kept and
  everything else is recomputed: normalizations, activation functions (GELU, SiLU and SwiGLU's
  product, ReLU), softmax and attention's core (``scaled_dot_product_attention``, the ``QKᵀ``
  scores and their softmax where attention is written out), dropout, residual additions and
  reshapes. That is Megatron-LM's selective recomputation (Korthikanti et al., *Reducing
  Activation Recomputation in Large Transformer Models*, 2022), which recomputes attention's
  core, extended to every cheap operator the way torchtitan's operator-level policy does: in
  an attention block the Q, K, V and output projections' results stay, in an FFN block the up
  (and gate) and down projections' results stay;
* ``{stage: [layer names or globs]}`` — full recomputation of the named layers of each listed
  stage (``"blocks.*"`` matches ``blocks.0``, ``blocks.1``, ...), nothing elsewhere; ``{stage:
  "full" | "selective"}`` — all of a stage's layers in that mode (what the planner chooses).

Every recomputed layer runs under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``
(selective: with ``create_selective_checkpoint_contexts`` and a policy per operator), wrapped around
the layer's own ``forward`` so the state keys do not change. The non-reentrant checkpoint works
under every schedule, the zero-bubble ones included, whose input and weight gradients are computed
in two passes; it restores the random state for the recomputation, so dropout draws the same masks.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "RECOMPUTE_MODES",
    "recomputing",
    "RecomputePlan",
    "apply_recompute",
    "plan_recompute",
    "recompute_weight_pass_once",
    "SAVED_OPS",
    "schedule_splits_backward",
]

#: The string choices of ``recompute``.
RECOMPUTE_MODES = ("full", "selective")


def _ops(*names: str) -> frozenset[Any]:
    found: list[Any] = []
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            found.extend(getattr(packet, overload) for overload in packet.overloads())
    return frozenset(found)


#: The operators whose results selective recomputation keeps: the matrix multiplications.
SAVED_OPS = _ops("mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "_scaled_mm")


def schedule_splits_backward(schedule: Any) -> bool:
    """Whether ``schedule`` (a name, a :class:`~pipeswift_lab.core.schedule.Schedule` or None) runs a stage's backward
    in two passes, input gradients then weight gradients."""
    from .vocabulary import splits_backward

    return schedule is not None and splits_backward(schedule)


def _selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


@dataclass(frozen=True)
class RecomputePlan:
    """What each stage recomputes: ``layers[s]`` the layer names of stage ``s`` run under a checkpoint, in the mode
    ``modes[s]``: ``"full"`` (each keeps only its input) or ``"selective"`` (each keeps its matrix multiplications'
    results); ``""`` where the stage recomputes nothing."""

    layers: tuple[tuple[str, ...], ...]
    modes: tuple[str, ...]

    def stage_layers(self, stage: int) -> tuple[str, ...]:
        """The layers of ``stage`` that recompute."""
        return self.layers[stage] if stage < len(self.layers) else ()

    def stage_mode(self, stage: int) -> str:
        """How ``stage``'s layers recompute (``""``: they do not)."""
        return self.modes[stage] if stage < len(self.modes) else ""

    @property
    def active(self) -> bool:
        """Whether any layer recomputes."""
        return any(self.layers)

    def layer_modes(self) -> dict[str, str] | None:
        """``{layer name: mode}`` of every layer that recomputes (None: none does)."""
        if not self.active:
            return None
        return {name: mode for names, mode in zip(self.layers, self.modes) for name in names}


def plan_recompute(recompute: Any, stage_layers: Sequence[Sequence[str]]) -> RecomputePlan | None:
    """Check ``recompute`` (``None``, ``"full"``, ``"selective"``, or ``{stage: [names or globs]}`` for full
    recomputation of those layers, or ``{stage: "full" | "selective"}`` for all of a stage's) against the stages'
    layer names (``stage_layers[s]``, in order); return the :class:`RecomputePlan` (None: nothing recomputes).

    Raises ``TypeError``/``ValueError`` naming the bad value: an unknown mode, a stage that does not exist, a name or
    glob that matches no layer of its stage.
    """
    if recompute is None:
        return None
    n = len(stage_layers)
    if isinstance(recompute, str):
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(
                f"recompute={recompute!r} is not one of {list(RECOMPUTE_MODES)}, None, or a dict {{stage: [layer names "
                "or globs]}}"
            )
        return RecomputePlan(tuple(tuple(names) for names in stage_layers), (recompute,) * n)
    if not isinstance(recompute, Mapping):
        raise TypeError(
            f"recompute must be None, 'full', 'selective' or a dict {{stage: [layer names or globs]}}; got "
            f"{type(recompute).__name__} {recompute!r}"
        )
    chosen: list[tuple[str, ...]] = [() for _ in range(n)]
    modes = [""] * n
    for stage, patterns in recompute.items():
        if not isinstance(stage, int) or isinstance(stage, bool) or not 0 <= stage < n:
            raise ValueError(f"recompute has stage {stage!r}; the partition has stages 0..{n - 1}")
        names = list(stage_layers[stage])
        if isinstance(patterns, str):
            if patterns not in RECOMPUTE_MODES:
                raise ValueError(
                    f"recompute[{stage}]={patterns!r} is not one of {list(RECOMPUTE_MODES)} or a list of layer names "
                    "or globs"
                )
            chosen[stage], modes[stage] = tuple(names), patterns
            continue
        if not isinstance(patterns, Sequence):
            raise TypeError(f"recompute[{stage}] must be a list of layer names or globs, or a mode; got {patterns!r}")
        picked: list[str] = []
        for pattern in patterns:
            matched = [name for name in names if name == pattern or fnmatch.fnmatchcase(name, str(pattern))]
            if not matched:
                raise ValueError(
                    f"recompute[{stage}] names {pattern!r}, which matches none of stage {stage}'s layers {names}"
                )
            picked += [name for name in matched if name not in picked]
        chosen[stage] = tuple(name for name in names if name in picked)
        modes[stage] = "full" if chosen[stage] else ""
    return RecomputePlan(tuple(chosen), tuple(modes))


def _reusable_contexts() -> tuple[Any, Any]:
    """torch's selective-checkpoint contexts with a cache a second backward may read again.

    torch's cache hands each kept result out once ("You are only allowed to backward once on any
    region computed under selective activation checkpoint"), but the zero-bubble schedules run
    two backwards over a stage's graph: its input gradients (``I``), then its weight gradients
    (``W``), each recomputing. Here a result handed out stays until the graph is freed.
    """
    from collections import defaultdict

    from torch.utils import checkpoint as ckpt

    consumed = ckpt._CONSUMED

    class KeepEntries(dict):
        def __setitem__(self, key: Any, value: Any) -> None:
            if value is not consumed:
                super().__setitem__(key, value)

    storage: defaultdict[Any, dict[int, Any]] = defaultdict(KeepEntries)
    return ckpt._CachingTorchDispatchMode(_selective_policy, storage), ckpt._CachedTorchDispatchMode(None, storage)


def _checkpointed(forward: Callable[..., Any], selective: bool, twice: bool) -> Callable[..., Any]:
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    if not selective:
        context = None
    elif twice:
        context = _reusable_contexts
    else:
        context = functools.partial(create_selective_checkpoint_contexts, _selective_policy)

    def recomputed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if context is None:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)

    return recomputed


def apply_recompute(module: nn.Module, layers: Sequence[str], mode: str, *, split_backward: bool = False) -> int:
    """Run each of ``layers`` (submodule names of ``module``) under a checkpoint, in place; return how many.

    ``mode`` ``"full"`` keeps each layer's input only, ``"selective"`` its matrix multiplications' results too;
    ``split_backward``: the schedule runs two backwards over the graph (``I`` then ``W``). Raises ``ValueError`` for a
    name that is not a submodule of ``module``.
    """
    modules = dict(module.named_modules())
    for name in layers:
        layer = modules.get(name)
        if layer is None:
            raise ValueError(
                f"recompute: {name!r} is not a submodule of the stage (its submodules: {list(modules)[:12]})"
            )
        layer.forward = _checkpointed(layer.forward, selective=mode == "selective", twice=split_backward)
    return len(layers)


def recompute_weight_pass_once(stage: Any) -> Any:
    """Make ``stage`` (a torch ``PipelineStage`` or traced ``_PipelineStage``) recompute its checkpointed layers at
    most once per weight-gradient (``W``) pass; return the stage.

    torch's ``stage_backward_weight`` takes one ``torch.autograd.grad`` per parameter group, each a graph task of its
    own, and a non-reentrant checkpoint recomputes its region once per graph task: a block with six weight matrices
    ran its forward six times in every ``W`` and kept what each time left unread until the graph was freed (a
    recomputing ZBVZeroBubble step took 2.6 times its step without; torchtitan#773 saw zero-bubble schedules slow
    down under activation checkpointing). Under one ``torch.utils.checkpoint.GraphExecGroup`` per ``W`` the groups,
    which read disjoint saved tensors, share one recomputation. The input-gradient (``I``) pass is one graph task
    and recomputes once already.
    """
    from torch.utils.checkpoint import GraphExecGroup

    weight_pass = stage.backward_weight_one_chunk

    def once(*args: Any, **kwargs: Any) -> Any:
        with GraphExecGroup():
            return weight_pass(*args, **kwargs)

    stage.backward_weight_one_chunk = once
    return stage


@contextlib.contextmanager
def recomputing(layers: Sequence[nn.Module], mode: str, *, split_backward: bool = False) -> Iterator[None]:
    """Within the block every module of ``layers`` runs under a checkpoint (``mode`` ``"full"`` or ``"selective"``;
    ``split_backward``: as :func:`apply_recompute` wraps it for two backwards, ``I`` then ``W``); afterwards each
    runs as it did (the profiler measures what a layer costs recomputed)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"mode={mode!r} is not one of {list(RECOMPUTE_MODES)}")
    saved = [(layer, layer.__dict__.get("forward")) for layer in layers]
    try:
        for layer in layers:
            layer.forward = _checkpointed(layer.forward, selective=mode == "selective", twice=split_backward)
        yield
    finally:
        for layer, before in saved:
            if before is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = before
