"""How a :class:`~pipeswift_lab.runner.spec.RunSpec` is pickled: code by value, the model as its structure.

Objects defined in a notebook (``__main__``), in a test, in a dynamically created module or in any module that is
not an installed package are pickled *by value* (``cloudpickle.register_pickle_by_value``), so workers never need to
import the caller's code; torch, pipeswift_lab and other installed packages are pickled by reference. Every tensor
of the model's ``state_dict`` is pickled as an empty meta tensor
(:func:`~pipeswift_lab.core.meta_device.structure_reducer`): the weights travel apart, once.
"""

from __future__ import annotations

import functools
import os
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from torch import nn

from ..core.meta_device import structure_reducer

__all__ = ["dumps_structure", "pickled_by_value"]


def dumps_structure(obj: object, model: nn.Module) -> bytes:
    """``cloudpickle.dumps(obj)`` with every tensor of ``model``'s ``state_dict`` pickled as an empty meta tensor
    (:func:`~pipeswift_lab.core.meta_device.structure_reducer`)."""
    import io
    import pickle

    import cloudpickle

    reduce = structure_reducer(model)

    class StructurePickler(cloudpickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            reduced = reduce(obj)
            return reduced if reduced is not NotImplemented else super().reducer_override(obj)

    buffer = io.BytesIO()
    StructurePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _is_installed(module: ModuleType) -> bool:
    name = getattr(module, "__name__", "") or ""
    if name.split(".")[0] in ("pipeswift_lab", "torch", "builtins"):
        return True
    file = getattr(module, "__file__", None)
    if not file:
        return name in sys.builtin_module_names
    file = os.path.realpath(file)
    paths = sysconfig.get_paths()
    roots = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    return any(file.startswith(root + os.sep) for root in roots)


def _modules_of(obj: object) -> set[str]:
    names = set()
    while isinstance(obj, functools.partial):
        obj = obj.func
    for candidate in (obj, type(obj)):
        name = getattr(candidate, "__module__", None)
        if isinstance(name, str):
            names.add(name)
    return names


@contextmanager
def pickled_by_value(objs: list[Any]) -> Iterator[None]:
    """Register the modules of ``objs`` that are not installed packages for by-value pickling, then unregister."""
    import cloudpickle

    registered = []
    names = set().union(*(_modules_of(o) for o in objs)) if objs else set()
    for name in sorted(names):
        if name == "__main__":
            continue  # cloudpickle pickles __main__ by value already
        module = sys.modules.get(name)
        if module is None or _is_installed(module):
            continue
        try:
            cloudpickle.register_pickle_by_value(module)
        except ValueError:  # already registered by the caller
            continue
        registered.append(module)
    try:
        yield
    finally:
        for module in registered:
            cloudpickle.unregister_pickle_by_value(module)
