"""What each layer of a transformer holds, per micro-batch, counted from its shape: the memory columns of
:func:`~pipeswift_lab.profiling.analytic.analytic_profile`.

The saved activations follow Korthikanti et al., *Reducing Activation Recomputation in Large Transformer Models*
(MLSys 2023), §4.1 and Table 2: a GPT block on ``b`` sequences of ``s`` tokens, hidden size ``h``, ``a`` heads, in
bf16 with one-byte dropout masks, saves ``s b h (34 + 5 a s / h)`` bytes: attention ``11 s b h + 5 a s² b``
(``QKV``'s input ``2 sbh``, ``Q`` and ``K`` ``4 sbh``, the softmax ``2 a s² b``, its dropout mask ``a s² b`` and
output ``2 a s² b``, ``V`` ``2 sbh``, the output projection's input ``2 sbh``, its dropout mask ``sbh``), the MLP
``19 sbh`` (the two linears' inputs ``2 sbh`` and ``8 sbh``, GeLU's input ``8 sbh``, the dropout mask ``sbh``) and the
two norms' inputs ``4 sbh``. Generalised here (:func:`saved_tensors`), with ``e`` bytes per element:

* grouped-query attention saves ``Q`` at ``a · d`` and ``K``, ``V`` at ``kv_heads · d`` wide; q/k norms their
  inputs besides;
* flash attention (``attention="flash"``) saves no ``s × s`` tensor: its output and the fp32 log-sum-exp of each
  row (``4 a s b``) instead of the softmax, its mask and its output; without dropout (the default; Llama-style
  models train without) no mask anywhere;
* a gated MLP (SwiGLU, as Megatron-LM fuses it) saves the gate-and-up projection's output ``2 e s b f`` and the
  product ``e s b f`` (GeLU: ``e s b f`` twice); a mixture of experts saves the router's logits, the tokens as
  permuted to their ``top_k`` experts and each expert's tensors for the tokens routed to it (``top_k`` times a
  dense MLP's per token, balanced routing), and the experts' outputs the weighted combination reads;
* a layer counts its *output* (what the next layer saves as its input, allocated here: the measured profiles'
  convention, ``activation_bytes`` being what the layer's forward allocates that its backward still needs), not
  its input, which the previous layer counted.

Each tensor also says whether it is a local shard under tensor parallelism (``tp_activation_bytes``: Korthikanti's
``24 sbh / t`` part, the ``10 sbh`` of norm inputs, linear inputs and masks staying whole) and whether selective
recomputation keeps it (the GEMMs' results and the layer's output, :mod:`pipeswift_lab.core.recompute`); with
sequence parallelism everything a layer saves is a shard or a slice of the sequence
(``sp_activation_bytes = activation_bytes``, Korthikanti's ``34 sbh / t``). Full recomputation keeps the output
alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.transformer_spec import TransformerSpec

__all__ = ["LayerBytes", "Saved", "layer_bytes", "saved_tensors"]

#: Bytes of an fp32 value (norm statistics, the log-sum-exp, the loss's softmax).
FP32 = 4


@dataclass(frozen=True)
class Saved:
    """One tensor a layer's forward keeps for its backward (or keeps under selective recomputation)."""

    name: str
    nbytes: int
    plain: bool = True
    """Saved in a forward without recomputation."""
    kept: bool = False
    """Kept by selective recomputation (a GEMM's result, the layer's output)."""
    tp: bool = False
    """A local shard under tensor parallelism (without sequence parallelism)."""


def saved_tensors(
    spec: TransformerSpec, micro_batch: int, *, attention: str = "flash", dropout: bool = False, element_bytes: int = 2
) -> list[Saved]:
    """The tensors one block of ``spec`` saves on ``micro_batch`` sequences, ``element_bytes`` per element
    (the module docs derive them). Returns a list of :class:`Saved`."""
    e, T, h, f = element_bytes, micro_batch * spec.seq_len, spec.hidden, spec.ffn_
    hq, hkv, a, s, b = spec.q_width, spec.kv_width, spec.heads, spec.seq_len, micro_batch
    stats = T * FP32 * (1 if spec.rms_norm else 2)  # RMSNorm keeps 1/rms, LayerNorm the mean too
    mask = T * h if dropout else 0
    out = [
        Saved("output", e * T * h, kept=True),
        Saved("norm_attention_out", e * T * h + stats),
        Saved("qkv", e * T * (hq + 2 * hkv), kept=True, tp=True),
    ]
    if spec.qk_norm:
        out.append(Saved("qk_norm_in", e * T * (hq + hkv) + FP32 * T * (a + spec.kv_heads_), tp=True))
    if attention == "flash":
        out.append(Saved("attention_out", e * T * hq + FP32 * T * a, tp=True))
    else:
        scores = a * s * s * b
        out.append(Saved("softmax", e * scores, tp=True))
        if dropout:
            out += [Saved("softmax_dropout_mask", scores, tp=True), Saved("softmax_dropout", e * scores, tp=True)]
        out.append(Saved("attention_out", e * T * hq, tp=True))
    out += [
        Saved("attention_proj", e * T * h, plain=False, kept=True),
        Saved("attention_dropout_mask", mask),
        Saved("residual", e * T * h + stats),
        Saved("norm_mlp_out", e * T * h),
    ]
    routed = T * spec.top_k_ if spec.experts is not None else T
    if spec.experts is not None:
        E = spec.experts
        out += [
            Saved("router_logits", (e + FP32) * T * E, kept=True),
            Saved("permuted", e * routed * h),
        ]
    up = 2 * f if spec.gated_mlp else f
    out += [
        Saved("mlp_up", e * routed * up, kept=True, tp=True),
        Saved("mlp_act", e * routed * f, tp=True),
        Saved("mlp_down", e * routed * h, plain=spec.experts is not None, kept=True, tp=spec.experts is not None),
        Saved("mlp_dropout_mask", mask),
    ]
    return [item for item in out if item.nbytes > 0]


@dataclass(frozen=True, kw_only=True)
class LayerBytes:
    """The byte (and parameter) columns of one layer, per micro-batch (:func:`layer_bytes`)."""

    params: int
    param_bytes: int
    largest_param_bytes: int
    tp_param_bytes: int
    activation_bytes: int
    output_bytes: int
    tp_activation_bytes: int
    sp_activation_bytes: int
    full_activation_bytes: int
    selective_activation_bytes: int
    weight_pass_bytes: int
    full_weight_pass_bytes: int
    selective_weight_pass_bytes: int
    transient_bytes: int
    accumulate_transient_bytes: int
    full_transient_bytes: int
    selective_transient_bytes: int
    tp_forward_bytes: int
    tp_backward_bytes: int


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
        saved = [Saved("output", e * T * h, kept=True)] + ([Saved("dropout_mask", T * h)] if dropout else [])
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
    saved = [Saved("norm_out", e * T * h + stats), Saved("logits", e * T * V, kept=True, tp=True)]
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
        saved=saved_tensors(spec, b, attention=attention, dropout=dropout, element_bytes=e),
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
    weight_bytes: int,
    largest: int,
    tp_params: int,
    saved: list[Saved],
    output: int,
    weight_pass: int,
    recomputed_for_w: int,
    grads: int,
    temp: int,
    tp_forward: int,
    tp_backward: int,
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
