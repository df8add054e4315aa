"""What a model holds per micro-batch as torch's pipeline tracer runs it: the memory of its exported graph, unit by
unit.

A model that is not an ``nn.Sequential`` runs in a pipeline as the graph ``torch.export`` captures
(:mod:`pipeswift_lab.runner.stages.traced` cuts it), and that graph need not hold what the eager
forward holds: Hugging Face models take other code paths when exported (a causal mask made
explicit instead of ``is_causal``, grouped-query attention's keys and values repeated before
attention), so a stage can keep a tenth more than the eager profile says. :func:`traced_memory`
exports the whole model once (``torch.export.export``, the KV cache off as in the runner), runs
the graph node by node on the profiled sample under
:class:`~pipeswift_lab.core.live_bytes.LiveTensorBytes`, each node counted under the unit whose
``nn_module_stack`` holds it (code between units under the unit before it, as a split there puts
it), then the loss and its backward. It returns, per unit, what :mod:`.hooks`' memory step
measures on the eager forward: the bytes the unit allocates that the forward still holds at its
end, and what a cut before it sends (found from the graph: every value made before the unit and
read at or after it), its floating part and the part only the sending stage keeps; and the loss's
kept and retained bytes. A second run receives every value a unit reads from an earlier one as a
receive buffer does (requiring grad), which makes the operators that read a mask or rotary tables
save for their backward: what that adds is the unit's ``received_held_bytes``.

Where the model cannot be exported it returns None, and the eager measure stands.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from ..core.live_bytes import LiveTensorBytes, live_tensors
from .pipeline_settings import training_settings

__all__ = ["TracedMemory", "traced_memory"]

_BEFORE, _LOSS = "before", "loss"


@dataclass(frozen=True, kw_only=True)
class TracedMemory:
    """The memory columns of a traced model, one value per unit (in the units' order)."""

    held_bytes: list[float]
    """What each unit allocates and the forward still holds when it ends (the first unit also what the graph makes
    before it)."""
    cut_bytes: list[float]
    """What a cut just before each unit sends per micro-batch (0 for the first)."""
    cut_grad_bytes: list[float]
    """The floating-point part of ``cut_bytes``."""
    cut_freed_bytes: list[float]
    """The part of ``cut_bytes`` the forward frees before it ends."""
    loss_activation_bytes: float
    """What the loss keeps until its backward."""
    loss_retained_bytes: float
    """What the loss still holds after its backward, while the loss tensor lives."""
    received_held_bytes: list[float]
    """What each unit holds besides in a stage that receives from an earlier one the floating tensors it reads that
    need no gradient in the model (a mask, rotary tables): a receive buffer requires grad, so the operators that read
    it save for their backward."""


def _unit_of(node: fx.Node, names: dict[str, int]) -> int | None:
    """The unit whose module ``node`` runs in (from its ``nn_module_stack``), or None for code between units."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if path in names:
            return names[path]
    return None


def _positions(graph: fx.Graph, names: dict[str, int]) -> dict[fx.Node, int]:
    """Every computing node's unit: its own, or for code between units the last unit before it (-1 before any)."""
    out: dict[fx.Node, int] = {}
    current = -1
    for node in graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            unit = _unit_of(node, names)
            current = unit if unit is not None else current
            out[node] = current
        elif node.op == "placeholder":
            out[node] = -1
    return out


class _Counting(fx.Interpreter):
    """Runs a graph with each node's allocations counted under its unit, noting the values a later unit reads."""

    def __init__(
        self,
        gm: fx.GraphModule,
        tracker: LiveTensorBytes,
        positions: dict[fx.Node, int],
        watched: set[fx.Node],
        first_unit: int,
        received: bool = False,
    ) -> None:
        super().__init__(gm)
        self.tracker, self.positions, self.watched, self.first_unit = tracker, positions, watched, first_unit
        self.received = received
        self.values: dict[fx.Node, tuple[int, bool, int | None]] = {}  # node -> (bytes, floating, storage number)
        self._leaves: dict[tuple[fx.Node, int], torch.Tensor] = {}

    def fetch_args_kwargs_from_env(self, n: fx.Node) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The node's inputs; with ``received``, a floating value that needs no gradient and comes from an earlier
        unit arrives as a receive buffer would: a leaf that requires grad (one per value and reading unit)."""
        if not self.received:
            return super().fetch_args_kwargs_from_env(n)
        here = self.positions.get(n, -1)

        def fetch(source: fx.Node) -> Any:
            value = self.env[source]
            if (
                here >= 0
                and source.op != "get_attr"
                and self.positions.get(source, -1) < here
                and isinstance(value, torch.Tensor)
                and value.is_floating_point()
                and not value.requires_grad
            ):
                key = (source, here)
                if key not in self._leaves:
                    self._leaves[key] = value.detach().requires_grad_(True)
                return self._leaves[key]
            return value

        args = fx.node.map_arg(n.args, fetch)
        kwargs = fx.node.map_arg(n.kwargs, fetch)
        return tuple(args), dict(kwargs)

    def run_node(self, n: fx.Node) -> Any:
        position = self.positions.get(n)
        if position is not None and n.op != "placeholder":
            # what the graph makes before the first unit is made by that unit's stage
            self.tracker.category = f"u{position if position >= 0 else self.first_unit}"
        result = super().run_node(n)
        if n in self.watched and isinstance(result, torch.Tensor):
            nbytes = result.numel() * result.element_size()
            self.values[n] = (nbytes, result.is_floating_point(), self.tracker.serial(result))
        return result


def traced_memory(
    model: nn.Module,
    units: Sequence[tuple[str, nn.Module]],
    order: Sequence[int],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    target: Any,
    loss: Callable[[Any, Any], torch.Tensor],
    *,
    autocast: str | None = None,
) -> TracedMemory | None:
    """The memory columns of ``model`` run as its exported graph on one micro-batch (``args``, ``kwargs``), per unit
    of ``units`` (whose first calls come in ``order``, unit indices); ``loss(output, target)`` is the step's loss;
    ``autocast`` (a device type) runs the graph and the loss under ``torch.autocast`` in bf16.

    Returns a :class:`TracedMemory`, or None when ``torch.export`` cannot capture the model, a unit is not in the
    graph, or the graph does not run.
    """
    names = {name: i for i, (name, _) in enumerate(units)}
    try:
        with training_settings(model), torch.random.fork_rng():
            exported = torch.export.export(model, args, kwargs, strict=False)
        gm = exported.module()
    except Exception:  # a model torch.export cannot capture: the eager measure stands
        return None
    positions = _positions(gm.graph, names)
    if {p for p in positions.values() if p >= 0} != set(range(len(units))):
        return None
    rank = {u: i for i, u in enumerate(order)}
    reads = _cross_reads(gm.graph, positions, rank)
    tracker = LiveTensorBytes()
    tracker.adopt(live_tensors(), _BEFORE)
    try:
        with torch.random.fork_rng(), training_settings(model), tracker, _autocast(autocast):
            runner = _Counting(gm, tracker, positions, set(reads), order[0])
            flat = runner.run(*pytree.arg_tree_leaves(*args, **kwargs), enable_io_processing=False)
            output = gm.graph.process_outputs(flat)  # the model's own output structure
            held = {int(c[1:]): float(b) for c, b in tracker.live_by.items() if c.startswith("u")}
            alive = tracker.live_serials()
            tracker.category = _LOSS
            value = loss(output, target)
            kept = float(tracker.live_by.get(_LOSS, 0))
            tracker.category = "backward"
            value.backward()
            retained = float(tracker.live_by.get(_LOSS, 0))
        with _autocast(autocast):
            received = _held_receiving(gm, positions, order[0], args, kwargs, model)
    except Exception:  # the graph does not run as the model: the eager measure stands
        return None
    finally:
        with contextlib.suppress(Exception):
            for p in model.parameters():
                p.grad = None
    n = len(units)
    cut, grad, freed = [0.0] * n, [0.0] * n, [0.0] * n
    for node, (first, last) in reads.items():
        nbytes, floating, serial = runner.values.get(node, (0, False, None))
        for i in range(max(first, 1), min(last, len(order) - 1) + 1):
            u = order[i]
            cut[u] += nbytes
            grad[u] += nbytes if floating else 0.0
            freed[u] += nbytes if serial not in alive else 0.0
    return TracedMemory(
        held_bytes=[held.get(u, 0.0) for u in range(n)],
        cut_bytes=cut,
        cut_grad_bytes=grad,
        cut_freed_bytes=freed,
        loss_activation_bytes=kept,
        loss_retained_bytes=retained,
        received_held_bytes=[max(0.0, received.get(u, 0.0) - held.get(u, 0.0)) for u in range(n)],
    )


def _autocast(device_type: str | None) -> Any:
    return torch.autocast(device_type, dtype=torch.bfloat16) if device_type else contextlib.nullcontext()


def _held_receiving(
    gm: fx.GraphModule,
    positions: dict[fx.Node, int],
    first_unit: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    model: nn.Module,
) -> dict[int, float]:
    """What each unit holds at the forward's end when every value it reads from an earlier unit arrives as a receive
    buffer (requiring grad)."""
    tracker = LiveTensorBytes()
    tracker.adopt(live_tensors(), _BEFORE)
    with torch.random.fork_rng(), training_settings(model), tracker:
        runner = _Counting(gm, tracker, positions, set(), first_unit, received=True)
        flat = runner.run(*pytree.arg_tree_leaves(*args, **kwargs), enable_io_processing=False)
        held = {int(c[1:]): float(b) for c, b in tracker.live_by.items() if c.startswith("u")}
        del flat
    return held


def _cross_reads(
    graph: fx.Graph, positions: dict[fx.Node, int], rank: dict[int, int]
) -> dict[fx.Node, tuple[int, int]]:
    """Every value read in a later unit than the one that made it: ``{node: (first cut it crosses, last)}`` in call
    order (a model input's first cut is 0; the output node reads after every unit)."""
    after_all = len(rank)
    out: dict[fx.Node, tuple[int, int]] = {}
    for node in graph.nodes:
        if node.op == "output":
            where = after_all
        elif node in positions and node.op != "placeholder":
            where = rank.get(positions[node], -1)
        else:
            continue
        for source in node.all_input_nodes:
            if source not in positions or source.op == "get_attr":
                continue
            made = rank.get(positions[source], -1) if source.op != "placeholder" else -1
            if where > made:
                first, last = out.get(source, (made + 1, where))
                out[source] = (first, max(last, where))
    return out
