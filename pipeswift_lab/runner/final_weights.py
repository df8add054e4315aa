"""The trained model, written by each rank from its own stages and never assembled in one process.

At the end of a run every rank of replica 0 writes the tensors of its stages as one safetensors shard,
``final/model-<r+1>-of-<P>.safetensors`` in the run directory, under the model's names (a tied weight once, by
the first stage holding it, under its canonical name: :mod:`.stages.tied`). The caller keeps the folder as
:class:`FinalWeights`, which is what ``RunResult.state_dict()`` reads (on first use) and what
``RunResult.save_pretrained(dir)`` copies file by file, with Hugging Face's ``model.safetensors.index.json`` (and
the model's ``config.json`` when it has one), so ``from_pretrained(dir)`` or ``load_state_dict`` of a plain module
reads it back.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .weights import INDEX_FILE, SAFETENSORS_FILE, write_weights

if TYPE_CHECKING:
    from .spec import RunSpec

__all__ = [
    "FINAL_DIR",
    "FinalWeights",
    "StoredForm",
    "keep_final_weights",
    "shard_name",
    "write_pretrained",
    "write_rank_shard",
    "write_stage_shard",
]

#: A shard's tensors (the model's names) as its model family stores them (the names and tensors ``save_pretrained``
#: writes).
StoredForm = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
#: The folder of the run directory the ranks write their final shards into.
FINAL_DIR = "final"
#: Where the caller keeps a run's final shards once its run directory is gone, with the caller's pid in an owner file
#: (as a run directory has), so that a later run() removes the folder of a caller that died
#: (``job.clean_stale_run_dirs``).
KEPT_PREFIX = "pipeswift_final_"
OWNER_FILE = "owner.pid"


def shard_name(pp_rank: int, P: int) -> str:
    """The file pipeline rank ``pp_rank`` of ``P`` writes: Hugging Face's shard naming."""
    return f"model-{pp_rank + 1:05d}-of-{P:05d}.safetensors"


def write_stage_shard(
    out_dir: Path,
    pp_rank: int,
    P: int,
    modules: Mapping[int, torch.nn.Module],
    state_keys: Sequence[str],
    aliases: Mapping[str, str],
    first_holder: Mapping[str, int],
    *,
    writes: bool = True,
) -> str | None:
    """Write the state of ``modules`` (``{stage: module}``, this rank's) as this rank's final shard; return its name.

    Only the model's ``state_keys`` are written (a traced stage also holds buffers the model does not save), each
    tied weight once under its canonical name, by the stage ``first_holder`` names for it. A sharded tensor (a
    DTensor of tensor parallelism or FSDP) is gathered whole first: every process of the stage's mesh calls this,
    and only the one that ``writes`` writes (the others return None)."""
    keys = set(state_keys)
    state: dict[str, torch.Tensor] = {}
    for stage, module in modules.items():
        for key, tensor in module.state_dict().items():
            if key not in keys:
                continue
            canonical = aliases.get(key, key)
            if first_holder.get(canonical, stage) != stage or canonical in state:
                continue
            if hasattr(tensor, "full_tensor"):  # a collective over the stage's mesh: every process of it is here
                tensor = tensor.full_tensor()
            state[canonical] = tensor.detach().to("cpu")
    if not writes:
        return None
    name = shard_name(pp_rank, P)
    write_weights(state, out_dir / FINAL_DIR / name)
    return name


def write_rank_shard(
    out_dir: Path,
    spec: RunSpec,
    pp_rank: int,
    replica: int,
    modules: Mapping[int, torch.nn.Module],
    shard: tuple[int, int] = (0, 0),
) -> str | None:
    """Write a rank's trained stages (``{stage: module}``) as its shard of the final model; return the file's name.
    Only replica 0 writes (the replicas hold the same), and of its ``(fsdp rank, tp rank)`` processes ``shard``, the
    first, once the stage's sharded tensors are gathered; the others return None."""
    from .stages.tied import alias_map

    if replica != 0:
        return None
    return write_stage_shard(
        out_dir,
        pp_rank,
        spec.P,
        modules,
        spec.state_keys,
        alias_map(spec.model),
        {group.canonical: group.stages[0] for group in spec.tied},
        writes=shard == (0, 0),
    )


def _index(files: Iterable[Path]) -> dict[str, Any]:
    from safetensors import safe_open

    weight_map: dict[str, str] = {}
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                weight_map[key] = file.name
                sliced = f.get_slice(key)
                numel = 1
                for n in sliced.get_shape():
                    numel *= n
                total += numel * _itemsize(sliced.get_dtype())
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def _itemsize(dtype: str) -> int:
    from .weights import _SAFETENSORS_DTYPES

    return _SAFETENSORS_DTYPES[dtype].itemsize


class FinalWeights(Mapping[str, torch.Tensor]):
    """A run's trained tensors as the shards its ranks wrote: a read-only mapping keyed like ``model.state_dict()``,
    loaded from disk on first access (a tied weight's names share one tensor)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keys: Sequence[str],
        names: Iterable[tuple[str, ...]],
        shards: Sequence[str],
    ) -> None:
        self.directory = Path(directory)
        self.keys_ = tuple(keys)
        self.names = [tuple(group) for group in names if len(group) > 1]
        self.shards = tuple(sorted(shards))
        self._loaded: dict[str, torch.Tensor] | None = None

    @property
    def files(self) -> list[Path]:
        """The shards this run's ranks wrote, in pipeline order (a folder reused by an earlier run may hold more)."""
        return [self.directory / name for name in self.shards]

    def _state(self) -> dict[str, torch.Tensor]:
        if self._loaded is None:
            from safetensors.torch import load_file

            from .stages.tied import with_aliases

            state: dict[str, torch.Tensor] = {}
            for file in self.files:
                state.update(load_file(str(file)))
            try:
                self._loaded = with_aliases(state, self.keys_, self.names)
            except KeyError:
                missing = [k for k in self.keys_ if k not in state]
                raise RuntimeError(
                    f"the final shards in {str(self.directory)!r} lack {len(missing)} tensors of the model, e.g. "
                    f"{missing[:3]}"
                ) from None
        return self._loaded

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._state()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys_)

    def __len__(self) -> int:
        return len(self.keys_)

    def save_pretrained(
        self,
        path: str | os.PathLike[str],
        config: Mapping[str, Any] | None = None,
        stored_form: StoredForm | None = None,
    ) -> Path:
        """Write the shards into the folder ``path`` as a Hugging Face checkpoint (``model.safetensors`` for one shard,
        else the shards and ``model.safetensors.index.json``), with ``config.json`` when ``config`` is given; return
        the folder. Without ``stored_form`` the files are copied and no tensor is loaded; with it each shard is read,
        turned into the names and tensors the family stores (``stored_form(state)``,
        :func:`~pipeswift_lab.runner.hf_conversion.to_stored`) and written, one shard in memory at a time."""
        path = _empty_folder(path)
        files = self.files
        names = [SAFETENSORS_FILE] if len(files) == 1 else [f.name for f in files]
        for file, name in zip(files, names):
            if stored_form is None:
                shutil.copyfile(file, path / name)
            else:
                from safetensors.torch import load_file

                write_weights(stored_form(load_file(str(file))), path / name)
        if len(files) > 1:
            (path / INDEX_FILE).write_text(json.dumps(_index(path / name for name in names), indent=2))
        _write_config(path, config)
        return path


def _empty_folder(path: str | os.PathLike[str]) -> Path:
    path = Path(path)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(f"{str(path)!r} exists and is not an empty folder; save_pretrained writes a new one")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _write_config(path: Path, config: Mapping[str, Any] | None) -> None:
    if config is not None:
        (path / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True))


def write_pretrained(
    state: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    aliases: Mapping[str, str],
    config: Mapping[str, Any] | None = None,
    stored_form: StoredForm | None = None,
) -> Path:
    """Write ``state`` (keyed like ``model.state_dict()``) into the folder ``path`` as ``model.safetensors``, each tied
    tensor once under its canonical name (in the family's stored form when ``stored_form`` is given), with
    ``config.json`` when ``config`` is given; return the folder."""
    from .stages.tied import canonical_state

    path = _empty_folder(path)
    state = canonical_state(dict(state), dict(aliases))
    write_weights(stored_form(state) if stored_form is not None else state, path / SAFETENSORS_FILE)
    _write_config(path, config)
    return path


def keep_final_weights(
    run_dir: Path, keys: Sequence[str], names: Iterable[tuple[str, ...]], shards: Sequence[str], move: bool
) -> FinalWeights:
    """The final ``shards`` the ranks wrote into ``run_dir`` as :class:`FinalWeights`; with ``move`` the folder is
    moved out of the run directory first (``run()``'s is temporary) and removed with the last result holding it."""
    folder = run_dir / FINAL_DIR
    if not move:
        return FinalWeights(folder, keys, names, shards)
    kept = Path(tempfile.mkdtemp(prefix=KEPT_PREFIX))
    (kept / OWNER_FILE).write_text(str(os.getpid()))
    os.replace(folder, kept / FINAL_DIR)
    weights = FinalWeights(kept / FINAL_DIR, keys, names, shards)
    weakref.finalize(weights, shutil.rmtree, str(kept), True)
    return weights
