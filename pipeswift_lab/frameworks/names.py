"""The toolkit's layers as each framework names them.

A profile's layers are a decoder's units in run order: Hugging Face names (``model.embed_tokens``,
``model.layers.N``, ``model.norm``, ``lm_head``; GPT-2's ``transformer.wte``, ``transformer.h.N``,
``transformer.ln_f``) or an analytic profile's (``embed``, ``block_N``, ``head``, the head holding the final norm).
Each is read as one *part* of a decoder (:func:`decoder_parts`), and each framework names the parts its own way:

* torchtitan's decoders (``torchtitan/models/*/model.py``): ``tok_embeddings``, ``layers.N``, ``norm``, ``output``,
  the fully qualified names of ``module_fqns_per_model_part``;
* Megatron-LM's ``--pipeline-model-parallel-layout`` letters: ``E`` the embedding, ``t`` a transformer layer,
  ``L`` the loss (the final norm and the output layer with it);
* DeepSpeed's ``PipelineModule`` takes the layers themselves: the toolkit's names are its layer list.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Part", "bounds_of_stages", "decoder_parts", "megatron_letters", "stage_parts", "torchtitan_fqns"]

_BLOCK = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|decoder\.layers)\.(\d+)$|^block_(\d+)$")
_EMBED = ("embed_tokens", "wte", "embed_in", "tok_embeddings", "word_embeddings", "embed")
_POSITIONS = ("wpe", "embed_positions", "position_embeddings")
_NORM = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "final_norm")
_HEAD = ("lm_head", "embed_out", "output")
#: Units with no parameters that frameworks keep inside their model, not as a module of their own.
_FREE = ("rotary_emb", "rotary_pos_emb", "dropout", "drop")


@dataclass(frozen=True)
class Part:
    """One layer of a profile read as a part of a decoder: ``kind`` is ``"embed"``, ``"positions"``, ``"block"``
    (with ``index``), ``"norm"``, ``"head"``, ``"norm+head"`` (an analytic profile's head) or ``"free"`` (a
    parameter-free unit such as rotary tables)."""

    name: str
    kind: str
    index: int = -1


def decoder_parts(names: Sequence[str]) -> list[Part]:
    """Each layer name as a :class:`Part`, blocks numbered in order.

    Raises ``ValueError`` naming the first layer that is no part of a decoder (an encoder, a vision tower, a unit
    the profile grouped differently), and when the blocks are not numbered ``0, 1, ...`` in order.
    """
    parts = []
    for name in names:
        last = name.rsplit(".", 1)[-1]
        block = _BLOCK.search(name)
        if block:
            parts.append(Part(name, "block", int(block.group(1) or block.group(2))))
        elif name == "head":
            parts.append(Part(name, "norm+head"))
        elif last in _EMBED:
            parts.append(Part(name, "embed"))
        elif last in _POSITIONS:
            parts.append(Part(name, "positions"))
        elif last in _NORM:
            parts.append(Part(name, "norm"))
        elif last in _HEAD:
            parts.append(Part(name, "head"))
        elif last in _FREE:
            parts.append(Part(name, "free"))
        else:
            raise ValueError(
                f"layer {name!r} is no part of a decoder a framework names (an embedding, a block numbered "
                f"layers.N / h.N / block_N, the final norm, the output head): profile the model with layers= its "
                "decoder's units (layers='auto' finds them)"
            )
    blocks = [p.index for p in parts if p.kind == "block"]
    if blocks != list(range(len(blocks))):
        raise ValueError(f"the profile's blocks are numbered {blocks[:8]}...: a framework needs 0, 1, ... in order")
    return parts


def stage_parts(names: Sequence[str], bounds: Sequence[tuple[int, int]]) -> list[list[Part]]:
    """The parts of each stage of ``bounds`` (ranges of layer indices, global stage order)."""
    parts = decoder_parts(names)
    return [parts[a:e] for a, e in bounds]


def torchtitan_fqns(stage: Sequence[Part]) -> list[str]:
    """A stage's modules as torchtitan names them (``module_fqns_per_model_part``); parameter-free units have none.

    Raises ``ValueError`` for a part torchtitan's decoders do not have (a learned position table)."""
    out: list[str] = []
    for part in stage:
        if part.kind == "positions":
            raise ValueError(f"layer {part.name!r} is a learned position table; torchtitan's decoders have none")
        out += {
            "embed": ["tok_embeddings"],
            "block": [f"layers.{part.index}"],
            "norm": ["norm"],
            "head": ["output"],
            "norm+head": ["norm", "output"],
            "free": [],
        }[part.kind]
    return out


def megatron_letters(stage: Sequence[Part]) -> str:
    """A stage as Megatron-LM's layout letters: ``E`` the embedding (with its positions), ``t`` each block, ``L``
    the output layer and its loss (the final norm belongs to the decoder and adds no letter)."""
    letters = {"embed": "E", "block": "t", "head": "L", "norm+head": "L"}
    return "".join(letters.get(part.kind, "") for part in stage)


def _keys(framework: str, parts: Sequence[Part]) -> list[list[tuple[str, int]]]:
    """Each part's name in ``framework``'s stage lists (None: it goes with a neighbour: parameter-free units and
    learned positions with the part before, Megatron's final norm with the loss after)."""
    keys: list[list[tuple[str, int]]] = []
    for part in parts:
        if framework == "deepspeed":  # its layer list is the profile's own
            keys.append([(part.name, 0)])
        elif framework == "megatron":
            key = {"embed": ("E", 0), "block": ("t", part.index), "head": ("L", 0), "norm+head": ("L", 0)}
            keys.append([key[part.kind]] if part.kind in key else [])
        else:
            keys.append([(fqn, 0) for fqn in (torchtitan_fqns([part]) if part.kind != "positions" else [])])
    return keys


def _stage_keys(framework: str, stage_modules: Sequence[Sequence[str]]) -> dict[tuple[str, int], int]:
    """``{key: stage}`` of a configuration's stage lists (Megatron's letters numbered in order)."""
    out: dict[tuple[str, int], int] = {}
    blocks = 0
    for stage, modules in enumerate(stage_modules):
        for module in modules:
            if framework == "megatron" and module == "t":
                key = ("t", blocks)
                blocks += 1
            elif framework.startswith("torchtitan"):
                key = ("output" if module == "lm_head" else module, 0)  # 0.3's name for 0.2's output
            else:
                key = (module, 0)
            if key in out:
                raise ValueError(f"{module!r} is in stage {out[key]} and stage {stage} of the configuration")
            out[key] = stage
    return out


def bounds_of_stages(framework: str, names: Sequence[str], stage_modules: Sequence[Sequence[str]]) -> str:
    """The split ``stage_modules`` (a configuration's stage lists in ``framework``'s names, global stage order) as
    ranges of the profile's layers ``names``: ``"0-3 3-7"``.

    Raises ``ValueError`` naming the first layer no stage holds, a module the profile has no layer for, and a split
    whose stages do not hold consecutive layers."""
    parts = decoder_parts(names)
    keys = _keys(framework, parts)
    where = _stage_keys(framework, stage_modules)
    stages: list[int | None] = []
    for part, names_of_part in zip(parts, keys):
        found = set()
        for key in names_of_part:
            if key not in where:
                shown = key[0] if framework != "megatron" else f"{key[0]} (the {part.kind} {part.name!r})"
                raise ValueError(f"layer {part.name!r} ({shown}) is in no stage of the {framework} configuration")
            found.add(where.pop(key))
        if len(found) > 1:
            raise ValueError(f"layer {part.name!r} is split across stages {sorted(found)} of the configuration")
        stages.append(found.pop() if found else None)
    if where:
        extra = sorted(where, key=lambda k: where[k])[0]
        raise ValueError(
            f"the {framework} configuration's stage {where[extra]} holds {extra[0]!r}, which the profile's "
            f"{len(names)} layers do not have (a deeper model?)"
        )
    # a part with no name of its own goes with its neighbour: the final norm with the loss after it, others before
    for i in range(len(stages)):
        if stages[i] is None and parts[i].kind == "norm" and framework == "megatron":
            stages[i] = next((s for s in stages[i + 1 :] if s is not None), None)
    for i in range(len(stages)):
        if stages[i] is None:
            stages[i] = stages[i - 1] if i > 0 else next(s for s in stages if s is not None)
    bounds: list[list[int]] = []
    for i, stage in enumerate(stages):
        if stage == len(bounds) - 1:
            bounds[-1][1] = i + 1
        elif stage == len(bounds):
            bounds.append([i, i + 1])
        else:
            raise ValueError(
                f"layer {parts[i].name!r} is on stage {stage} after a layer on stage {len(bounds) - 1}: the "
                "configuration's stages do not hold consecutive layers in order"
            )
    if len(bounds) != len(stage_modules):
        raise ValueError(f"the configuration has {len(stage_modules)} stages; the layers fill {len(bounds)}")
    return " ".join(f"{a}-{e}" for a, e in bounds)
