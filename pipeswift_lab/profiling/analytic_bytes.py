"""What each layer of a transformer holds, per micro-batch, counted from its shape: the memory columns of
:func:`~pipeswift_lab.profiling.analytic.analytic_profile`.

A block's saved activations are :func:`~pipeswift_lab.core.transformer_activations.saved_tensors`', the same list
:func:`~pipeswift_lab.transformer_memory` sums (Korthikanti et al., *Reducing Activation Recomputation in Large
Transformer Models*, MLSys 2023, §4.1 and Table 2, generalised to grouped-query attention, gated MLPs and mixtures of
experts), with Megatron-LM's fused kernels and one-byte dropout masks. A block counts its input the way a measured
profile counts its output (the same bytes: what the next layer saves as its input). ``tp_activation_bytes`` is what
divides under tensor parallelism (the regions' tensors; Korthikanti's ``24 sbh / t`` and ``5 as²b / t``, the ``10
sbh`` of norm inputs, linear inputs and masks staying whole); with sequence parallelism everything a layer saves is
a shard or a slice of the sequence (``sp_activation_bytes = activation_bytes``, Korthikanti's ``34 sbh / t``). The
toolkit's selective recomputation keeps the GEMMs' results and the layer's input
(:attr:`~pipeswift_lab.core.transformer_activations.Saved.kept`, :mod:`pipeswift_lab.core.recompute`); full
recomputation keeps the input alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.transformer_activations import Saved, saved_tensors
from ..core.transformer_spec import TransformerSpec

__all__ = ["LayerBytes", "layer_bytes"]

#: Bytes of an fp32 value (norm statistics, the log-sum-exp, the loss's softmax).
FP32 = 4


@dataclass(frozen=True, kw_only=True)
class LayerBytes:
    """The byte (and parameter) columns of one layer, per micro-batch (:func:`layer_bytes`)."""

    params: int
    param_bytes: float
    largest_param_bytes: float
    tp_param_bytes: float
    activation_bytes: float
    output_bytes: float
    tp_activation_bytes: float
    sp_activation_bytes: float
    full_activation_bytes: float
    selective_activation_bytes: float
    weight_pass_bytes: float
    full_weight_pass_bytes: float
    selective_weight_pass_bytes: float
    transient_bytes: float
    accumulate_transient_bytes: float
    full_transient_bytes: float
    selective_transient_bytes: float
    tp_forward_bytes: float
    tp_backward_bytes: float


def layer_bytes(
    kind: str,
    spec: TransformerSpec,
    micro_batch: int,
    *,
    attention: str = "flash",
    dropout: bool = False,
    element_bytes: int = 2,
    weight_bytes: int = 2,
) -> LayerBytes:
    """The memory columns of one layer of ``spec`` (``kind``: ``"embedding"``, ``"block"`` or ``"head"``) on
    ``micro_batch`` sequences: activations ``element_bytes`` per element, weights and their gradients
    ``weight_bytes`` per parameter. Returns a :class:`LayerBytes`."""
    e, T, h, V = element_bytes, micro_batch * spec.seq_len, spec.hidden, spec.vocab
    if kind == "block":
        return _block(spec, micro_batch, attention, dropout, e, weight_bytes)
    if kind == "embedding":
        params = spec.embedding_params()
        saved = [Saved("output", e * T * h, "outside", kept=True)]
        saved += [Saved("dropout_mask", T * h, "outside")] if dropout else []
        return _assemble(
            params=params,
            weight_bytes=weight_bytes,
            largest=weight_bytes * V * h,
            tp_params=V * h,
            saved=saved,
            output=e * T * h,
            weight_pass=0,
            recomputed_for_w=0,
            grads=weight_bytes * params,
            temp=e * T * h,
            tp_forward=e * T * h,  # the vocabulary-parallel lookup's all-reduce
            tp_backward=0,
        )
    if kind != "head":
        raise ValueError(f"kind={kind!r} is not 'embedding', 'block' or 'head'")
    params = spec.head_params()
    stats = T * FP32 * (1 if spec.rms_norm else 2)
    saved = [Saved("norm_out", e * T * h + stats, "outside"), Saved("logits", e * T * V, "inside", kept=True)]
    return _assemble(
        params=params,
        weight_bytes=weight_bytes,
        largest=weight_bytes * (h if spec.tied else V * h),
        tp_params=0 if spec.tied else V * h,
        saved=saved,
        output=e * T * V,
        weight_pass=e * T * (V + h),
        recomputed_for_w=e * T * h,
        grads=weight_bytes * V * h,  # the projection's gradient, a temporary of the shared table when tied
        temp=2 * e * T * h,
        tp_forward=3 * FP32 * T,  # vocabulary-parallel cross-entropy: the max, the sum and the target's logit
        tp_backward=e * T * h,
    )


def _block(spec: TransformerSpec, b: int, attention: str, dropout: bool, e: int, weight_bytes: int) -> LayerBytes:
    """:func:`layer_bytes` of one block."""
    T, h, f, hq, hkv = b * spec.seq_len, spec.hidden, spec.ffn_, spec.q_width, spec.kv_width
    up = 2 * f if spec.gated_mlp else f
    routed = T * spec.top_k_
    experts = spec.experts or 1
    projections = 3 if spec.gated_mlp else 2
    attention_tp = h * (hq + 2 * hkv) + hq * h + ((hq + 2 * hkv) if spec.bias else 0)
    mlp_tp = experts * (projections * h * f + ((projections - 1) * f if spec.bias else 0))
    # what the input-gradient pass keeps for the weight pass: the gradients at every linear's and norm's output
    weight_pass = e * (T * (hq + 2 * hkv) + T * h + routed * (up + h) + 2 * T * h + T * (spec.experts or 0))
    recomputed_for_w = e * (2 * T * h + T * hq + routed * f)  # the linears' inputs selective recomputation rebuilds
    mlp_temp = e * routed * (up + f) + 2 * e * T * h
    if attention == "flash":
        attention_temp = e * T * (hq + 2 * hkv) + FP32 * T * hq + 2 * e * T * h
    else:
        attention_temp = 2 * e * spec.heads * spec.seq_len * spec.seq_len * b + 2 * e * T * h
    return _assemble(
        params=spec.layer_params(),
        weight_bytes=weight_bytes,
        largest=weight_bytes * max(h * (hq + 2 * hkv), hq * h, h * up, f * h),
        tp_params=attention_tp + mlp_tp,
        saved=saved_tensors(spec, b, dtype_bytes=e, dropout=dropout, attention=attention),
        output=e * T * h,
        weight_pass=weight_pass,
        recomputed_for_w=recomputed_for_w,
        grads=weight_bytes * spec.layer_params(),
        temp=max(mlp_temp, attention_temp),
        tp_forward=2 * e * T * h,  # the output projection's and the MLP's all-reduce
        tp_backward=2 * e * T * h,  # the QKV projection's and the MLP's input gradients
    )


def _assemble(
    *,
    params: int,
    weight_bytes: float,
    largest: float,
    tp_params: float,
    saved: list[Saved],
    output: float,
    weight_pass: float,
    recomputed_for_w: float,
    grads: float,
    temp: float,
    tp_forward: float,
    tp_backward: float,
) -> LayerBytes:
    """The :class:`LayerBytes` of a layer from what it saves and its backward's temporaries ``temp`` (beyond its
    weight gradients ``grads``)."""
    activation = sum(item.nbytes for item in saved if item.plain)
    selective = sum(item.nbytes for item in saved if item.kept)
    full = output  # full recomputation keeps the output alone (the next layer's input)
    accumulate = largest + temp  # adding to existing gradients: one weight's temporary at a time
    return LayerBytes(
        params=params,
        param_bytes=weight_bytes * params,
        largest_param_bytes=largest,
        tp_param_bytes=weight_bytes * tp_params,
        activation_bytes=activation,
        output_bytes=output,
        tp_activation_bytes=sum(item.nbytes for item in saved if item.plain and item.tp),
        sp_activation_bytes=activation,
        full_activation_bytes=full,
        selective_activation_bytes=selective,
        weight_pass_bytes=weight_pass,
        full_weight_pass_bytes=weight_pass,
        selective_weight_pass_bytes=weight_pass + recomputed_for_w,
        transient_bytes=grads + temp,
        accumulate_transient_bytes=accumulate,
        full_transient_bytes=accumulate + max(0, activation - full),
        selective_transient_bytes=accumulate + max(0, activation - selective),
        tp_forward_bytes=tp_forward,
        tp_backward_bytes=tp_backward,
    )
