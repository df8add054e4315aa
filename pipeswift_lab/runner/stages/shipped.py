"""The caller's split travels to the ranks: they unpickle torch's stages instead of tracing the model again.

torch's tracing frontend (``pipeline()``) exports the whole model with ``torch.export`` and splits
the graph at the split points into one ``GraphModule`` per stage. The caller already does all of
it once before launch (:func:`~.traced.check_traceable`), on fake tensors of the ranks' device,
so its ``Pipe``, whose stages hold meta tensors only, goes in the spec, and a rank only unpickles
it (a tenth of a second against one to four for a small Hugging Face model's export and split).

Plain ``pickle`` cannot take a ``Pipe``: ``GraphModule.__reduce__`` keeps the generated code and
traces it again on load, dropping every node's ``meta`` (torch's ``_PipelineStage`` reads the
placeholders' and the output's ``meta["val"]``); the graphs' operators (``OpOverload``) do not
pickle; their values are fake tensors. :class:`_SplitPickler` reduces those four: a graph to its
nodes in order, each with its ``meta``; a ``GraphModule`` to its attributes and graph; an operator
to its name; a fake tensor to a meta tensor of its shape, strides and dtype. A ``Pipe`` is rebuilt
by its own constructor. (torch's own ``_direct_serialization_reduce``, for RPC, drops ``meta`` too.)

Where a split cannot be pickled, nothing travels; where a rank cannot load it (an operator its
process has not registered), or runs on another device than the caller traced for (``cuda:1``:
a graph keeps the devices it was traced with), the rank traces the model itself, as before.
"""

from __future__ import annotations

import io
import pickle
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

if TYPE_CHECKING:
    from torch.distributed.pipelining import Pipe

__all__ = ["pickled_split", "unpickled_split"]

#: Node metadata that does not travel: where each node came from in earlier passes (debugging provenance that can
#: hold whole graphs).
_LEFT_BEHIND = ("from_node",)


def pickled_split(pipe: Pipe) -> bytes | None:
    """``pipe`` (the caller's split, its tensors fake or meta) pickled for the ranks, every graph with its nodes'
    metadata, fake tensors as meta tensors; ``None`` where something in it does not pickle (then the ranks trace)."""
    buffer = io.BytesIO()
    try:
        _SplitPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(pipe)
    except Exception:  # a value pickle cannot take: the ranks trace the model themselves
        return None
    return buffer.getvalue()


def unpickled_split(blob: bytes) -> Pipe | None:
    """The ``Pipe`` :func:`pickled_split` made, its tensors on the meta device; ``None`` where this process cannot
    rebuild it (an operator of a library it has not imported)."""
    try:
        return pickle.loads(blob)
    except Exception:  # whatever stops it here, the rank traces the model itself
        return None


class _NodeName:
    """A node's argument that is another node, by name (rebuilt in order, so it always names an earlier node)."""

    def __init__(self, name: str) -> None:
        self.name = name


def _by_name(node: fx.Node) -> Any:
    return _NodeName(node.name)


def _meta_tensor(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, grad: bool) -> torch.Tensor:
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta").requires_grad_(grad)


def _operator(namespace: str, name: str, overload: str | None) -> Any:
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


def _higher_order(name: str) -> Any:
    return getattr(torch.ops.higher_order, name)


def _graph(codegen: Any, nodes: list[tuple[Any, ...]]) -> fx.Graph:
    from torch.fx.node import map_aggregate

    graph = fx.Graph()
    graph._codegen = codegen
    made: dict[str, fx.Node] = {}

    def node_of(arg: Any) -> Any:
        return made[arg.name] if isinstance(arg, _NodeName) else arg

    for name, op, target, args, kwargs, type_expr, meta in nodes:
        node = graph.create_node(
            op, target, map_aggregate(args, node_of), map_aggregate(kwargs, node_of), name=name, type_expr=type_expr
        )
        node.meta = meta
        made[name] = node
    return graph


def _graph_module(attributes: dict[str, Any], graph: fx.Graph, class_name: str) -> fx.GraphModule:
    holder = torch.nn.Module()
    holder.__dict__.update(attributes)
    module = fx.GraphModule(holder, graph, class_name)
    module.__dict__.update(attributes)  # every submodule and tensor it held, the ones no node names included
    return module


def _pipe(split_gm: fx.GraphModule, num_stages: int, has_loss: bool, loss_spec: Any, replicated: Any) -> Pipe:
    from torch.distributed.pipelining._IR import Pipe

    pipe = Pipe(split_gm, num_stages, has_loss, loss_spec)
    pipe.replicated_params = replicated  # the caller's: its constructor already broke those ties
    return pipe


#: GraphModule attributes made again from its graph when it is rebuilt (``forward`` included: the generated one, or
#: the error a Pipe sets on its ``split_gm``, which the Pipe's constructor sets again).
_REGENERATED = ("_graph", "_code", "_lineno_map", "_prologue_start", "forward")


class _SplitPickler(pickle.Pickler):
    """A pickler for torch's ``Pipe``: see the module docstring."""

    def reducer_override(self, obj: Any) -> Any:
        from torch._ops import HigherOrderOperator, OpOverload, OpOverloadPacket
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed.pipelining._IR import Pipe

        if isinstance(obj, FakeTensor):
            return _meta_tensor, (tuple(obj.shape), tuple(obj.stride()), obj.dtype, obj.requires_grad)
        if isinstance(obj, OpOverload):
            namespace, name = obj._schema.name.split("::")
            return _operator, (namespace, name, obj._overloadname)
        if isinstance(obj, OpOverloadPacket):
            namespace, name = obj._qualified_op_name.split("::")
            return _operator, (namespace, name, None)
        if isinstance(obj, HigherOrderOperator):
            return _higher_order, (obj.name(),)
        if isinstance(obj, Pipe):
            held = (obj.split_gm, obj.num_stages, obj.has_loss_and_backward, obj.loss_spec, obj.replicated_params)
            return _pipe, held
        if isinstance(obj, fx.GraphModule):
            attributes = {k: v for k, v in obj.__dict__.items() if k not in _REGENERATED}
            return _graph_module, (attributes, obj.graph, type(obj).__name__)
        if isinstance(obj, fx.Graph):
            nodes = [
                (
                    n.name,
                    n.op,
                    n.target,
                    fx.node.map_arg(n.args, _by_name),
                    fx.node.map_arg(n.kwargs, _by_name),
                    n.type,
                    {k: v for k, v in n.meta.items() if k not in _LEFT_BEHIND},
                )
                for n in obj.nodes
            ]
            return _graph, (obj._codegen, nodes)
        return NotImplemented
