"""Model settings that make a forward pipeline-friendly, applied while a model is traced and run in stages (and
while the profiler measures the traced graph's memory, :mod:`.traced_memory`).

A Hugging Face causal LM builds a KV cache in every training forward when its config says
``use_cache=True`` (the default): a ``DynamicCache`` object ``torch.export`` cannot carry
through a graph, and a second output no stage boundary can send. Training does not read it,
so the runner turns it off for the trace and the run (:func:`training_settings`) and puts the
config back afterwards. ``output_attentions`` and ``output_hidden_states`` are turned off the
same way: they add outputs a loss does not read.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

#: Config attributes set for training through a pipeline, and the value they take.
TRAINING_SETTINGS: dict[str, Any] = {"use_cache": False, "output_attentions": False, "output_hidden_states": False}


def configs(model: nn.Module) -> list[Any]:
    """Every distinct ``config`` object of ``model``'s modules (a Hugging Face model and its sub-models)."""
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and not isinstance(config, (nn.Module, dict)) and hasattr(config, "use_cache"):
            found.setdefault(id(config), config)
    return list(found.values())


def apply_training_settings(model: nn.Module) -> dict[int, dict[str, Any]]:
    """Set :data:`TRAINING_SETTINGS` on every config of ``model``; return what they were (``{id(config): {...}}``)."""
    before: dict[int, dict[str, Any]] = {}
    for config in configs(model):
        before[id(config)] = {k: getattr(config, k) for k in TRAINING_SETTINGS if hasattr(config, k)}
        for key in before[id(config)]:
            setattr(config, key, TRAINING_SETTINGS[key])
    return before


@contextmanager
def training_settings(model: nn.Module) -> Iterator[None]:
    """Within the block ``model``'s configs have :data:`TRAINING_SETTINGS`; afterwards they are as they were."""
    before = apply_training_settings(model)
    try:
        yield
    finally:
        for config in configs(model):
            for key, value in before.get(id(config), {}).items():
                setattr(config, key, value)


__all__ = ["apply_training_settings", "configs", "training_settings", "TRAINING_SETTINGS"]


def model_config_of(model: nn.Module) -> dict[str, Any] | None:
    """The Hugging Face config of ``model`` as plain values (what a profile's ``meta["model_config"]`` records, and
    what ``Plan.export`` reads the model's shape from), or None for a model without one."""
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None
    plain = (int, float, str, bool, type(None))
    out: dict[str, Any] = {}
    for key, value in to_dict().items():
        if isinstance(value, plain) or (isinstance(value, list) and all(isinstance(v, plain) for v in value)):
            out[key] = value
    return out
