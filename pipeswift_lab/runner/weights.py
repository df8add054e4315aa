"""Where a run's starting weights come from, and each rank reading only its stage's tensors.

``run(model, ..., weights=PATH)`` names one of:

* a Hugging Face safetensors checkpoint: one ``.safetensors`` file, or a directory holding
  ``model.safetensors`` or shards with ``model.safetensors.index.json`` (its ``weight_map`` says
  which shard holds each tensor); a rank opens only the shards that hold its keys and reads
  only those tensors (``safetensors.safe_open``, memory-mapped), and under tensor parallelism
  only its slice of each one the plan shards (:mod:`.tp_slices`);
* a ``torch.distributed.checkpoint`` directory (``.metadata`` and its ``.distcp`` files), the model's
  tensors at the top level or under ``model.`` (as torchtitan saves them); each rank loads only its
  keys (DCP's load of a partial state dict, one process each: ``no_dist=True``);
* one of the toolkit's own checkpoints (a ``step-*`` directory with ``manifest.json``, a checkpoint
  root, or a :class:`~pipeswift_lab.runner.checkpoint.Checkpoint`): the model part of its state.

:func:`open_weights` reads only the index (names, shapes, dtypes) in the caller, so a mismatch with
the model is refused before any process starts (:func:`check_weights`). A model that holds real
weights in the caller is written once as a safetensors file (:func:`write_weights`) and every rank
reads its keys from it: the spec carries the model's structure and code, never its tensors.
A tied weight is stored once, under its canonical name (:mod:`.stages.tied`); reading any of its
names finds it.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..core.checks import state_mismatch
from .hf_conversion import Converted, HFConversion, converted_shapes, hf_conversion
from .tp_slices import ReadTally

if TYPE_CHECKING:
    from ..core.meta_device import Box, InitFn

__all__ = [
    "INDEX_FILE",
    "SAFETENSORS_FILE",
    "WEIGHT_KINDS",
    "WeightSource",
    "check_run_weights",
    "check_weights",
    "hf_config",
    "open_weights",
    "write_weights",
]

#: Hugging Face's name of a single-file checkpoint and of a sharded checkpoint's index.
SAFETENSORS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: What ``weights=`` can name.
WEIGHT_KINDS = ("safetensors", "dcp", "checkpoint")
#: safetensors' dtype names.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class WeightSource:
    """Weights on disk, indexed: ``kind`` (:data:`WEIGHT_KINDS`), ``path`` and every tensor's shape and dtype."""

    kind: str
    """``"safetensors"``, ``"dcp"`` or ``"checkpoint"``."""
    path: str
    """The file or directory (absolute)."""
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    """``{name: (shape, dtype)}`` of every tensor it holds, by the names the reader takes."""
    files: dict[str, str]
    """safetensors: ``{name: file}`` (the shard holding it); empty for the other kinds."""
    prefix: str = ""
    """What precedes the model's names in a DCP checkpoint (``"model."`` or nothing)."""
    renamed: dict[str, str] = field(default_factory=dict)
    """``{model key: stored name}`` where they differ (a tied weight stored under another of its names, a Hugging
    Face checkpoint's own name for it)."""
    converted: dict[str, Converted] = field(default_factory=dict)
    """``{model key: how transformers makes it}`` for the model tensors a Hugging Face checkpoint stores as several
    tensors (a mixture of experts' fused weights, stored one tensor per expert)."""
    read_log: str | None = None
    """A file each rank appends what it read to, one JSON line per stage it fills (:func:`.tp_slices.log_reads`);
    ``None``: no log."""

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor it holds."""
        return sum(int(torch.Size(shape).numel()) * dtype.itemsize for shape, dtype in self.shapes.values())

    def __contains__(self, key: object) -> bool:
        """Whether it holds the model's tensor ``key`` (under that name or, for a tied weight, another)."""
        return key in self.renamed or key in self.converted or key in self.shapes

    def relative_to(self, base: str | os.PathLike[str]) -> WeightSource:
        """This source with its paths relative to the directory ``base`` (a spec names the file written beside it)."""
        return self._moved(lambda p: os.path.relpath(p, base))

    def resolved(self, base: str | os.PathLike[str]) -> WeightSource:
        """This source with a relative path taken from the directory ``base``."""
        return self._moved(lambda p: p if os.path.isabs(p) else os.path.join(base, p))

    def _moved(self, move: Callable[[str], str]) -> WeightSource:
        return replace(self, path=move(self.path), files={k: move(f) for k, f in self.files.items()})

    def read(
        self,
        keys: Iterable[str],
        device: torch.device | str = "cpu",
        model: nn.Module | None = None,
        *,
        slices: Mapping[str, Box] | None = None,
        tally: ReadTally | None = None,
    ) -> dict[str, torch.Tensor]:
        """The tensors ``keys`` (names as the model's ``state_dict`` has them), read from disk onto ``device`` and
        nothing else; returns ``{key: tensor}``. A key stored as several tensors (:attr:`converted`) is made from
        them, one group at a time, with transformers' operations, which read ``model`` (its structure on the meta
        device will do).

        ``slices`` ``{key: box}`` asks for a part of a key's tensor (a tensor-parallel rank's, :mod:`.tp_slices`):
        from a safetensors file only that slice is read (``get_slice``); a key made from several stored tensors
        (transformers' conversion needs them whole: fused experts) and any key of a DCP or toolkit checkpoint is read
        whole and cut. ``tally`` counts what is read from disk."""
        keys = list(keys)
        asked = set(keys)
        slices = slices or {}
        wanted = {key: self.renamed.get(key, key) for key in keys if key not in self.converted}
        found = self._stored(list(wanted.values()), device, [slices.get(k) for k in wanted], tally)
        out = dict(zip(wanted, found))
        groups = {id(self.converted[k]): self.converted[k] for k in keys if k in self.converted}
        if groups and model is None:
            raise ValueError("reading tensors a Hugging Face checkpoint stores as several needs the model (model=)")
        for made in groups.values():
            stored = dict(zip(made.sources, self._stored(list(made.sources), device, None, tally)))
            out.update({k: t for k, t in made.make(model, stored).items() if k in asked})  # type: ignore[arg-type]
        return {key: out[key][slices[key]] if key in slices and key in self.converted else out[key] for key in keys}

    def stored_names(self, keys: Iterable[str]) -> list[str]:
        """The stored tensors :meth:`read` opens for the model's ``keys``, each once: a key's own (or renamed) tensor,
        or every tensor a converted key is made of (an MoE layer's experts, nothing of another layer)."""
        names: list[str] = []
        for key in keys:
            names.extend(self.converted[key].sources if key in self.converted else [self.renamed.get(key, key)])
        return list(dict.fromkeys(names))

    def _stored(
        self,
        names: list[str],
        device: torch.device | str,
        boxes: list[Box | None] | None = None,
        tally: ReadTally | None = None,
    ) -> list[torch.Tensor]:
        """The stored tensors ``names`` (a name may repeat), in order; where ``boxes`` (by position) gives a part,
        only that part (a DCP checkpoint's tensor is read whole, then cut)."""
        asks = [(name, None if boxes is None else boxes[i]) for i, name in enumerate(names)]
        unique = list({(name, _box_key(box)): (name, box) for name, box in asks}.values())
        if self.kind == "safetensors":
            found = self._read_safetensors(unique, torch.device(device), tally)
        else:
            whole = self._read_dcp(list(dict.fromkeys(name for name, _ in unique)), torch.device(device))
            for name, tensor in whole.items():
                if tally is not None:
                    tally.add(name, tensor, sliced=False)
            found = {(name, _box_key(box)): whole[name] if box is None else whole[name][box] for name, box in unique}
        return [found[name, _box_key(box)] for name, box in asks]

    def _read_safetensors(
        self, asks: list[tuple[str, Box | None]], device: torch.device, tally: ReadTally | None
    ) -> dict[tuple[str, Any], torch.Tensor]:
        from safetensors import safe_open

        by_file: dict[str, list[tuple[str, Box | None]]] = {}
        for name, box in asks:
            by_file.setdefault(self.files[name], []).append((name, box))
        out: dict[tuple[str, Any], torch.Tensor] = {}
        for file, wanted in by_file.items():
            with safe_open(file, framework="pt", device=str(device) if device.type != "cpu" else "cpu") as f:
                for name, box in wanted:
                    tensor = f.get_tensor(name) if box is None else f.get_slice(name)[box]
                    if tally is not None:
                        tally.add(name, tensor, sliced=box is not None)
                    out[name, _box_key(box)] = tensor
        return out

    def _read_dcp(self, keys: list[str], device: torch.device) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        state = {
            self.prefix + key: torch.empty(self.shapes[key][0], dtype=self.shapes[key][1], device=device)
            for key in keys
        }
        dcp.load(state, storage_reader=self._reader(), no_dist=True)
        return {key: state[self.prefix + key] for key in keys}

    def _reader(self) -> Any:
        if self.kind == "checkpoint":
            from .checkpoint import load_checkpoint, storage_reader

            return storage_reader(load_checkpoint(self.path))
        from torch.distributed.checkpoint import FileSystemReader

        return FileSystemReader(self.path)

    def _repr_html_(self) -> str:
        from ..core.display import html_card

        return html_card(
            "WeightSource",
            {"kind": self.kind, "path": self.path, "tensors": len(self.shapes), "MiB": f"{self.nbytes / 2**20:.1f}"},
        )


def _box_key(box: Box | None) -> tuple[tuple[int, int], ...] | None:
    """A part as a key (a ``slice`` is not hashable before Python 3.12)."""
    return None if box is None else tuple((b.start, b.stop) for b in box)


def open_weights(weights: str | os.PathLike[str] | Any) -> WeightSource:
    """Index the checkpoint ``weights`` names (see the module's doc), reading names, shapes and dtypes only.

    Returns the :class:`WeightSource`. Raises ``FileNotFoundError`` when nothing is there and ``ValueError`` when
    it is none of the kinds this reads, saying what each kind looks like.
    """
    from .checkpoint import Checkpoint

    if isinstance(weights, WeightSource):
        return weights
    if isinstance(weights, Checkpoint):
        return _checkpoint_source(weights.path)
    if not isinstance(weights, (str, os.PathLike)):
        raise TypeError(
            f"weights must be a path (a .safetensors file, a directory of safetensors shards, a DCP directory or a "
            f"pipeswift_lab checkpoint) or a Checkpoint; got {type(weights).__name__}"
        )
    path = Path(weights).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"weights={str(weights)!r} does not exist")
    if path.is_file():
        if path.suffix == ".json" and path.name.endswith(".index.json"):
            return _safetensors_source(path.parent, index=path)
        if path.suffix != ".safetensors":
            raise ValueError(
                f"weights={str(weights)!r} is a file that is not a .safetensors file (or a safetensors index); "
                f"give a .safetensors file, a directory holding {SAFETENSORS_FILE} or {INDEX_FILE}, a "
                "torch.distributed.checkpoint directory or a pipeswift_lab checkpoint"
            )
        return _safetensors_source(path.parent, files=[path])
    if (path / INDEX_FILE).is_file():
        return _safetensors_source(path, index=path / INDEX_FILE)
    if (path / SAFETENSORS_FILE).is_file():
        return _safetensors_source(path, files=[path / SAFETENSORS_FILE])
    from .checkpoint import MANIFEST, latest_checkpoint

    if (path / MANIFEST).is_file() or latest_checkpoint(path) is not None:
        return _checkpoint_source(path)
    if (path / ".metadata").is_file():
        return _dcp_source(path)
    shards = sorted(path.glob("*.safetensors"))
    if len(shards) == 1:
        return _safetensors_source(path, files=shards)
    raise ValueError(
        f"weights={str(weights)!r} holds no checkpoint this reads: no {SAFETENSORS_FILE}, no {INDEX_FILE}"
        f"{f' (it has {len(shards)} .safetensors files but no index naming what each holds)' if shards else ''}, no "
        "DCP .metadata and no pipeswift_lab manifest.json"
    )


def _safetensors_source(root: Path, *, files: list[Path] | None = None, index: Path | None = None) -> WeightSource:
    from safetensors import safe_open

    if index is not None:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"the safetensors index {str(index)!r} has no readable weight_map: {exc}") from None
        files = sorted({root / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"the safetensors index {str(index)!r} names shards that do not exist: {missing}")
    assert files is not None
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    where: dict[str, str] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                tensor = f.get_slice(key)
                dtype = _SAFETENSORS_DTYPES.get(tensor.get_dtype())
                if dtype is None:
                    raise ValueError(f"{str(file)!r}: tensor {key!r} has dtype {tensor.get_dtype()}, which torch lacks")
                shapes[key] = (tuple(tensor.get_shape()), dtype)
                where[key] = str(file)
    return WeightSource("safetensors", str(files[0] if len(files) == 1 and index is None else root), shapes, where)


def _tensor_shapes(metadata: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        key: (tuple(item.size), item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }


def _dcp_source(path: Path) -> WeightSource:
    from torch.distributed.checkpoint import FileSystemReader

    shapes = _tensor_shapes(FileSystemReader(str(path)).read_metadata())
    return WeightSource("dcp", str(path), shapes, {})


def _checkpoint_source(path: Path) -> WeightSource:
    from .checkpoint import load_checkpoint, storage_reader
    from .checkpoint_files import MODEL

    found = load_checkpoint(path)
    shapes = _tensor_shapes(storage_reader(found).read_metadata())
    prefix = MODEL + "."
    model = {k[len(prefix) :]: v for k, v in shapes.items() if k.startswith(prefix)}
    return WeightSource("checkpoint", str(found.path), model, {}, prefix=prefix)


def _dcp_prefix(source: WeightSource, keys: Iterable[str]) -> WeightSource:
    """A DCP source read under ``model.`` when the model's names are there and not at the top level."""
    keys = list(keys)
    if source.kind != "dcp" or any(k in source.shapes for k in keys):
        return source
    prefix = "model."
    nested = {k[len(prefix) :]: v for k, v in source.shapes.items() if k.startswith(prefix)}
    if not nested:
        return source
    return WeightSource("dcp", source.path, nested, {}, prefix=prefix, read_log=source.read_log)


def check_weights(
    source: WeightSource,
    model_state: Mapping[str, torch.Tensor],
    aliases: Mapping[str, str],
    ignored: Iterable[str] = (),
    model: nn.Module | None = None,
) -> WeightSource:
    """Check that ``source`` holds every tensor of ``model_state`` (``model.state_dict()``, meta tensors will do) with
    its shape, and nothing else; return the source as the ranks read it (a key of a tied weight under the name the
    source has).

    ``aliases`` maps a tied weight's other names to its canonical one (either name may be stored); stored tensors
    named in ``ignored`` are not unexpected (a model's non-persistent buffers, which a traced stage saves). A
    Hugging Face ``model``'s safetensors checkpoint is read as ``from_pretrained`` reads it, through transformers'
    loading conversion (:mod:`.hf_conversion`): renamed keys, and tensors stored one per expert, are the model's.
    Raises ``ValueError`` naming the first missing, unexpected and mismatched tensors. A dtype that differs from the
    model's is converted on load, and said so in a ``UserWarning``.
    """
    source = _dcp_prefix(source, model_state)
    conversion = hf_conversion(model, source.shapes) if model is not None and source.kind == "safetensors" else None
    conversion = conversion or HFConversion()
    names_of: dict[str, list[str]] = {}
    for alias, canonical in aliases.items():
        names_of.setdefault(canonical, [canonical]).append(alias)
    found: dict[str, str] = {}
    converted = {k: c for k, c in conversion.converted.items() if k in model_state}
    missing = []
    for key in model_state:
        if key in converted:
            continue
        canonical = aliases.get(key, key)
        candidates = [conversion.renamed.get(n, n) for n in (key, *names_of.get(canonical, [canonical]))]
        name = next((n for n in candidates if n in source.shapes), None)
        if name is None:
            missing.append(key)
        else:
            found[key] = name
    used = set(found.values()) | {k for c in converted.values() for k in c.sources}
    skip = set(ignored)
    unexpected = [k for k in source.shapes if k not in used and aliases.get(k, k) not in used and k not in skip]
    made, refused = (
        ({}, {}) if model is None else converted_shapes(model, replace(conversion, converted=converted), source.shapes)
    )
    stored_shapes = {**{key: source.shapes[name][0] for key, name in found.items()}, **made}
    wrong = {
        key: (tuple(model_state[key].shape), shape)
        for key, shape in stored_shapes.items()
        if tuple(model_state[key].shape) != shape
    }
    problems = state_mismatch(missing, unexpected, wrong, "the weights")
    if refused:
        made_from = [f"{key} ({why})" for key, why in refused.items()]
        problems.append(f"transformers' conversion cannot make ({len(made_from)}): {'; '.join(made_from[:4])}")
    if problems:
        raise ValueError(
            f"weights={source.path!r} ({source.kind}) do not match the model: "
            + "; ".join(problems)
            + ". Were they saved from another model or config?"
        )
    casts = sorted(
        {
            f"{source.shapes[name][1]} -> {model_state[key].dtype}"
            for key, name in found.items()
            if source.shapes[name][1] != model_state[key].dtype
        }
    )
    if casts:
        warnings.warn(
            f"weights={source.path!r}: tensors are converted to the model's dtype as they load ({', '.join(casts)})",
            UserWarning,
            stacklevel=3,
        )
    return replace(source, renamed={key: name for key, name in found.items() if key != name}, converted=converted)


def write_weights(state: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> Path:
    """Write ``state`` (a model's ``state_dict``, each tied tensor once) as one safetensors file at ``path``; return
    the path. Tensors on a GPU are copied to the CPU one at a time."""
    from safetensors.torch import save_file

    tensors = {k: t.detach().contiguous() for k, t in state.items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def check_run_weights(model: nn.Module, weights: Any, init: InitFn | None) -> WeightSource | None:
    """``run(weights=, init=)`` checked before launch: ``weights`` indexed and checked against ``model`` (names,
    shapes; a dtype conversion warned) and returned; ``None`` when none are given, after checking that a meta model
    can be initialized (:func:`~pipeswift_lab.core.meta_device.check_initializable`)."""
    from ..core.meta_device import alias_map, check_initializable, is_meta_model

    if weights is None:
        if is_meta_model(model) or init is not None:
            check_initializable(model, init)
        return None
    state = model.state_dict(keep_vars=True)
    loose = [n for n, _ in model.named_buffers() if n not in state]  # in no checkpoint: initialized with their module
    source = check_weights(open_weights(weights), state, alias_map(model), ignored=loose, model=model)
    check_initializable(model, init, names=loose)
    return source


def hf_config(model: nn.Module) -> dict[str, Any] | None:
    """A Hugging Face model's config as a dict (written as ``config.json`` beside the trained weights); else None."""
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not callable(to_dict):
        return None
    found = json.loads(json.dumps(to_dict(), default=str))
    if not found.get("architectures"):  # as save_pretrained writes it: AutoModel* find the class
        found["architectures"] = [type(model).__name__]
    return found
