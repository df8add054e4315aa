"""Values that skip stages, carried through the stages between: what torch's traced stages cannot send.

A traced transformer computes some values once, before its first block, and uses them in every
block: a Hugging Face Llama's rotary ``(cos, sin)`` and its causal mask, GPT-2's attention mask.
Cut into three stages or more, torch's ``pipeline()`` sends them from stage 0 straight to stages 2,
3, ...: a skip connection, which its traced stages refuse ("Backward of skip connections not
supported yet") and its multi-stage schedules too ("only supports adjacent-stage communication").

:func:`route_skip_connections` rewrites the traced ``Pipe`` so that every value goes to the next
stage only: each stage in between takes it as one more input and hands it on as one more output
(an ``aten.clone``: not a view, which the zero-bubble schedules could not detach, and a gradient flows back
through it like any other activation). This is what a
hand-written pipeline does when it passes ``(hidden, cos, sin, mask)`` from stage to stage. The
graphs are changed in place before any stage is built, the same way on every rank.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx


def stage_calls(graph: fx.Graph) -> list[fx.Node]:
    """The ``call_module`` nodes of the stages, in stage order."""
    from torch.distributed.pipelining._IR import PP_SUBMOD_PREFIX

    calls = [n for n in graph.nodes if n.op == "call_module" and str(n.target).startswith(PP_SUBMOD_PREFIX)]
    return sorted(calls, key=lambda n: int(str(n.target).rsplit("_", 1)[1]))


def _producer(node: fx.Node, stage_of: dict[fx.Node, int]) -> tuple[int, int] | None:
    """``(stage, output index)`` of a value a stage produced (``node`` a stage call or a ``getitem`` of one)."""
    if node in stage_of:
        return stage_of[node], 0
    if node.op == "call_function" and node.target is operator.getitem and node.args[0] in stage_of:
        return stage_of[node.args[0]], int(node.args[1])  # type: ignore[arg-type, index]
    return None


def stage_outputs(sub: fx.GraphModule) -> tuple[fx.Node, list[Any], bool]:
    """A stage graph's output node, its outputs as a list, and whether it returned one value (not a tuple)."""
    out = next(n for n in sub.graph.nodes if n.op == "output")
    value = out.args[0]
    single = not isinstance(value, (tuple, list))
    return out, [value] if single else list(value), single


def _hand_on(split_gm: fx.GraphModule, call: fx.Node, value: fx.Node, val: Any) -> fx.Node:
    """Make the stage ``call`` take ``value`` (if it does not yet) and return it as a new last output; return the
    outer graph's ``getitem`` of that output."""
    graph = split_gm.graph
    sub: fx.GraphModule = getattr(split_gm, str(call.target))
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if value in call.args:
        ph = placeholders[list(call.args).index(value)]
    else:
        with sub.graph.inserting_after(placeholders[-1]):
            ph = sub.graph.placeholder(f"handed_on_{value.name}")
        ph.meta["val"] = val
        call.args = (*call.args, value)
    out, outputs, single = stage_outputs(sub)
    with sub.graph.inserting_before(out):
        alias = sub.graph.call_function(torch.ops.aten.clone.default, (ph,))
    alias.meta["val"] = val
    out.args = ((*outputs, alias),)
    sub.recompile()
    if single:  # the stage's one output becomes output 0 of a tuple: its users read it through a getitem
        with graph.inserting_after(call):
            first = graph.call_function(operator.getitem, (call, 0))
        call.replace_all_uses_with(first, delete_user_cb=lambda user: user is not first)
        anchor = first
    else:
        anchor = max((u for u in call.users), key=lambda u: list(graph.nodes).index(u))
    with graph.inserting_after(anchor):
        return graph.call_function(operator.getitem, (call, len(outputs)))


def route_skip_connections(pipe: Any) -> int:
    """Rewrite ``pipe`` (a ``torch.distributed.pipelining.Pipe``) so that stage outputs go to the next stage only,
    and every tensor of the model's output leaves the last stage; return how many hand-ons were added (0: the pipe
    had no skip connection).

    torch's schedules give the loss what the last stage returns, so a model output an earlier
    stage computes (T5's ``encoder_last_hidden_state``, made by the encoder) is handed on to the
    last stage too, and the last stage returns the model's output tensors in the model's order.
    """
    split_gm: fx.GraphModule = pipe.split_gm
    calls = stage_calls(split_gm.graph)
    stage_of = {call: s for s, call in enumerate(calls)}
    hops: dict[tuple[fx.Node, int], fx.Node] = {}  # (value, stage) -> the value as that stage hands it on
    added = 0

    def route(value: fx.Node, made: tuple[int, int], to: int) -> fx.Node:
        """``value`` (output ``made[1]`` of stage ``made[0]``) as stage ``to - 1`` hands it on."""
        nonlocal added
        source, index = made
        _, outputs, _ = stage_outputs(getattr(split_gm, str(calls[source].target)))
        val = outputs[index].meta.get("val")
        current = value
        for t in range(source + 1, to):
            if (value, t) not in hops:
                hops[(value, t)] = _hand_on(split_gm, calls[t], current, val)
                added += 1
            current = hops[(value, t)]
        return current

    for k, call in enumerate(calls):
        for arg in list(call.args):
            if not isinstance(arg, fx.Node):
                continue
            made = _producer(arg, stage_of)
            if made is not None and k - made[0] > 1:
                routed = route(arg, made, k)
                call.args = tuple(routed if a is arg else a for a in call.args)
    last = len(calls) - 1
    root_out = next(n for n in split_gm.graph.nodes if n.op == "output")
    many = isinstance(root_out.args[0], (tuple, list))
    for i in range(len(root_out.args[0]) if many else 1):
        leaf = root_out.args[0][i] if many else root_out.args[0]
        if not isinstance(leaf, fx.Node):
            continue
        made = _producer(leaf, stage_of)
        if made is None or made[0] == last:
            continue
        routed = route(leaf, made, last + 1)  # a hand-on can rewrite the output node: read it again
        leaves = list(root_out.args[0]) if many else [root_out.args[0]]
        leaves[i] = routed
        root_out.args = (tuple(leaves),) if many else (leaves[0],)
    if added:
        _last_returns_in_model_order(split_gm, calls[last], root_out)
        split_gm.graph.lint()
        split_gm.recompile()
    return added


def _last_returns_in_model_order(split_gm: fx.GraphModule, call: fx.Node, root_out: fx.Node) -> None:
    """Make the last stage return exactly the model's output tensors in the model's order (its outputs go to the
    loss as a flat tuple, :class:`~pipeswift_lab.runner.stages.outputs.StructuredLoss`)."""
    value = root_out.args[0]
    leaves = list(value) if isinstance(value, (tuple, list)) else [value]
    order = []
    for leaf in leaves:
        if leaf is call:
            order.append(0)
        elif isinstance(leaf, fx.Node) and leaf.target is operator.getitem and leaf.args[0] is call:
            order.append(int(leaf.args[1]))  # type: ignore[arg-type]
        else:
            return  # an output that is not the last stage's (a model input handed back): left as traced
    sub: fx.GraphModule = getattr(split_gm, str(call.target))
    out, outputs, single = stage_outputs(sub)
    if order == list(range(len(outputs))):
        return
    out.args = (tuple(outputs[i] for i in order),)
    sub.recompile()
    graph = split_gm.graph
    with graph.inserting_before(root_out):
        getters = [graph.call_function(operator.getitem, (call, j)) for j in range(len(order))]
    root_out.args = (tuple(getters),) if isinstance(value, (tuple, list)) else (getters[0],)
    for user in list(call.users):
        if user.target is operator.getitem and not user.users:
            graph.erase_node(user)


__all__ = ["route_skip_connections"]
