"""Frameworks: a plan's configuration in the terms of torchtitan, Megatron-LM and DeepSpeed, and their
configurations read back.

``Plan.export(framework)`` writes one (:mod:`pipeswift_lab.planning.handoff`); :func:`read` reads a user's::

    source = plan.export("torchtitan", path="my_job.py")      # a module defining config()
    mine = psl.frameworks.read("torchtitan", "my_old_job.py")
    plan.compare(mine)                                        # JCT terms, step, memory per GPU, the difference

:func:`parse_with_framework` runs a framework's own parser on an export, in the environment it is installed in.

Modules: :mod:`.names` (the toolkit's layers as each framework names them), :mod:`.target` (the neutral
configuration written and read), :mod:`.nearest` (what frameworks change alike), :mod:`.torchtitan`,
:mod:`.torchtitan_toml`, :mod:`.megatron`, :mod:`.deepspeed` (each a ``nearest``, a ``write`` and a ``read``),
:mod:`.own_parsers`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

from .own_parsers import parse_each_with_framework, parse_with_framework
from .target import FRAMEWORKS, ExportTarget, ExportWarning, ImportedConfig, check_framework

__all__ = [
    "FRAMEWORKS",
    "ExportTarget",
    "ExportWarning",
    "ImportedConfig",
    "even_stage_modules",
    "exporter",
    "parse_each_with_framework",
    "parse_with_framework",
    "read",
]


def exporter(framework: str) -> ModuleType:
    """The module that writes and reads ``framework`` (one of :data:`FRAMEWORKS`)."""
    name = check_framework(framework)
    if name == "megatron":
        from . import megatron

        return megatron
    if name == "deepspeed":
        from . import deepspeed

        return deepspeed
    from . import torchtitan, torchtitan_toml

    return torchtitan if name == "torchtitan" else torchtitan_toml


def read(framework: str, source: Any, *, world: int | None = None) -> ImportedConfig:
    """A framework's configuration as an :class:`ImportedConfig`, which ``Plan.price`` and ``Plan.compare`` price.

    * ``"torchtitan"`` — a Python config (a path or its source: a module whose ``config()`` returns
      ``Trainer.Config``), read without running it, or a TOML ``JobConfig`` (torchtitan 0.2.2 and earlier); ``world``
      is needed where ``data_parallel_shard_degree`` is -1 (the shards fill the world);
    * ``"megatron"`` — Megatron-LM's arguments, a list or one string (a ``torchrun`` command line too); ``world``
      gives the GPUs it runs on, from which Megatron derives its data-parallel size;
    * ``"deepspeed"`` — what ``Plan.export("deepspeed")`` returns (``ds_config`` and ``pipeline_module``), as a dict
      or a JSON path or text; a bare ``ds_config`` takes ``world`` and reads one pipeline stage.

    Raises ``ValueError`` naming what is inconsistent (degrees that do not multiply to the world, a batch that does
    not divide) and for a framework not known."""
    name = check_framework(framework)
    module = exporter("torchtitan-toml" if name.startswith("torchtitan") and _is_toml(source) else name)
    return module.read(source, world=world)


def _is_toml(source: Any) -> bool:
    """Whether a torchtitan source is a TOML ``JobConfig``: a ``.toml`` path, or text that parses as TOML with one of
    ``JobConfig``'s tables (a Python config does not parse as TOML)."""
    text = str(source)
    if isinstance(source, Path) or ("\n" not in text and Path(text).exists()):
        return text.endswith(".toml")
    try:
        tables = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return False
    return bool({"training", "parallelism", "model", "job", "activation_checkpoint"} & set(tables))


def even_stage_modules(
    config: ImportedConfig, names: Sequence[str], params: Sequence[float] = (), types: Sequence[str] = ()
) -> tuple[tuple[str, ...], ...]:
    """The stages a framework makes by itself when a configuration names none (its own split of the profile's layers
    ``names``, whose parameter bytes and module classes are ``params`` and ``types``), in the framework's names."""
    return exporter(config.framework).even_stages(config, names, params, types)
