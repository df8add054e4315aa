"""A profile of a transformer on a GPU you do not have: :func:`analytic_profile`, a :class:`Profile` computed from a
:class:`~pipeswift_lab.TransformerSpec` and a :class:`~pipeswift_lab.Hardware` instead of measured.

One row per layer, as :func:`~pipeswift_lab.profile` measures a model cut into ``embed``, ``block_0`` …
``block_{L-1}`` and ``head`` (the final norm and the projection to the vocabulary; the loss's time is in the head's
row, on the last stage where it runs, and its memory in ``meta`` as a measured profile keeps it)::

    import pipeswift_lab as psl
    spec = psl.TransformerSpec.from_config(llama_config, seq_len=4096)
    prof = psl.analytic_profile(spec, psl.hardware.H100_SXM, micro_batch=1)
    psl.plan(prof, gpus=64, global_batch=512, steps=10_000, topology=psl.hardware.H100_SXM.topology(),
             mem_per_gpu_bytes=psl.hardware.H100_SXM.hbm_bytes, precision="bf16-mixed", sequence_parallel=True)

Times come from :mod:`.analytic_time` (a roofline with a GEMM-shape efficiency curve; the backward split into input
and weight gradients, ``wgrad_ms``; recomputation priced as the operators it runs again), bytes from
:mod:`.analytic_bytes` (Korthikanti et al.'s per-layer activations, generalised). The columns are a measured
profile's (:data:`~pipeswift_lab.profiling.table.COLUMNS`, ``wgrad_ms``, the memory columns, the recompute columns
of ``profile(..., recompute=True)``, the zero-bubble weight-pass bytes) and, with ``tp_plan=True``, the
tensor-parallel columns of Megatron-LM's plan (Shoeybi et al., 2019): column-parallel QKV and up projections,
row-parallel output and down projections, attention by heads, vocabulary-parallel embedding, projection and
cross-entropy, sequence parallelism allowed. ``meta["tp_divides"]`` holds what ``tp`` must divide: the attention
heads, the key/value heads and the MLP's inner size (the vocabulary is padded to a multiple of ``tp``, as Megatron-LM
pads it, which the byte counts neglect). Everything is at ``tp = 1``; the planner divides it
(:mod:`pipeswift_lab.planning.sharding`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..core.checks import check_choice, check_flag, check_int
from ..core.hardware import Hardware, check_hardware
from ..core.precision import PRECISIONS, check_precision
from ..core.transformer_spec import TransformerSpec
from .analytic_bytes import FP32, LayerBytes, layer_bytes
from .analytic_time import (
    ATTENTIONS,
    FLASH_BACKWARD_EFFICIENCY,
    FLASH_BACKWARD_FLOPS,
    KERNEL_OVERHEAD_MS,
    TILE_K,
    TILE_M,
    TILE_N,
    OpTime,
    layer_ops,
)
from .table import Profile

__all__ = ["ANALYTIC_PRECISIONS", "analytic_profile", "layer_row", "tp_divides"]

#: The precisions an analytic profile times: ``{name: bytes per activation element}``. Both compute in bf16 on the
#: tensor cores (the Hardware's ``peak_flops``); they differ in the optimizer state the planner counts.
ANALYTIC_PRECISIONS = {"bf16-mixed": 2, "bf16-mixed-zero1": 2}
#: Bytes of one token id (int64), of the inputs and of the targets.
TOKEN_BYTES = 8


def analytic_profile(
    spec: TransformerSpec,
    hardware: Hardware | str,
    micro_batch: int = 1,
    *,
    precision: str = "bf16-mixed",
    tp_plan: bool = True,
    attention: str = "flash",
    dropout: bool = False,
) -> Profile:
    """The :class:`~pipeswift_lab.Profile` of ``spec`` training on ``hardware`` (a :class:`~pipeswift_lab.Hardware`
    or the name of one of :data:`pipeswift_lab.core.hardware.DEVICES`) at ``micro_batch`` sequences of
    ``spec.seq_len`` tokens, computed (the module docs say how): one row per layer with the columns a measured profile
    has, and its ``meta`` (``batch_size``, ``device="cuda"``, ``hardware``, ``dtype``, ``precision``, the loss's and
    the batch's bytes, ``tp_divides``, ``sequence_parallel``). ``partition``, ``simulate``, ``sweep`` and ``plan``
    take it as they take a measured one.

    * ``precision`` — one of :data:`ANALYTIC_PRECISIONS` (bf16 weights, gradients and activations; give the same to
      :func:`~pipeswift_lab.plan`);
    * ``tp_plan`` — add the tensor-parallel columns and ``meta["tp_divides"]`` (False: a profile that admits
      ``tp = 1`` only);
    * ``attention`` — ``"flash"`` (fused; no ``s × s`` tensor is saved) or ``"eager"`` (the scores written out, as
      Korthikanti et al. count them);
    * ``dropout`` — the blocks apply dropout (GPT's; one-byte masks saved, their kernels timed).

    Raises ``TypeError`` for a ``spec`` that is not a TransformerSpec and ``ValueError`` naming the argument for an
    unknown precision or attention, a micro-batch below 1, or a ``hardware`` without the numbers the time model needs
    (``peak_flops``, ``hbm_bandwidth``).
    """
    if not isinstance(spec, TransformerSpec):
        raise TypeError(f"spec must be a pipeswift_lab.TransformerSpec; got {type(spec).__name__}")
    hardware = check_hardware(hardware)
    hardware.require("peak_flops", "hbm_bandwidth", purpose="analytic_profile's time model")
    micro_batch = check_int("micro_batch", micro_batch, minimum=1)
    element_bytes = _element_bytes(precision)
    attention = check_choice("attention", attention, ATTENTIONS, noun="attention kernels")
    tp_plan, dropout = check_flag("tp_plan", tp_plan), check_flag("dropout", dropout)
    e = element_bytes
    rows: dict[str, dict[str, Any]] = {}
    for kind in ("embedding", "block", "head"):  # every block is the same
        rows[kind] = layer_row(kind, spec, micro_batch, hardware, attention=attention, dropout=dropout, element_bytes=e)
    names = ["embed", *(f"block_{i}" for i in range(spec.layers)), "head"]
    kinds = ["embedding", *(["block"] * spec.layers), "head"]
    columns: dict[str, list[Any]] = {"name": names, "type": kinds}
    for key in rows["block"]:
        if not tp_plan and key.startswith(("tp_", "sp_")):
            continue
        columns[key] = [rows[kind][key] for kind in kinds]
    outputs = columns["output_bytes"]
    columns["cut_bytes"] = [0] + outputs[:-1]  # a cut before a layer sends the previous one's output, nothing else
    columns["cut_grad_bytes"] = [0] + outputs[:-1]
    columns["cut_freed_bytes"] = [0] * len(names)
    fwd, bwd = columns.pop("fwd_ms"), columns.pop("bwd_ms")
    meta = _meta(spec, hardware, micro_batch, precision, element_bytes, tp_plan, attention, dropout)
    return Profile.synthetic(fwd, bwd, meta=meta, **columns)


def layer_row(
    kind: str,
    spec: TransformerSpec,
    micro_batch: int,
    hardware: Hardware,
    *,
    attention: str = "flash",
    dropout: bool = False,
    element_bytes: int = 2,
) -> dict[str, Any]:
    """The columns of one layer (``kind``: ``"embedding"``, ``"block"`` or ``"head"``) of ``spec`` on ``hardware``,
    per micro-batch of ``micro_batch`` sequences: its times (:mod:`.analytic_time`), bytes (:mod:`.analytic_bytes`)
    and tensor-parallel columns, at ``tp = 1``. Returns ``{column: value}``."""
    e = element_bytes
    ops = layer_ops(kind, spec, micro_batch, hardware, attention=attention, dropout=dropout, element_bytes=e)
    nbytes = layer_bytes(kind, spec, micro_batch, attention=attention, dropout=dropout, element_bytes=e)
    return {**_times(ops), **_bytes(nbytes), "tp_flop_fraction": _tp_fraction(ops)}


def _times(ops: list[OpTime]) -> dict[str, float]:
    """The time columns of a layer of ``ops``: forward, backward (input and weight gradients) and what each
    recomputation runs again; the checkpointed forward costs nothing more on a GPU (0)."""
    return {
        "fwd_ms": sum(op.fwd_ms for op in ops),
        "bwd_ms": sum(op.bwd_ms for op in ops),
        "wgrad_ms": sum(op.wgrad_ms for op in ops),
        "fwd_ms_iqr": 0.0,
        "bwd_ms_iqr": 0.0,
        "recompute_ms": sum(op.fwd_ms for op in ops if op.full),
        "selective_recompute_ms": sum(op.fwd_ms for op in ops if op.selective),
        "recompute_forward_ms": 0.0,
        "selective_recompute_forward_ms": 0.0,
    }


def _tp_fraction(ops: list[OpTime]) -> float:
    """The share of a layer's time (forward and backward) in operators tensor parallelism divides: what
    :mod:`pipeswift_lab.planning.sharding` divides by ``tp`` (measured profiles take the share of the forward's
    FLOPs)."""
    total = sum(op.fwd_ms + op.bwd_ms for op in ops)
    sharded = sum(op.fwd_ms + op.bwd_ms for op in ops if op.tp)
    return min(1.0, sharded / total) if total > 0 else 0.0


def _bytes(nbytes: LayerBytes) -> dict[str, Any]:
    """The byte and parameter columns of a layer, and its peak (NaN: not measured)."""
    out: dict[str, Any] = dataclasses.asdict(nbytes)
    out["peak_bytes"] = float("nan")
    out["tp_duplicated_bytes"] = 0
    return out


def _element_bytes(precision: Any) -> int:
    """Bytes per activation element of ``precision``; ``ValueError`` naming it for an unknown or untimed one."""
    name = check_precision(precision)
    if name not in ANALYTIC_PRECISIONS:
        raise ValueError(
            f"precision={precision!r} has no analytic time model: the Hardware's peak_flops is bf16 tensor-core "
            f"throughput; give one of {sorted(ANALYTIC_PRECISIONS)}"
        )
    assert PRECISIONS[name].weight_bytes == ANALYTIC_PRECISIONS[name]
    return ANALYTIC_PRECISIONS[name]


def tp_divides(spec: TransformerSpec) -> list[int]:
    """The sizes a tensor-parallel degree must divide under Megatron-LM's plan: the attention heads, the key/value
    heads and the MLP's inner size (per expert; the experts are not cut). Returns them sorted, distinct."""
    return sorted({spec.heads, spec.kv_heads_, spec.ffn_})


def _meta(
    spec: TransformerSpec,
    hardware: Hardware,
    micro_batch: int,
    precision: str,
    element_bytes: int,
    tp_plan: bool,
    attention: str,
    dropout: bool,
) -> dict[str, Any]:
    """A profile's ``meta``: what a measured one holds (device, dtype, batch, the loss's and the batch's bytes) and
    what the analytic one was computed from."""
    T, V = micro_batch * spec.seq_len, spec.vocab
    meta: dict[str, Any] = {
        "model": f"{spec.name or 'transformer'} on {hardware.name}",
        "source": "analytic",
        "device": "cuda",  # the device type the planner reads (foreach optimizer, its memory bandwidth)
        "hardware": hardware.name,
        "dtype": "bfloat16",
        "precision": precision,
        "batch_size": micro_batch,
        "batch_shape": [micro_batch, spec.seq_len],
        "model_params": spec.params(),
        "input_bytes": TOKEN_BYTES * T,
        "target_bytes": TOKEN_BYTES * T,
        # the loss keeps the fp32 softmax of the logits; its backward writes their fp32 gradient and its bf16 cast
        "loss_activation_bytes": float(FP32 * T * V),
        "loss_transient_bytes": float((FP32 + element_bytes) * T * V),
        "loss_retained_bytes": float(FP32),
        "loss_vocab_parallel": tp_plan,  # Megatron-LM's cross-entropy: each TP rank holds its vocabulary slice
        "spec": dataclasses.asdict(spec),
        "hardware_numbers": hardware.as_dict(),
        "attention": attention,
        "dropout": dropout,
        "time_model": {
            "tile_m": TILE_M,
            "tile_n": TILE_N,
            "tile_k": TILE_K,
            "kernel_overhead_ms": KERNEL_OVERHEAD_MS,
            "flash_backward_flops": FLASH_BACKWARD_FLOPS,
            "flash_backward_efficiency": FLASH_BACKWARD_EFFICIENCY,
        },
    }
    if tp_plan:
        meta.update(
            tp_plan="megatron (column-parallel QKV and up projections, row-parallel output and down projections, "
            "vocabulary-parallel embedding and head)",
            tp_divides=tp_divides(spec),
            sequence_parallel=True,
        )
    return meta
