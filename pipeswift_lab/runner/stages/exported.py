"""The caller's export travels to the ranks: they split the program instead of exporting the model again.

torch's tracing frontend (``pipeline()``) exports the whole model with ``torch.export`` and then
splits the graph at the split points. The export is most of it: about three quarters of a rank's
start-up for a small Hugging Face model here, every rank doing the same work on the same model.
The caller already exports it once before launch (:func:`~.traced.check_traceable`), so its
``ExportedProgram`` goes in the spec, serialized by torch's own serializer
(``torch._export.serde.serialize``: the graph, every node's metadata, the signature) with its
state as meta tensors (the ranks make and fill theirs). A rank deserializes it and gives it to
``pipeline()`` in place of the export (:func:`export_step`), so the split, and everything after
it, is torch's as before.

Where the serializer cannot take a program (an operator it does not know), nothing travels and
the ranks export as they did; so does a rank on another device than the one the caller traced for
(``cuda:1``), since a graph keeps the devices it was traced with.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.export import ExportedProgram

__all__ = ["export_step", "loaded", "serialized"]


def _meta_like(t: torch.Tensor, made: dict[int, Any]) -> Any:
    """A meta tensor of ``t``'s shape, strides and dtype (a parameter stays one), made once per tensor: ties stay."""
    if id(t) not in made:
        meta = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
        parameter = isinstance(t, torch.nn.Parameter)
        made[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) if parameter else meta
    return made[id(t)]


def serialized(program: ExportedProgram) -> bytes | None:
    """``program`` serialized by torch's ``ExportedProgramSerializer``, its state dict and tensor constants as meta
    tensors, pickled; ``None`` where the serializer refuses it (then every rank exports the model itself)."""
    from torch._export.serde.serialize import ExportedProgramSerializer

    state, constants = program._state_dict, program._constants
    made: dict[int, Any] = {}
    try:
        program._state_dict = {k: _meta_like(v, made) for k, v in state.items()}
        program._constants = {
            k: _meta_like(v, made) if isinstance(v, torch.Tensor) else v for k, v in constants.items()
        }
        artifact = ExportedProgramSerializer().serialize(program, serialize_example_inputs=False)
        return pickle.dumps(artifact)
    except Exception:  # an operator or value torch's serializer does not take: the ranks export instead
        return None
    finally:
        program._state_dict, program._constants = state, constants


def loaded(blob: bytes) -> ExportedProgram:
    """The ``ExportedProgram`` :func:`serialized` made, deserialized by torch's ``ExportedProgramDeserializer`` (its
    tensors on the meta device)."""
    from torch._export.serde.serialize import ExportedProgramDeserializer

    artifact = pickle.loads(blob)
    return ExportedProgramDeserializer().deserialize(
        artifact.exported_program, artifact.state_dict, artifact.constants, artifact.example_inputs
    )


@contextmanager
def export_step(program: ExportedProgram | None, exported: list[ExportedProgram]) -> Iterator[None]:
    """Within the block torch's ``pipeline()`` splits ``program`` instead of exporting the model (when ``program`` is
    given); the program it splits, exported or given, is appended to ``exported``.

    ``pipeline()`` exports through ``Pipe._trace_with_export``, which the block replaces for its duration (one
    thread traces at a time: the caller before launch, a rank while it builds its stages). A torch without it
    exports as usual, and ``exported`` stays empty.
    """
    from torch.distributed.pipelining._IR import Pipe

    original = Pipe.__dict__.get("_trace_with_export")
    if not isinstance(original, staticmethod):
        yield
        return

    def trace_with_export(mod: torch.nn.Module, example_args: Any, example_kwargs: Any = None) -> ExportedProgram:
        out = program if program is not None else original.__func__(mod, example_args, example_kwargs)
        exported.append(out)
        return out

    Pipe._trace_with_export = staticmethod(trace_with_export)  # type: ignore[method-assign]
    try:
        yield
    finally:
        Pipe._trace_with_export = original  # type: ignore[method-assign]
