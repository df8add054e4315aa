"""Every tensor a stage sends is contiguous, whatever the model does: torch's point-to-point ops need it.

gloo's and NCCL's ``isend``/``irecv`` refuse a tensor that is not contiguous ("input tensor
has to be contiguous"), and torch's pipeline stages send what the stage computed and receive
into buffers laid out with the strides they were traced or inferred with. Models hand such
tensors across a cut all the time: OPT's causal mask is an ``expand`` (stride 0), ViT's patch
tokens a transposed view, and a gradient that autograd returns for a stage's input can be any
layout.

Two rules make every transfer well formed:

* :func:`contiguous_boundaries` rewrites a traced ``Pipe`` before its stages are built: a
  stage output that is not contiguous becomes a contiguous copy in the stage's graph (an
  ``aten.clone`` in ``contiguous_format``), and every input a stage receives from another
  stage is traced as contiguous.
  The receive buffers for activations and for gradients, which torch allocates from those
  traced strides, are then contiguous on both sides.
* :func:`send_contiguous` makes a built stage (traced, ``nn.Sequential`` or manual) send a
  contiguous copy of any tensor that is not, forward and backward, and return outputs of their
  own: an output that is a view of another tensor becomes a copy (the zero-bubble schedules
  detach every stage output in place, which a view refuses: "Can't detach views in-place"; a
  traced stage's view is often made inside a submodule it calls, so it is found as it runs). It
  costs one copy where the layout is wrong and nothing where it is right.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from .skips import stage_calls, stage_outputs


def _contiguous_like(val: torch.Tensor) -> torch.Tensor:
    """``val`` (a traced example value, usually a FakeTensor) with contiguous strides."""
    return val.clone(memory_format=torch.contiguous_format)


def contiguous_boundaries(pipe: Any) -> int:
    """Rewrite ``pipe`` (a ``torch.distributed.pipelining.Pipe``) so that every stage output another stage receives is
    contiguous, and every stage input received from another stage is traced as contiguous; return how many outputs
    became contiguous copies (0: the pipe sent contiguous tensors already).

    The last stage's outputs go to the loss, not to a peer, and are left as they are.
    """
    split_gm: fx.GraphModule = pipe.split_gm
    calls = stage_calls(split_gm.graph)
    copies = 0
    for k, call in enumerate(calls):
        sub: fx.GraphModule = getattr(split_gm, str(call.target))
        changed = False
        if k < len(calls) - 1:
            out, outputs, single = stage_outputs(sub)
            replaced = []
            for value in outputs:
                val = value.meta.get("val") if isinstance(value, fx.Node) else None
                if not isinstance(val, torch.Tensor) or val.is_contiguous():
                    replaced.append(value)
                    continue
                with sub.graph.inserting_before(out):
                    copy = sub.graph.call_function(
                        torch.ops.aten.clone.default, (value,), {"memory_format": torch.contiguous_format}
                    )
                copy.meta["val"] = _contiguous_like(val)
                replaced.append(copy)
                copies += 1
                changed = True
            if changed:
                out.args = (replaced[0],) if single else (tuple(replaced),)
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        for placeholder, arg in zip(placeholders, call.args):
            received = isinstance(arg, fx.Node) and arg.op != "placeholder"  # a root input is the caller's tensor
            val = placeholder.meta.get("val")
            if received and isinstance(val, torch.Tensor) and not val.is_contiguous():
                placeholder.meta["val"] = _contiguous_like(val)
                changed = True
        if changed:
            sub.recompile()
    return copies


def _contiguous_sends(ops: list[Any]) -> list[Any]:
    for op in ops:
        tensor = getattr(op, "tensor", None)
        if isinstance(tensor, torch.Tensor) and not tensor.is_contiguous():
            op.tensor = tensor.contiguous()
    return ops


def send_contiguous(stage: Any) -> Any:
    """Make ``stage`` (a torch ``PipelineStage`` or traced ``_PipelineStage``) send a contiguous copy of every
    activation and gradient that is not contiguous, and (a stage that is not the last) return no view; return the
    stage.

    Receives are untouched: their buffers are what the stage reads, and they are allocated
    contiguous (:func:`contiguous_boundaries`, or the shapes the runner infers).
    """
    forward, backward = stage.get_fwd_send_ops, stage.get_bwd_send_ops
    stage.get_fwd_send_ops = lambda chunk: _contiguous_sends(forward(chunk))
    stage.get_bwd_send_ops = lambda chunk: _contiguous_sends(backward(chunk))
    if not stage.is_last:  # the last stage's outputs go to the loss
        module = stage.submod.module if hasattr(stage.submod, "module") else stage.submod  # DDP's, or its own
        module_forward = module.forward
        module.forward = lambda *args, **kwargs: _own(module_forward(*args, **kwargs))
    return stage


def _own(output: Any) -> Any:
    """``output`` (a tensor or a tuple of them) with every view replaced by a copy of its own."""
    if isinstance(output, torch.Tensor):
        return output.clone() if output._is_view() else output
    if isinstance(output, tuple):
        return tuple(_own(t) for t in output)
    return output


__all__ = ["contiguous_boundaries", "send_contiguous"]
