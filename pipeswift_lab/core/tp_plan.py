"""A tensor-parallel plan: which modules shard, in which style, and which degrees ``tp`` can take.

A plan is ``{module glob: style}``, Hugging Face's form (``config.base_model_tp_plan``, a model's ``tp_plan``):
the glob is matched against the model's module names (``fnmatch``: ``*`` matches any characters, dots too), the
style is one of :data:`STYLES`. Hugging Face models carry their own plan (``model.tp_plan``); the toolkit's
reference models carry one too (:mod:`pipeswift_lab.models`); ``tp_plan=`` gives one for any model.

The styles are Hugging Face's names (``transformers/distributed/tensor_parallel.py``, ``ALL_PARALLEL_STYLES``);
:mod:`pipeswift_lab.runner.stages.tensor_parallel` applies them with torch's DTensor ``parallelize_module``:

======================================  ==========================  =============================================
style                                   module                      shards
======================================  ==========================  =============================================
``colwise``                             ``nn.Linear``               the output features; the output stays sharded
``colwise_gather_output`` (``colwise_rep``)  ``nn.Linear``          the output features; the output is gathered
``rowwise``                             ``nn.Linear``               the input features; the output is all-reduced
``rowwise_split_input`` (``rowwise_rep``)    ``nn.Linear``          as rowwise, from a whole (replicated) input
``embedding_rowwise``                   ``nn.Embedding``            the vocabulary; the lookups are all-reduced
``embedding_colwise``                   ``nn.Embedding``            the embedding dimension; gathered
``replicated_with_grad_allreduce``      any                         nothing: the gradients are summed over ``tp``
``sequence_parallel``                   a norm                      the sequence dimension of its input
======================================  ==========================  =============================================

A fused projection (a ``qkv`` whose output is split into q, k and v, a ``gate_up``) is correct only as
``colwise_gather_output`` followed by ``rowwise_split_input``: a plain colwise cut would hand each rank pieces of
several of the fused outputs.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from .checks import check_flag, check_int

__all__ = [
    "STYLES",
    "TP",
    "as_tp",
    "check_tp",
    "model_tp_plan",
    "resolve_tp_plan",
    "tp_divides",
    "tp_targets",
]

#: The styles a plan may name, and the kind of module each applies to (``None``: any module).
STYLES: dict[str, type[nn.Module] | None] = {
    "colwise": nn.Linear,
    "colwise_gather_output": nn.Linear,
    "colwise_rep": nn.Linear,
    "rowwise": nn.Linear,
    "rowwise_split_input": nn.Linear,
    "rowwise_rep": nn.Linear,
    "embedding_rowwise": nn.Embedding,
    "embedding_colwise": nn.Embedding,
    "replicated_with_grad_allreduce": None,
    "sequence_parallel": None,
}
_COLWISE = ("colwise", "colwise_gather_output", "colwise_rep")
_ROWWISE = ("rowwise", "rowwise_split_input", "rowwise_rep")
#: Styles whose output holds this rank's heads (the attention that follows runs on ``heads / tp`` of them).
_SHARDED_OUTPUT = ("colwise",)


def model_tp_plan(model: nn.Module) -> dict[str, str] | None:
    """The plan ``model`` carries: a Hugging Face model's ``tp_plan`` (its config's ``base_model_tp_plan`` under the
    base model's prefix, with the head's), a reference model's ``tp_plan`` attribute; ``None`` when it has none."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, Mapping) and plan:
        return {str(k): str(v) for k, v in plan.items()}
    return None


def resolve_tp_plan(model: nn.Module, tp_plan: Mapping[str, str] | None, tp: int = 1) -> dict[str, str] | None:
    """The plan a run with ``tp`` tensor-parallel ranks applies: ``tp_plan`` when given (checked), else the model's
    own (:func:`model_tp_plan`); ``None`` when ``tp == 1`` and none was given.

    Raises ``TypeError`` for a plan that is not a ``{str: str}`` mapping and ``ValueError`` for ``tp > 1`` on a model
    with no plan and no ``tp_plan=``, a style not in :data:`STYLES`, a glob that matches no module of ``model``, a
    style on a module it does not apply to, and a ``tp`` that does not divide what the plan shards
    (:func:`check_tp`)."""
    if tp_plan is not None:
        if not isinstance(tp_plan, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in tp_plan.items()
        ):
            raise TypeError(
                "tp_plan must be a dict of {module glob: style}, e.g. {'layers.*.mlp.up': 'colwise', "
                f"'layers.*.mlp.down': 'rowwise'}}; got {type(tp_plan).__name__}"
            )
        plan: dict[str, str] | None = dict(tp_plan)
    else:
        plan = model_tp_plan(model) if tp > 1 else None
    if plan is None:
        if tp > 1:
            raise ValueError(
                f"tp={tp} needs a tensor-parallel plan, and the {type(model).__name__} carries none (no tp_plan "
                "attribute, no Hugging Face base_model_tp_plan): pass tp_plan={module glob: style}, styles from "
                f"{sorted(STYLES)}"
            )
        return None
    check_tp(model, tp_targets(model, plan, strict=tp_plan is not None), tp)
    return plan


def tp_targets(model: nn.Module, plan: Mapping[str, str], *, strict: bool = True) -> dict[str, str]:
    """``{module name: style}`` of every module of ``model`` the plan matches, checked.

    Raises ``ValueError`` for an unknown style, a glob matching no module (``strict``: a plan the caller wrote; a
    model's own plan may name modules some of its layers lack, as a mixture-of-experts model's dense MLP), a style
    on a module it does not apply to, and a module two globs give different styles."""
    unknown = {glob: style for glob, style in plan.items() if style not in STYLES}
    if unknown:
        raise ValueError(f"tp_plan names styles {unknown} that are not known; the styles are {sorted(STYLES)}")
    modules = {name: module for name, module in model.named_modules() if name}
    targets: dict[str, str] = {}
    for glob, style in plan.items():
        matched = [name for name in modules if fnmatch.fnmatchcase(name, glob)]
        if not matched and strict:
            sample = list(modules)[:6]
            raise ValueError(
                f"tp_plan glob {glob!r} matches no module of the {type(model).__name__} (its modules are named "
                f"like {sample}); a glob is matched against the full model's module names"
            )
        kind = STYLES[style]
        for name in matched:
            if kind is not None and not isinstance(modules[name], kind):
                raise ValueError(
                    f"tp_plan gives {name!r} ({type(modules[name]).__name__}) the style {style!r}, which applies to "
                    f"{kind.__name__} modules"
                )
            if targets.get(name, style) != style:
                raise ValueError(f"tp_plan gives {name!r} two styles: {targets[name]!r} and {style!r}")
            targets[name] = style
    return targets


def tp_divides(model: nn.Module, targets: Mapping[str, str]) -> dict[str, int]:
    """What ``tp`` must divide under the plan whose matched modules are ``targets``: ``{what: size}`` for every
    sharded dimension (``"<module>.out_features"``, ...) and, when a colwise output reaches attention, the model's
    attention heads and key/value heads (a rank computes whole heads)."""
    modules = dict(model.named_modules())
    sizes: dict[str, int] = {}
    for name, style in targets.items():
        module = modules[name]
        if isinstance(module, nn.Linear):
            if style in _COLWISE:
                sizes[f"{name}.out_features"] = module.out_features
            elif style in _ROWWISE:
                sizes[f"{name}.in_features"] = module.in_features
        elif isinstance(module, nn.Embedding):
            if style == "embedding_rowwise":
                sizes[f"{name}.num_embeddings"] = module.num_embeddings
            elif style == "embedding_colwise":
                sizes[f"{name}.embedding_dim"] = module.embedding_dim
    if any(style in _SHARDED_OUTPUT for style in targets.values()):
        sizes.update(_heads(model))
    return sizes


def _heads(model: nn.Module) -> dict[str, int]:
    """The attention heads and key/value heads a model's config names (Hugging Face names)."""
    config: Any = getattr(model, "config", None)
    if config is None:
        return {}
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    out = {}
    for key in ("num_attention_heads", "num_key_value_heads"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            out[f"config.{key}"] = value
    return out


def check_tp(model: nn.Module, targets: Mapping[str, str], tp: int) -> None:
    """Raise ``ValueError`` naming every size the plan shards that ``tp`` does not divide, with the degrees that
    would."""
    if tp <= 1:
        return
    sizes = tp_divides(model, targets)
    bad = {what: size for what, size in sizes.items() if size % tp}
    if bad:
        common = math.gcd(*sizes.values()) if sizes else 1
        valid = [d for d in range(1, common + 1) if common % d == 0]
        raise ValueError(
            f"tp={tp} does not divide {bad} (a rank holds an equal slice of each sharded dimension and whole attention "
            f"heads); tp can be one of {valid}"
        )


@dataclass(frozen=True)
class TP:
    """Tensor parallelism: ``run(..., tp=2)`` or ``run(..., tp=psl.TP(2, sequence_parallel=True))``.

    The plan's modules (``tp_plan=``, or the model's own) are split over ``degree`` processes with torch's DTensor.
    """

    degree: int
    """Processes each of the plan's modules is split over."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (Korthikanti et al., 2022): between the tensor-parallel regions, the norms,
    residuals and dropouts run on ``1 / degree`` of the sequence, and each region's entry all-gathers the sequence
    (its exit reduce-scatters it) instead of all-reducing. Saves activation memory; needs a plan whose layers are
    all tensor-parallel between their norms (:func:`~pipeswift_lab.core.tp_plan.sequence_parallel_plan`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "degree", check_int("tp", self.degree, minimum=1))
        check_flag("sequence_parallel", self.sequence_parallel)


def as_tp(tp: Any) -> TP:
    """``tp=`` as a :class:`TP` record: an int is the degree."""
    if isinstance(tp, TP):
        return tp
    if isinstance(tp, bool) or not isinstance(tp, int):
        raise TypeError(f"tp must be an int (the tensor-parallel degree) or a psl.TP; got {type(tp).__name__} {tp!r}")
    return TP(tp)
