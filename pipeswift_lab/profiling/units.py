"""The model-side helpers of :func:`pipeswift_lab.profiling.measure.profile`: which submodules are the units
(:func:`select_units`), where a failing forward was (:func:`locate_failure`), and giving the
model back as it was (:func:`preserved_state`), on its one device (:func:`model_device`).
"""

from __future__ import annotations

import fnmatch
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


def locate_failure(model: nn.Module, exc: BaseException) -> str:
    """Describe the innermost submodule of ``model`` on ``exc``'s traceback: name, type, input and weight shapes."""
    names = {id(m): n for n, m in model.named_modules()}
    found: tuple[nn.Module, Any] | None = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module) and id(owner) in names:
            found = (owner, frame)
    if found is None:
        return "outside the model's modules"
    module, frame = found
    code = frame.f_code
    arg_names = code.co_varnames[1 : code.co_argcount + code.co_kwonlyargcount]
    inputs = {a: list(v.shape) for a in arg_names if isinstance(v := frame.f_locals.get(a), torch.Tensor)}
    name = names[id(module)] or "<model>"
    weights = {n: list(p.shape) for n, p in module.named_parameters(recurse=False)}
    text = f"layer {name!r} ({type(module).__name__}) with input shapes {inputs}"
    return text + (f" and parameter shapes {weights}" if weights else "")


# -- units ---------------------------------------------------------------------------------
def _match(pattern: str, name: str) -> bool:
    """Glob match by dotted segment: ``*`` never crosses a ``.`` (``"blocks.*"`` is not ``"blocks.0.mlp"``)."""
    parts, segments = pattern.split("."), name.split(".")
    return len(parts) == len(segments) and all(fnmatch.fnmatchcase(s, p) for p, s in zip(parts, segments))


def _listing(names: list[str], limit: int = 30) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", … ({len(names) - limit} more)" if len(names) > limit else "")


def select_units(
    model: nn.Module, layers: str | Sequence[str] | None, *, announce: bool = True
) -> list[tuple[str, nn.Module]]:
    """Resolve ``layers`` (None, ``"auto"``, or names / dotted glob patterns) to ``[(name, module), ...]``.

    ``None`` takes the children of an ``nn.Sequential``; ``"auto"`` finds the repeated blocks and
    the modules with parameters around them (see :func:`auto_units`, which prints its choice with
    ``announce``); any other string is one
    pattern (``["auto"]`` names a submodule called ``auto``). Raises ``ValueError`` for a pattern
    that matches nothing (listing the names at that depth), for units that contain each
    other, for ``None`` on a model that is not an ``nn.Sequential``, and for ``"auto"`` on a
    model without repeated blocks.
    """
    if layers is None:
        units = _sequential_children(model)
    elif isinstance(layers, str) and layers == AUTO:
        units = auto_units(model, announce=announce)
    else:
        units = _matched_units(model, layers)
    _check_disjoint(units)
    return units


def _sequential_children(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of an ``nn.Sequential`` (what ``layers=None`` takes)."""
    children = list(model.named_children())
    if not isinstance(model, nn.Sequential):
        hint = [f"{n}.*" if isinstance(m, (nn.ModuleList, nn.Sequential)) else n for n, m in children]
        raise ValueError(
            f"layers=None takes the children of an nn.Sequential, but model is a {type(model).__name__}; "
            f"pass layers= a list of submodule names or glob patterns, e.g. layers={hint}"
        )
    if not children:
        raise ValueError("layers=None found no children in this nn.Sequential; it has no layers to profile")
    return children


def _matched_units(model: nn.Module, layers: str | Sequence[str]) -> list[tuple[str, nn.Module]]:
    """The submodules that ``layers`` (names or dotted glob patterns) name, each once, in the patterns' order."""
    if isinstance(layers, str):
        layers = [layers]
    if not isinstance(layers, (list, tuple)):
        raise TypeError(
            f"layers must be None or a list of submodule names / glob patterns; got {type(layers).__name__} {layers!r}"
        )
    if not layers:
        raise ValueError(
            "layers=[] is invalid; give at least one submodule name or glob pattern, or None for an nn.Sequential"
        )
    modules = [(n, m) for n, m in model.named_modules() if n]
    units: list[tuple[str, nn.Module]] = []
    taken: set[int] = set()
    for pattern in layers:
        if not isinstance(pattern, str):
            raise TypeError(
                f"layers entries must be str names or glob patterns; got {type(pattern).__name__} {pattern!r}"
            )
        matched = [(n, m) for n, m in modules if n == pattern or _match(pattern, n)]
        if not matched:
            depth = pattern.count(".") + 1
            at_depth = [n for n, _ in modules if n.count(".") + 1 == depth] or [n for n, _ in modules]
            raise ValueError(
                f"layers pattern {pattern!r} matches no submodule of the {type(model).__name__}; "
                f"available names: {_listing(at_depth)}"
            )
        for n, m in matched:
            if id(m) not in taken:
                taken.add(id(m))
                units.append((n, m))
    return units


def _check_disjoint(units: list[tuple[str, nn.Module]]) -> None:
    """Refuse units that contain each other: a layer is timed once."""
    for i, (name_a, a) in enumerate(units):
        inside_a = {id(m) for m in a.modules()}
        for name_b, b in units[i + 1 :]:
            if id(b) in inside_a or id(a) in {id(m) for m in b.modules()}:
                outer, inner = (name_a, name_b) if id(b) in inside_a else (name_b, name_a)
                raise ValueError(
                    f"layers overlap: {inner!r} is inside {outer!r}; choose units that do not contain each other"
                )


# -- layers="auto" ------------------------------------------------------------------------
AUTO = "auto"
"""The ``layers`` value that finds the repeated blocks itself (:func:`auto_units`)."""

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def auto_units(model: nn.Module, *, announce: bool = True) -> list[tuple[str, nn.Module]]:
    """The units ``layers="auto"`` chooses: the repeated blocks, and the modules with parameters before and after.

    The blocks are the children of the longest ``nn.ModuleList`` / ``nn.ModuleDict`` /
    ``nn.Sequential`` anywhere in ``model`` whose children (at least 2) are all of one class;
    ties go to the shallowest, then the first in ``named_modules()`` order. Around them, walking
    from the root down to that container, each level's other children that hold at least one
    parameter are units, in registration order: those registered before the path come before
    the blocks, those after it after them (the deepest level's first). An ``nn.ModuleList`` or
    ``nn.ModuleDict`` there, which never runs itself, gives its children with parameters
    instead, and a module there that holds repeated blocks of its own (an encoder–decoder's
    decoder beside the encoder's blocks) is opened the same way. A module registered under two
    names is taken once. The order is the modules' registration order; :func:`profile` puts
    them in the order they run (:func:`units_in_run_order`). With ``announce``, prints one line
    saying what was chosen. Raises ``ValueError`` when ``model`` has no such container.
    """
    units, _ = _auto_walk(model)
    if announce:
        print(auto_announcement(model, units))
    return units


def _auto_walk(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], list[tuple[str, nn.Module]]]:
    """``layers="auto"``'s units in registration order, and every ``(name, container)`` of blocks it took."""
    found = find_blocks(model)
    if found is None:
        raise ValueError(_no_blocks_message(model))
    groups: list[tuple[str, nn.Module]] = []
    return _opened(model, "", found, set(), groups), groups


def _opened(
    module: nn.Module,
    prefix: str,
    found: tuple[str, nn.Module],
    taken: set[int],
    groups: list[tuple[str, nn.Module]],
) -> list[tuple[str, nn.Module]]:
    """The units of ``module`` (named ``prefix``) around its blocks ``found``: those before, the blocks, those
    after. Adds what it takes to ``taken`` and the block containers to ``groups``."""
    path, container = found
    groups.append((_join(prefix, path), container))
    blocks = [(_join(_join(prefix, path), n), m) for n, m in container.named_children()]
    taken |= {id(container)} | {id(m) for _, m in blocks}
    levels_before: list[list[tuple[str, nn.Module]]] = []
    levels_after: list[list[tuple[str, nn.Module]]] = []
    level, level_name = module, prefix
    for part in path.split(".") if path else []:
        before: list[tuple[str, nn.Module]] = []
        after: list[tuple[str, nn.Module]] = []
        on_path: nn.Module | None = None
        for name, child in level.named_children():
            if name == part:
                on_path = child
            else:
                side = before if on_path is None else after
                side.extend(_units_around(_join(level_name, name), child, taken, groups))
        levels_before.append(before)
        levels_after.append(after)
        assert on_path is not None, f"{part!r} is not a child on the path to {path!r}"
        level, level_name = on_path, _join(level_name, part)
    head = [unit for units in levels_before for unit in units]
    tail = [unit for units in reversed(levels_after) for unit in units]
    return head + blocks + tail


def _units_around(
    name: str, module: nn.Module, taken: set[int], groups: list[tuple[str, nn.Module]]
) -> list[tuple[str, nn.Module]]:
    """``module`` as units beside the blocks: none without parameters or already taken, the children of an
    ``nn.ModuleList`` / ``nn.ModuleDict`` (which never run themselves), the units of a module holding repeated
    blocks of its own (:func:`_opened`), else itself. Adds what it takes to ``taken``."""
    if id(module) in taken or not any(True for _ in module.parameters()):
        return []
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        taken.add(id(module))
        return [unit for n, m in module.named_children() for unit in _units_around(_join(name, n), m, taken, groups)]
    inner = find_blocks(module)
    if inner is not None and inner[0] and all(any(True for _ in b.children()) for b in inner[1].children()):
        taken.add(id(module))
        return _opened(module, name, inner, taken, groups)
    taken.add(id(module))
    return [(name, module)]


def units_in_run_order(
    units: list[tuple[str, nn.Module]], forward: Callable[[], Any]
) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """``units`` in the order their modules are first called by ``forward()`` (run once, without gradients), and
    the names of those it never calls.

    A module's registration order need not be its call order: OPT registers its decoder's
    ``final_layer_norm`` before its layers and runs it after them. When ``forward()`` raises,
    the units come back as they are and nothing is left out (the profiled step raises the
    error again, with the layer named).
    """
    first: dict[int, int] = {}

    def called(i: int) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            first.setdefault(i, len(first))

        return hook

    hooks = [module.register_forward_pre_hook(called(i)) for i, (_, module) in enumerate(units)]
    try:
        with torch.no_grad():
            forward()
    except Exception:  # the measured step raises it with the failing layer named
        return units, []
    finally:
        for hook in hooks:
            hook.remove()
    ran = sorted(first, key=first.__getitem__)
    return [units[i] for i in ran], [units[i][0] for i in range(len(units)) if i not in first]


def auto_announcement(model: nn.Module, units: Sequence[tuple[str, nn.Module]], left_out: Sequence[str] = ()) -> str:
    """The line ``layers="auto"`` prints: ``layers="auto": 4 × LlamaDecoderLayer in model.layers, with
    model.embed_tokens before and model.norm, lm_head after``, the units taken in ``units``' order (blocks, and
    the others before, between and after them), then any ``left_out`` names."""
    _, groups = _auto_walk(model)
    block_ids = {id(m) for _, container in groups for m in container.children()}
    is_block = [id(m) in block_ids for _, m in units]
    first = is_block.index(True) if any(is_block) else len(units)
    last = len(is_block) - 1 - is_block[::-1].index(True) if any(is_block) else -1
    sides: dict[str, list[str]] = {"before": [], "between": [], "after": []}
    for i, (name, _) in enumerate(units):
        if not is_block[i]:
            sides["before" if i < first else "after" if i > last else "between"].append(name)
    counted = " and ".join(
        f"{len(list(c.children()))} × {type(next(iter(c.children()))).__name__} in {path or 'the model itself'}"
        for path, c in groups
    )
    around = [f"{', '.join(names)} {side}" for side, names in sides.items() if names]
    text = f'layers="auto": {counted}' + (f", with {' and '.join(around)}" if around else "")
    if left_out:
        text += f"; {', '.join(left_out)} never ran in a forward and {'is' if len(left_out) == 1 else 'are'} left out"
    return text


def find_blocks(model: nn.Module) -> tuple[str, nn.Module] | None:
    """``(name, container)`` of the repeated blocks :func:`auto_units` takes, or None when there are none.

    ``name`` is ``""`` when ``model`` itself is the container.
    """
    best: tuple[int, int, str, nn.Module] | None = None  # (-children, depth, name, container)
    for name, module in model.named_modules():
        if not isinstance(module, _CONTAINERS):
            continue
        children = [m for _, m in module.named_children()]
        if len(children) < 2 or len({type(m) for m in children}) != 1:
            continue
        key = (-len(children), name.count(".") + 1 if name else 0)
        if best is None or key < best[:2]:
            best = (*key, name, module)
    return None if best is None else (best[2], best[3])


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _no_blocks_message(model: nn.Module) -> str:
    children = list(model.named_children())
    hint = [f"{n}.*" if isinstance(m, _CONTAINERS) else n for n, m in children]
    return (
        f'layers="auto" looked for repeated blocks (an nn.ModuleList, nn.ModuleDict or nn.Sequential holding at '
        f"least 2 children of one class) anywhere in the {type(model).__name__} and found none; pass layers= a list "
        f"of submodule names or glob patterns instead, e.g. layers={hint}; the top-level children are: "
        f"{_listing([n for n, _ in children]) or '(none)'}"
    )


# -- one input -----------------------------------------------------------------------------
#: The keyword inputs by which a Hugging Face encoder–decoder's forward gets its decoder's input.
DECODER_INPUTS = ("decoder_input_ids", "decoder_inputs_embeds", "labels")


def decoder_inputs_refusal(model: nn.Module, given: Sequence[str] = ()) -> str | None:
    """Why ``model`` cannot be fed one input tensor, or None when it can.

    A Hugging Face encoder–decoder (``config.is_encoder_decoder``: T5, BART, Marian) takes the
    decoder's input (``decoder_input_ids``, or ``labels`` it shifts) beside ``input_ids``; a
    pipeline feeds its first stage one tensor. ``given`` names the keyword inputs a caller
    passes (one of :data:`DECODER_INPUTS` among them: the model can be called). The message
    says what to do: wrap the model in a module whose forward takes one tensor.
    """
    import inspect

    config = getattr(model, "config", None)
    if not getattr(config, "is_encoder_decoder", False) or any(k in given for k in DECODER_INPUTS):
        return None
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    if "decoder_input_ids" not in parameters:
        return None
    name = type(model).__name__
    return (
        f"{name} is an encoder–decoder model (config.is_encoder_decoder): its forward takes the decoder's input "
        "(decoder_input_ids, or labels to shift) beside input_ids, and a pipeline feeds its first stage one tensor. "
        "Wrap it in a module whose forward takes one tensor and splits it, e.g.\n"
        "    class Seq2Seq(nn.Module):\n"
        "        def __init__(self, model):\n"
        "            super().__init__()\n"
        "            self.model = model\n"
        "        def forward(self, ids):  # the source and the decoder's input side by side\n"
        "            source, decoder_input = ids.chunk(2, dim=1)\n"
        "            return self.model(input_ids=source, decoder_input_ids=decoder_input)\n"
        'then profile(Seq2Seq(model), torch.cat([source, decoder_input], dim=1), ..., layers="auto") takes the '
        "encoder's and the decoder's blocks, and run() cuts and trains it with torch's tracer. "
        'split="manual" cannot: a decoder block reads the encoder\'s output beside the hidden state handed from '
        "layer to layer"
    )


# -- state ---------------------------------------------------------------------------------
@contextmanager
def preserved_state(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Restore ``model`` on exit exactly as it was: training flags, gradients, buffers, RNG.

    Parameters are not changed by a forward and backward; gradients are restored as the
    same objects; buffers (e.g. BatchNorm running statistics) as the same objects with their
    values; the CPU (and the device's CUDA) random state is forked.
    """
    training = [(m, m.training) for m in model.modules()]
    grads = [(p, p.grad) for p in model.parameters()]
    buffers = [
        (m, name, b, b.detach().clone()) for m in model.modules() for name, b in m._buffers.items() if b is not None
    ]
    cuda_devices = (
        [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    )
    try:
        with torch.random.fork_rng(devices=cuda_devices):
            yield
    finally:
        for m, flag in training:
            m.training = flag
        for p, g in grads:
            p.grad = g
        with torch.no_grad():
            for m, name, b, saved in buffers:
                m._buffers[name] = b
                if not torch.equal(b, saved):
                    b.copy_(saved)


def move_to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with its tensors (also inside tuples, lists and dicts) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(move_to_device(x, device) for x in obj)
    if isinstance(obj, list):
        return [move_to_device(x, device) for x in obj]
    if isinstance(obj, dict):
        return {k: move_to_device(v, device) for k, v in obj.items()}
    return obj


def model_device(model: nn.Module) -> torch.device:
    """The one device holding ``model``'s parameters."""
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        raise ValueError(
            f"model has parameters on several devices {sorted(map(str, devices))}; the profiler times one device"
        )
    return devices.pop()


__all__ = [
    "AUTO",
    "auto_announcement",
    "DECODER_INPUTS",
    "decoder_inputs_refusal",
    "auto_units",
    "find_blocks",
    "locate_failure",
    "model_device",
    "move_to_device",
    "preserved_state",
    "select_units",
    "units_in_run_order",
]
