"""The precision a run computes in: ``run(..., precision="fp32" | "bf16-mixed" | "bf16-mixed-zero1")``.

* ``"fp32"`` (and ``None``, the default) — the model's own dtype, as it is.
* ``"bf16-mixed"`` — every stage's forward, and the loss, under ``torch.autocast`` in bfloat16 (on CPU and CUDA
  alike): matrix multiplications and the operators autocast lists compute in bf16, the rest (norms, softmax, the
  loss) in fp32; weights, gradients and the optimizer's state stay fp32 (Micikevicius et al., *Mixed Precision
  Training*, ICLR 2018; bf16 needs no loss scaling). What a stage sends is cast back to the dtype the stage's
  boundary was traced or inferred with (fp32), so the receive buffers are as without autocast; the next stage's
  bf16 operators cast it down again, which gives the values a single process under autocast computes.
* ``"bf16-mixed-zero1"`` — as ``"bf16-mixed"``, with the optimizer's state sharded over the ``D`` replicas of each
  stage: torch's ``ZeroRedundancyOptimizer`` (Rajbhandari et al., *ZeRO*, SC 2020, stage 1) over the replicas'
  process group, built from the optimizer factory's class and settings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["PRECISIONS", "autocast_forward", "autocast_loss", "check_run_precision", "sharded_optimizer"]

#: The precisions a run computes in.
PRECISIONS = ("fp32", "bf16-mixed", "bf16-mixed-zero1")


def check_run_precision(precision: str | None, *, checkpoints: bool = False) -> str | None:
    """``precision`` checked: ``None`` or one of :data:`PRECISIONS`, and not ZeRO-1 in a run that saves or resumes
    checkpoints (``checkpoints``); raises ``ValueError`` naming the valid ones."""
    if precision is not None and precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {list(PRECISIONS)} (or None: the model's own dtype)")
    if precision == "bf16-mixed-zero1" and checkpoints:
        raise ValueError(
            "precision='bf16-mixed-zero1' cannot be combined with checkpoint_dir or resume_from yet: the sharded "
            "optimizer's state is not in the distributed checkpoint; use precision='bf16-mixed' with checkpoints"
        )
    return precision


def mixed(precision: str | None) -> bool:
    """Whether ``precision`` computes under autocast."""
    return precision is not None and precision.startswith("bf16-mixed")


def _float32(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.float() if output.is_floating_point() and output.dtype != torch.float32 else output
    if isinstance(output, tuple):
        return tuple(_float32(t) for t in output)
    if isinstance(output, list):
        return [_float32(t) for t in output]
    if isinstance(output, dict):
        return type(output)((k, _float32(v)) for k, v in output.items())
    return output


def autocast_forward(module: nn.Module, device_type: str) -> nn.Module:
    """Make ``module``'s forward run under ``torch.autocast(device_type, torch.bfloat16)`` and return its floating
    outputs in fp32, in place; return the module."""
    forward = module.forward

    def under_autocast(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return _float32(forward(*args, **kwargs))

    module.forward = under_autocast
    return module


def autocast_loss(loss_fn: Callable[..., torch.Tensor], device_type: str) -> Callable[..., torch.Tensor]:
    """``loss_fn`` run under autocast in bf16 (autocast computes a loss in fp32 where it lists it)."""

    def loss(output: Any, target: Any) -> torch.Tensor:
        with torch.autocast(device_type, dtype=torch.bfloat16):
            return loss_fn(output, target)

    return loss


def sharded_optimizer(
    factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    params: list[nn.Parameter],
    group: ProcessGroup | None,
) -> torch.optim.Optimizer:
    """The optimizer ``factory`` makes, its state sharded over ``group`` (the replicas of a stage) with torch's
    ``ZeroRedundancyOptimizer``; the plain optimizer without a group (one replica: nothing to shard over)."""
    if group is None:
        return factory(params)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    probe = factory([nn.Parameter(torch.zeros(1))])  # its class and settings
    return ZeroRedundancyOptimizer(params, optimizer_class=type(probe), process_group=group, **probe.defaults)
