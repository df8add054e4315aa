"""Hugging Face checkpoints read and written through transformers' own loading conversion, a stage at a time.

transformers 5 renames and fuses tensors when ``from_pretrained`` loads a checkpoint, and undoes it when
``save_pretrained`` writes one: GPT-NeoX's file holds ``embed_out.weight`` for the module's ``lm_head.weight``;
a mixture-of-experts file holds one tensor per expert (``experts.0.gate_proj.weight``, ...), the module one fused
``experts.gate_up_proj``. The tables of those renamings and fusions change between releases, so nothing here copies
them: :func:`hf_conversion` asks transformers for the model's transforms
(``conversion_mapping.get_model_conversion_mapping``), renames each stored key as ``from_pretrained`` does
(``core_model_loading.rename_source_key``, the function its loading loop calls) and groups the stored keys a fused
tensor is made of. A rank then reads only the stored tensors its stage's keys are made of, and makes each fused
tensor with the converter's own operations (:meth:`Converted.make`). :func:`to_stored` is the way back, per shard,
with ``core_model_loading.revert_weight_conversion`` (what ``save_pretrained`` calls).

Under tensor parallelism a rank reads only its slice of a tensor stored under the model's name or renamed
(:mod:`.tp_slices`); a tensor made from several stored ones is read whole, made, then cut to the rank's slice: the
converter's operations (stacking experts, splitting a fused tensor) need their inputs whole.

A model that is not a Hugging Face ``PreTrainedModel``, or a transformers release without this machinery (4.x),
reads stored names as they are.
"""

from __future__ import annotations

import copy
import importlib
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["Converted", "HFConversion", "hf_class", "hf_conversion", "model_of_class", "to_stored"]


@dataclass(frozen=True)
class Converted:
    """How one model tensor is made from several stored tensors (a fused mixture-of-experts tensor, a split one)."""

    group: str
    """The model key transformers names the conversion by (the first target of its converter)."""
    converter: Any
    """transformers' ``WeightConverter`` (a template: each use works on a copy, as ``from_pretrained`` does)."""
    by_pattern: tuple[tuple[str, tuple[str, ...]], ...]
    """``(the converter's source pattern, the stored keys it matched, in transformers' order)``, per pattern."""
    dtype: torch.dtype
    """The model tensor's dtype: every stored tensor is cast to it before the operations, as ``from_pretrained``
    does."""

    @property
    def sources(self) -> tuple[str, ...]:
        """Every stored key the tensor is made of."""
        return tuple(k for _, keys in self.by_pattern for k in keys)

    def make(self, model: nn.Module, stored: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model tensors this conversion makes (``{model key: tensor}``), from ``stored`` (holding every key of
        :attr:`sources`; meta tensors give the shapes). ``model`` may be on the meta device: the operations read
        only its config and shapes."""
        converter = copy.deepcopy(self.converter)
        for pattern, keys in self.by_pattern:
            for key in keys:
                tensor = stored[key]
                converter.add_tensor(
                    self.group, key, pattern, tensor if tensor.dtype == self.dtype else tensor.to(self.dtype)
                )
        made = converter.convert(self.group, model=model, config=getattr(model, "config", None))
        return {k: v[0] if isinstance(v, list) else v for k, v in made.items()}


@dataclass(frozen=True)
class HFConversion:
    """What a stored checkpoint's names are to a model, through transformers' loading conversion."""

    renamed: dict[str, str] = field(default_factory=dict)
    """``{model key: stored key}`` where one stored tensor is the model's under another name (GPT-NeoX's
    ``embed_out.weight``)."""
    converted: dict[str, Converted] = field(default_factory=dict)
    """``{model key: how it is made}`` where several stored tensors make it."""


def _transformers_conversion() -> tuple[Any, Any, Any, Any, Any] | None:
    """transformers' conversion functions and classes, or ``None`` on a release without them."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key
    except ImportError:
        return None
    return get_model_conversion_mapping, WeightConverter, WeightRenaming, rename_source_key, dot_natural_key


def is_hf_model(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face ``PreTrainedModel``.

    A session that has not imported transformers holds none, and asking does not import it: seconds here, and a fork
    server started after it would preload it for every later run (:func:`~.launcher.model_library_modules`)."""
    if "transformers" not in sys.modules:
        return False
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def hf_conversion(model: nn.Module, stored_keys: Iterable[str]) -> HFConversion | None:
    """How the stored keys (a safetensors checkpoint's names) load into ``model`` (possibly on the meta device), as
    ``from_pretrained`` would load them; ``None`` when ``model`` is not a Hugging Face model or transformers has no
    loading conversion. Model keys the checkpoint does not give are simply absent (the caller says they are
    missing); a tied weight is left to the model's aliases."""
    api = _transformers_conversion()
    if api is None or not is_hf_model(model):
        return None
    get_mapping, WeightConverter, WeightRenaming, rename_source_key, dot_natural_key = api

    state = model.state_dict()
    transforms = get_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    converter_of = {pattern: c for c in converters for pattern in c.source_patterns}
    prefix = getattr(model, "base_model_prefix", None)
    renamed: dict[str, str] = {}
    groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}
    for key in sorted(stored_keys, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, state)
        if target not in state and key in state:  # a name the model already has (a fused checkpoint) stays
            target, pattern = key, None
        if target not in state:
            continue  # unexpected: the caller names what no model tensor uses
        if pattern is None:
            renamed.setdefault(target, key)
        else:
            groups.setdefault(target, (converter_of[pattern], {}))[1].setdefault(pattern, []).append(key)
    converted: dict[str, Converted] = {}
    for group, (converter, by_pattern) in groups.items():
        made = Converted(group, converter, tuple((p, tuple(k)) for p, k in by_pattern.items()), state[group].dtype)
        for target in converter.target_patterns:
            key = group.replace(converter.target_patterns[0], target, 1)
            if key in state:
                converted[key] = made
        converted.setdefault(group, made)
    renamed = {k: v for k, v in renamed.items() if k not in converted}
    return HFConversion(renamed, converted)


def converted_shapes(
    model: nn.Module, conversion: HFConversion, stored: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """The shape each converted model key gets from the stored tensors' shapes (the conversion run on meta tensors),
    and ``{model key: why}`` for those the conversion's operations refuse (stored experts of different shapes):
    what the check before launch compares with the model."""
    shapes: dict[str, tuple[int, ...]] = {}
    refused: dict[str, str] = {}
    for made in {id(c): c for c in conversion.converted.values()}.values():
        metas = {k: torch.empty(stored[k][0], dtype=stored[k][1], device="meta") for k in made.sources}
        try:
            out = made.make(model, metas)
        except Exception as exc:  # the operations refuse stored tensors that do not fit together
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            refused[made.group] = f"{type(exc).__name__}: {first} (from {list(made.sources)[:2]} ...)"
            continue
        shapes.update({k: tuple(t.shape) for k, t in out.items() if k in conversion.converted})
    return shapes, refused


def hf_class(model: nn.Module) -> str | None:
    """``'module:QualifiedName'`` of a Hugging Face model's class (the result rebuilds its structure from it and the
    config to write what ``save_pretrained`` writes); ``None`` for other models."""
    if not is_hf_model(model):
        return None
    return f"{type(model).__module__}:{type(model).__qualname__}"


def model_of_class(name: str, config: Mapping[str, Any]) -> nn.Module:
    """The Hugging Face model of class ``name`` (:func:`hf_class`) built from ``config`` (a config's dict) on the meta
    device: its structure and transforms, no tensor."""
    module, _, qualname = name.partition(":")
    cls = getattr(importlib.import_module(module), qualname)
    config_obj = cls.config_class.from_dict(dict(config))
    with torch.device("meta"):
        return cls(config_obj)


def to_stored(model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes for ``state`` (model keys of one shard, each tied tensor once): transformers'
    reverse conversion (``revert_weight_conversion``) applied to it, the original names and per-expert tensors where
    the family stores them.

    Raises ``ValueError`` when ``state`` holds part of a group the reverse conversion joins (a shard must hold a
    whole layer): checked by loading the written names back."""
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(model, dict(state))
    conversion = hf_conversion(model, out)
    back = set() if conversion is None else set(conversion.renamed) | set(conversion.converted)
    back |= {k for k in out if k in state}
    if back != set(state):
        raise ValueError(
            f"the shard's tensors do not convert back to themselves: {sorted(back ^ set(state))[:4]}; each shard must "
            "hold whole layers"
        )
    return {k: v.contiguous() for k, v in out.items()}
