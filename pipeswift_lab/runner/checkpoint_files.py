"""One file per rank, written at disk speed: the state's tensors packed into one buffer, then its small objects.

A rank's checkpoint state is DCP's flattened dict (``model.<name>``, ``optim.state.<name>.exp_avg``,
``optim.param_groups.<name>.lr``, ``rng.rank0.cpu``; :func:`flat_state`). DCP's own ``FileSystemWriter`` writes
each tensor as a separate ``torch.save`` record after a planning collective, at about a tenth of the disk's speed
on small shards, so the layout here is our own:

* a :class:`FlatLayout` gives every tensor an offset in one byte buffer (8-byte aligned, in the state's order, so
  the model's, the optimizer's and the RNG's tensors each lie in one contiguous range). It is planned once per
  topology and reused while the state keeps its keys, shapes and dtypes (DCP's plans are the part it replaces);
* a :class:`Stager` copies the state into a staging buffer allocated once (pinned on CUDA, copied without
  blocking; the write waits for the copy's event), in one ``torch._foreach_copy_`` on CPU, and pickles the
  non-tensor values (learning rates, betas);
* :func:`write_rank_file` writes the buffer and the objects with a few large writes, calls ``fsync``, and hashes the
  bytes from memory; it returns the rank's *record*: the file's size and SHA-256 and where each key lies.

Reading goes two ways. On the same topology a rank reads its own file straight into its tensors
(:func:`read_section`). On another partition DCP's planner reshards as before, through :func:`flat_file_reader`,
a ``StorageReader`` over these files whose ``.metadata`` (:func:`dcp_metadata`, written at commit) is an ordinary
DCP ``Metadata``.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.metadata import Metadata

#: Byte alignment of every tensor in a rank file (a view of the staging buffer needs its dtype's alignment).
ALIGN = 8
#: Prefixes of the three parts of the saved state dict (DCP flattens nested dicts into ``part.key``).
MODEL, OPTIM, RNG = "model", "optim", "rng"


def rank_file_name(rank: int) -> str:
    """``rank-00001.bin``: the file rank ``rank`` writes into a checkpoint."""
    return f"rank-{int(rank):05d}.bin"


def flat_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (``{"model": ..., "optim": ..., "rng": ...}``) flattened into DCP's keys (``model.<name>``), as
    ``dcp.load`` names them."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    return flat


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    import torch

    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a checkpoint record")
    return value


@dataclass(frozen=True)
class FlatLayout:
    """Where each tensor of a flat state lies in one byte buffer: ``entries`` ``{key: (offset, nbytes, dtype,
    shape)}`` and the buffer's ``nbytes``."""

    entries: dict[str, tuple[int, int, str, tuple[int, ...]]]
    nbytes: int
    signature: tuple[tuple[str, str, tuple[int, ...]], ...] = field(repr=False)

    @classmethod
    def of(cls, flat: dict[str, Any]) -> FlatLayout:
        """The layout of ``flat``'s tensors, in its order, each at an offset aligned to :data:`ALIGN`."""
        import torch

        entries, offset, signature = {}, 0, []
        for key, value in flat.items():
            if isinstance(value, torch.Tensor):
                nbytes = value.numel() * value.element_size()
                shape = tuple(value.shape)
                entries[key] = (offset, nbytes, _dtype_name(value.dtype), shape)
                signature.append((key, _dtype_name(value.dtype), shape))
                offset += -(-nbytes // ALIGN) * ALIGN
        return cls(entries, offset, tuple(signature))

    def fits(self, flat: dict[str, Any]) -> bool:
        """Whether ``flat``'s tensors have this layout's keys, dtypes and shapes, in order."""
        import torch

        sig = tuple((k, _dtype_name(v.dtype), tuple(v.shape)) for k, v in flat.items() if isinstance(v, torch.Tensor))
        return sig == self.signature


@dataclass
class StagedState:
    """A rank's state copied out of training: the tensors in ``buffer`` (uint8, laid out by ``layout``), the other
    values pickled in ``objects`` (``{key: bytes}``), and on CUDA the ``event`` the copy completes at."""

    layout: FlatLayout
    buffer: torch.Tensor
    objects: dict[str, bytes]
    event: Any = None

    @property
    def state_bytes(self) -> int:
        """Bytes of the tensors staged (without alignment)."""
        return sum(e[1] for e in self.layout.entries.values())


def staging_buffer(nbytes: int, device: torch.device | str) -> torch.Tensor:
    """A CPU byte buffer of ``nbytes`` to stage into: pinned when the state lives on a GPU (so the copy does not
    block the GPU's stream)."""
    import torch

    pin = getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


class Stager:
    """Copies a rank's flat states, all of one layout, into one staging buffer allocated once.

    The destination views are made once too, so a save is one ``torch._foreach_copy_`` on CPU (GPU tensors are
    copied without blocking into the pinned buffer, and the returned state's ``event`` marks the end of the copies;
    the writer waits on it) and the non-tensor values pickled.
    """

    def __init__(self, flat: dict[str, Any], device: torch.device | str) -> None:
        self.layout = FlatLayout.of(flat)
        self.buffer = staging_buffer(self.layout.nbytes, device)
        self._keys = list(self.layout.entries)
        self._views = [
            self.buffer[offset : offset + nbytes].view(_dtype(dtype)).view(shape)
            for offset, nbytes, dtype, shape in self.layout.entries.values()
        ]

    def fits(self, flat: dict[str, Any]) -> bool:
        """Whether ``flat`` has this stager's layout (keys, dtypes, shapes, in order)."""
        return self.layout.fits(flat)

    def stage(self, flat: dict[str, Any]) -> StagedState:
        """Copy ``flat`` (of this layout) into the buffer; returns the staged state."""
        import torch

        sources = [flat[key].detach() for key in self._keys]
        event = None
        if any(t.is_cuda for t in sources):  # pragma: no cover - needs a GPU
            for target, source in zip(self._views, sources):
                target.copy_(source, non_blocking=source.is_cuda)
            event = torch.cuda.Event()
            event.record()
        elif sources:
            torch._foreach_copy_(self._views, sources)
        objects = {
            key: pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            for key, value in flat.items()
            if not isinstance(value, torch.Tensor)
        }
        return StagedState(self.layout, self.buffer, objects, event)


def _bytes_of(buffer: torch.Tensor) -> memoryview:
    """A byte view of a CPU uint8 tensor's memory (no copy)."""
    return memoryview(buffer.numpy()).cast("B")  # type: ignore[arg-type]


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def write_rank_file(path: Path, staged: StagedState, pace_s: float = 0.0) -> dict[str, Any]:
    """Write ``staged`` to ``path`` (buffer, then the pickled objects), ``fsync`` it, and return the record:
    ``bytes``, ``sha256`` (hashed from memory), ``tensors`` ``{key: [offset, nbytes, dtype, shape]}`` and
    ``objects`` ``{key: [offset, nbytes]}``.

    ``pace_s`` > 0 spreads the write over that many seconds, in pieces (a rehearsed slow disk,
    :func:`~pipeswift_lab.runner.faults.slow_disk`)."""
    if staged.event is not None:  # pragma: no cover - needs a GPU
        staged.event.synchronize()
    digest = hashlib.sha256()
    body = _bytes_of(staged.buffer)[: staged.layout.nbytes]
    objects, offset = {}, staged.layout.nbytes
    blob = b"".join(staged.objects.values())
    for key, raw in staged.objects.items():
        objects[key] = [offset, len(raw)]
        offset += len(raw)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for part in (body, memoryview(blob)):
            digest.update(part)
            if pace_s > 0:
                _write_paced(fd, part, pace_s * len(part) / max(1, offset))
            else:
                _write_all(fd, part)
        os.fsync(fd)
    finally:
        os.close(fd)
    tensors = {k: [o, n, d, list(s)] for k, (o, n, d, s) in staged.layout.entries.items()}
    return {"bytes": offset, "sha256": digest.hexdigest(), "tensors": tensors, "objects": objects}


def _write_paced(fd: int, data: memoryview, seconds: float, pieces: int = 16) -> None:
    size = -(-len(data) // pieces) if len(data) else 0
    for start in range(0, len(data), max(1, size)):
        _write_all(fd, data[start : start + size])
        time.sleep(seconds / pieces)


def write_flat_state(
    tmp_dir: Path, rank: int, flat: dict[str, Any], pp_rank: int | None = None, replica: int = 0
) -> dict[str, Any]:
    """Stage ``flat`` and write it as rank ``rank``'s file in ``tmp_dir`` (created), at once, in this thread: the
    record :func:`~pipeswift_lab.runner.checkpoint.commit` takes. For one-process saves; a run's ranks stage once
    and write in the background (:mod:`~pipeswift_lab.runner.rank.background_writer`)."""
    staged = Stager(flat, "cpu").stage(flat)
    Path(tmp_dir).mkdir(parents=True, exist_ok=True)
    record = write_rank_file(Path(tmp_dir) / rank_file_name(rank), staged)
    record.update(rank=rank, pp_rank=rank if pp_rank is None else pp_rank, replica=replica, file=rank_file_name(rank))
    return record


def read_section(path: Path, record: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    """``{key: value}`` of ``keys`` from a rank file: the tensors read with one ``readinto`` of the byte range they
    span (fresh memory, viewed by dtype and shape), the objects unpickled."""
    import torch

    tensors = [k for k in keys if k in record["tensors"]]
    out: dict[str, Any] = {}
    with open(path, "rb", buffering=0) as f:
        if tensors:
            start = min(record["tensors"][k][0] for k in tensors)
            end = max(record["tensors"][k][0] + record["tensors"][k][1] for k in tensors)
            buffer = torch.empty(end - start, dtype=torch.uint8)
            f.seek(start)
            view, got = _bytes_of(buffer), 0
            while got < len(view):
                n = f.readinto(view[got:])
                if not n:
                    raise OSError(f"{path} ends at byte {start + got}, before {end}: the file is truncated")
                got += n
            for key in tensors:
                offset, nbytes, dtype, shape = record["tensors"][key]
                out[key] = buffer[offset - start : offset - start + nbytes].view(_dtype(dtype)).view(tuple(shape))
        for key in keys:
            if key in record["objects"]:
                offset, nbytes = record["objects"][key]
                f.seek(offset)
                out[key] = pickle.loads(f.read(nbytes))
    missing = [k for k in keys if k not in out]
    if missing:
        raise KeyError(f"{path.name} holds no {missing[:3]}")
    return out


@dataclass(frozen=True)
class FlatItem:
    """Where one key lies in a rank file (DCP's ``storage_data`` of these checkpoints): the file, the byte range,
    and for a tensor its dtype and shape."""

    relative_path: str
    offset: int
    length: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


def dcp_metadata(records: list[dict[str, Any]]) -> Metadata:
    """DCP's ``Metadata`` of a checkpoint whose ranks wrote ``records`` (a key several ranks hold, a tied weight or a
    replica's copy, is taken from the first): every tensor is one chunk, every object a bytes item."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    state: dict[str, Any] = {}
    storage: dict[Any, FlatItem] = {}
    for record in records:
        name = record["file"]
        for key, (offset, nbytes, dtype, shape) in record["tensors"].items():
            if key in state:
                continue
            size = torch.Size(shape)
            state[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=_dtype(dtype)),
                size=size,
                chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)],
            )
            storage[MetadataIndex(key, [0] * len(size), 0)] = FlatItem(name, offset, nbytes, dtype, tuple(shape))
        for key, (offset, nbytes) in record["objects"].items():
            if key not in state:
                state[key] = BytesStorageMetadata()
                storage[MetadataIndex(key)] = FlatItem(name, offset, nbytes)
    return Metadata(state_dict_metadata=state, storage_data=storage)


def flat_file_reader(path: str | os.PathLike[str]) -> Any:
    """DCP's ``FileSystemReader`` for rank files at ``path``: a tensor is read as raw bytes at its offset (not
    ``torch.load``-ed), an object unpickled; DCP's planner narrows and places them, so any partition can load any
    checkpoint."""
    return _reader_class()(str(path))


@functools.cache
def _reader_class() -> type:
    from torch.distributed.checkpoint import FileSystemReader

    class FlatFileReader(FileSystemReader):
        def read_data(self, plan: Any, planner: Any) -> Any:
            return _read_items(self, plan, planner)

    return FlatFileReader


def _read_items(reader: Any, plan: Any, planner: Any) -> Any:
    import torch
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.futures import Future

    per_file: dict[str, list[Any]] = {}
    for item in plan.items:
        per_file.setdefault(reader.storage_data[item.storage_index].relative_path, []).append(item)
    for name, items in per_file.items():
        with open(Path(reader.path) / name, "rb") as f:
            for req in sorted(items, key=lambda r: reader.storage_data[r.storage_index].offset):
                info: FlatItem = reader.storage_data[req.storage_index]
                f.seek(info.offset)
                raw = f.read(info.length)
                if req.type == LoadItemType.BYTE_IO:
                    encoded = io.BytesIO()
                    torch.save(pickle.loads(raw), encoded)  # the planner torch.loads a bytes item
                    encoded.seek(0)
                    planner.load_bytes(req, encoded)
                    continue
                dtype = _dtype(info.dtype or "")
                tensor = torch.frombuffer(bytearray(raw), dtype=dtype) if raw else torch.empty(0, dtype=dtype)
                tensor = tensor.view(info.shape or ())
                for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                    tensor = tensor.narrow(dim, start, length)
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise ValueError(
                        f"{req.storage_index.fqn}: {tuple(tensor.size())} read, {tuple(target.size())} asked"
                    )
                target.copy_(tensor)
                planner.commit_tensor(req, target)
    done: Future = Future()
    done.set_result(None)
    return done


__all__ = [
    "ALIGN",
    "dcp_metadata",
    "flat_state",
    "flat_file_reader",
    "FlatItem",
    "FlatLayout",
    "MODEL",
    "OPTIM",
    "rank_file_name",
    "read_section",
    "RNG",
    "StagedState",
    "Stager",
    "staging_buffer",
    "write_flat_state",
    "write_rank_file",
]
