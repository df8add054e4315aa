"""Memory per GPU of a transformer trained with tensor, pipeline and data parallelism, from its shape alone.

:func:`transformer_memory` counts what the first pipeline rank holds at its peak (the busiest one under 1F1B):
weights, gradients and optimizer state as Megatron-LM's ``megatron/training/theoretical_memory_usage.py`` counts
them, and activations as Korthikanti et al., *Reducing Activation Recomputation in Large Transformer Models*
(MLSys 2023, arXiv 2205.05198) count them: Table 2 per layer, §4.2.3 for the pipeline, §4.3 for the embedding and
the output layer. :func:`layer_activation_bytes` is one layer's activations for one micro-batch.

One layer's activations are :func:`~pipeswift_lab.core.transformer_activations.saved_tensors`' (the derivation,
term by term, for grouped-query attention, gated MLPs and mixtures of experts): what lies outside the
tensor-parallel regions stays whole on every TP rank unless ``sequence_parallel`` slices it, the rest divides by
``t``; Korthikanti's selective recomputation drops attention's core; full recomputation keeps the layer's input,
``e·sbh`` (``/ t`` with SP). For GPT that is Table 2: ``sbh(34 + 5as/h)``, ``sbh(10 + 24/t + 5as/(ht))`` with TP,
``sbh/t·(34 + 5as/h)`` with SP, ``sbh(10 + 24/t)`` and ``34·sbh/t`` selective.

The first stage holds ``p`` micro-batches of its ``L/p`` layers once 1F1B is warm: ``L`` layers' worth whatever
``p`` (§4.2.3), times ``1 + (p-1)/(pv)`` interleaved; :func:`~pipeswift_lab.core.analytic.inflight_microbatches`
gives the count for every schedule. §4.3 adds the embedding's dropout mask ``d·sbh`` per micro-batch in flight
(``/ t`` with SP) and, with ``p = 1`` only (the last stage is another rank otherwise), the final norm's and the
output projection's inputs ``2e·sbh`` (``/ t`` with SP) and the fp32 logits ``4·sbV/t``: ``4sbh/t·(1 + V/h)``.
Megatron-LM also counts the int64 token ids, ``8·sbp``, which the paper does not (left out here). Beyond the paper,
the layer whose backward runs holds what it recomputes: ``recompute_working_set``.

Measured (``tests/core/test_transformer_memory.py``): in fp32 (``dtype_bytes=4``) :func:`layer_activation_bytes`
is within 0.4% of the ``activation_bytes`` :func:`~pipeswift_lab.profile` measures per layer for ``psl.models.gpt``
(flash), GPT-2 (eager, dropout: the CPU's dropout keeps 4-byte masks, ``mask_bytes=4``), Llama, Qwen3 and Mixtral
(eager, ``kernels="pytorch"``). Hugging Face's SDPA path, as ``torch.export`` captures it for the pipeline, keeps
more than ``attention="flash"`` counts: grouped keys and values repeated to the query heads and a float ``b·s²``
causal mask in every layer.
"""

from __future__ import annotations

import numbers
from typing import Any

from .analytic import inflight_microbatches
from .checks import check_choice, check_flag, check_int, check_time
from .transformer_activations import saved_tensors
from .transformer_spec import TransformerSpec
from .vocabulary import SINGLE_CHUNK_SCHEDULES, canonical_schedule

__all__ = ["MEGATRON_BYTES_PER_PARAM", "layer_activation_bytes", "transformer_memory"]

#: Megatron-LM's bytes per parameter, ``(weights, gradients, optimizer)``: bf16 weights, fp32 main gradients, and an
#: fp32 master copy with Adam's two fp32 moments (4 + 8): 18 in all (``theoretical_memory_usage.py``).
MEGATRON_BYTES_PER_PARAM: tuple[float, float, float] = (2.0, 4.0, 12.0)
_RECOMPUTE = ("none", "selective", "full")


def _check_recompute(recompute: str | None) -> str:
    if recompute is None:
        return "none"
    return check_choice("recompute", recompute, _RECOMPUTE, noun="modes", hint=" or None")


def _check_tp(spec: TransformerSpec, tp: int, sequence_parallel: bool) -> int:
    tp = check_int("tp", tp, minimum=1)
    for name, size in (("heads", spec.heads), ("kv_heads", spec.kv_heads_), ("ffn", spec.ffn_)):
        if size % tp:
            raise ValueError(f"tp={tp} does not divide {name}={size}: tensor parallelism splits them evenly")
    if check_flag("sequence_parallel", sequence_parallel) and spec.seq_len % tp:
        raise ValueError(f"sequence_parallel splits seq_len={spec.seq_len} over tp={tp}, which does not divide it")
    return tp


def layer_activation_bytes(
    spec: TransformerSpec,
    micro_batch: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str | None = None,
    dtype_bytes: float = 2,
    dropout: bool = True,
    mask_bytes: float = 1,
    attention: str = "eager",
    kernels: str = "fused",
) -> float:
    """Bytes one transformer layer keeps for its backward per micro-batch on one tensor-parallel rank: Table 2 of
    Korthikanti et al. 2022 generalized to grouped-query attention, gated MLPs and mixtures of experts: the sum of
    :func:`~pipeswift_lab.core.transformer_activations.saved_tensors`, which derives it term by term.

    ``recompute``: ``None``, ``"selective"`` (the attention core is recomputed) or ``"full"`` (only the layer's input
    is kept). ``dtype_bytes``: bytes of an activation element (2 in bf16, the paper's; 4 in fp32). ``dropout``: the
    layer's dropouts keep masks of ``mask_bytes`` per element (CUDA's fused dropout keeps a 1-byte mask, the CPU's
    dropout a mask of the activations' dtype). ``attention``: ``"eager"`` (scores materialized, the paper's) or
    ``"flash"``. ``kernels``: ``"fused"`` (Megatron-LM's) or ``"pytorch"`` (an RMSNorm in PyTorch ops keeps its
    normalized input too, a SwiGLU its activation's output).
    """
    b = check_int("micro_batch", micro_batch, minimum=1)
    tp = _check_tp(spec, tp, sequence_parallel)
    mode = _check_recompute(recompute)
    saved = saved_tensors(
        spec, b, dtype_bytes=dtype_bytes, dropout=dropout, mask_bytes=mask_bytes, attention=attention, kernels=kernels
    )
    if mode == "full":
        return dtype_bytes * spec.seq_len * b * spec.hidden / (tp if sequence_parallel else 1)
    return sum(
        item.nbytes / (tp if item.tp or sequence_parallel else 1)
        for item in saved
        if item.plain and not (mode == "selective" and item.region == "core")
    )


# -- parameters -------------------------------------------------------------------------------------------------------
def _layer_params_per_gpu(spec: TransformerSpec, tp: int, ep: int) -> float:
    """One layer's parameters on one GPU: the projections split by ``tp`` (experts also by ``ep``), norms, row-parallel
    biases and the router whole."""
    h, q, k, f = spec.hidden, spec.q_width, spec.kv_width, spec.ffn_
    attention_split = h * (q + 2 * k) + q * h + (q + 2 * k if spec.bias else 0)
    attention_whole = spec.attention_params() - attention_split
    projections = 3 if spec.gated_mlp else 2
    mlp_split = projections * h * f + ((projections - 1) * f if spec.bias else 0)
    if spec.experts is None:
        mlp = mlp_split / tp + (spec.expert_params() - mlp_split)
    else:
        experts = spec.experts * spec.expert_params()
        mlp = experts / (tp * ep) + (spec.mlp_params() - experts)
    return attention_split / tp + attention_whole + mlp + 2 * spec.norm_params()


def _embedding_params_per_gpu(spec: TransformerSpec, tp: int, pp: int) -> float:
    """The first rank's embedding (the vocabulary split by ``tp``, learned positions whole) and, with ``pp == 1``,
    the final norm and the untied output projection (the last stage's otherwise, which holds its own copy of a tied
    embedding there)."""
    h, V = spec.hidden, spec.vocab
    params = V * h / tp + spec.position_params()
    if pp == 1:
        params += spec.norm_params() + (0 if spec.tied else V * h / tp)
    return params


def _bytes_split(bytes_per_param: Any) -> tuple[float, float, float]:
    if bytes_per_param is None:
        return MEGATRON_BYTES_PER_PARAM
    if isinstance(bytes_per_param, tuple):
        if len(bytes_per_param) != 3:
            raise ValueError(f"bytes_per_param={bytes_per_param!r}: a tuple is (weights, gradients, optimizer)")
        w, g, o = (check_time(f"bytes_per_param[{i}]", x) for i, x in enumerate(bytes_per_param))
        return w, g, o
    if isinstance(bytes_per_param, bool) or not isinstance(bytes_per_param, numbers.Real):
        raise TypeError(f"bytes_per_param must be None, a number or a 3-tuple; got {bytes_per_param!r}")
    total = check_time("bytes_per_param", bytes_per_param)
    if total < 6:
        raise ValueError(
            f"bytes_per_param={total} is below Megatron's 2-byte weights and 4-byte gradients; give a tuple "
            "(weights, gradients, optimizer) for another split"
        )
    return 2.0, 4.0, total - 6.0


# -- the whole rank ---------------------------------------------------------------------------------------------------
def transformer_memory(
    spec: TransformerSpec,
    micro_batch: int,
    *,
    tp: int = 1,
    pp: int = 1,
    v: int = 1,
    dp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = False,
    recompute: str | None = None,
    bytes_per_param: float | tuple[float, float, float] | None = None,
    distributed_optimizer: bool = False,
    microbatches: int | None = None,
    schedule: str | None = None,
    dtype_bytes: float = 2,
    dropout: bool = True,
    mask_bytes: float = 1,
    attention: str = "eager",
    kernels: str = "fused",
) -> dict[str, float]:
    """Bytes per GPU on the first pipeline rank at its peak; a dict of floats.

    ``tp``, ``pp``, ``dp`` and ``ep`` are the tensor-, pipeline-, data- and expert-parallel sizes, ``v`` the chunks
    per pipeline rank (interleaved); ``sequence_parallel`` and ``recompute`` (``None``, ``"selective"``, ``"full"``)
    as in Korthikanti et al. 2022. ``bytes_per_param``: ``None`` for Megatron-LM's 18 (bf16 weights 2, fp32 gradients
    4, fp32 master weights and Adam moments 12); a ``(weights, gradients, optimizer)`` tuple; or a number, its first 6
    bytes Megatron's weights and gradients. ``distributed_optimizer`` shards the optimizer part over ``dp`` (Megatron's
    ``6 + 12/dp``). ``schedule`` (default ``"1F1B"``, ``"Interleaved1F1B"`` with ``v > 1``) and ``microbatches``
    (default ``pp``, ``2·pp`` for the multi-chunk schedules: enough to reach their warm count) set the micro-batches
    in flight on the first rank (GPipe holds them all).
    ``dtype_bytes``, ``dropout``, ``mask_bytes``, ``attention`` and ``kernels`` as in :func:`layer_activation_bytes`.

    Keys (bytes): ``parameters_and_optimizer`` (the first rank's ``⌈layers/pp⌉`` transformer layers, the most any
    rank holds where ``pp`` does not divide them, as Llama 3's 126 layers on 16 stages: their weights,
    gradients and optimizer state), ``embedding`` (the same of its embedding, plus the final norm and the untied
    output layer when ``pp == 1``), ``model_states`` (the two: ``weights + gradients + optimizer``, each a key too),
    ``activations_per_layer`` (one layer, one micro-batch), ``layers_in_flight`` (a count, not bytes: layers' worth
    of micro-batch activations held, ``layers`` under 1F1B), ``activations_layers``, ``activations_embedding``
    (§4.3's embedding dropout mask), ``activations_output`` (§4.3's final norm, output layer and fp32 logits, ``pp
    == 1`` only), ``recompute_working_set`` (one layer's recomputed activations during its backward),
    ``activations`` (their sum) and ``total``. Raises ``ValueError`` naming a parallel size that does not divide
    what it splits, or ``pp·v`` chunks for fewer layers.
    """
    mode = _check_recompute(recompute)
    tp = _check_tp(spec, tp, sequence_parallel)
    pp, v = check_int("pp", pp, minimum=1), check_int("v", v, minimum=1)
    dp, ep = check_int("dp", dp, minimum=1), check_int("ep", ep, minimum=1)
    if v > 1 and pp == 1:
        raise ValueError(f"v={v} chunks per rank need pipeline parallelism; with pp=1 use v=1")
    if spec.layers < pp * v:
        raise ValueError(f"pp={pp} × v={v} chunks exceed layers={spec.layers}: every chunk holds a layer at least")
    rank_layers = -(-spec.layers // pp)  # the most any rank holds when pp does not divide the layers
    if ep > 1 and (spec.experts is None or spec.experts % ep):
        raise ValueError(f"ep={ep} does not divide experts={spec.experts}")
    schedule = canonical_schedule(schedule) if schedule is not None else ("Interleaved1F1B" if v > 1 else "1F1B")
    steady = pp if schedule in SINGLE_CHUNK_SCHEDULES else 2 * pp  # enough for the warm 1F1B / interleaved count
    m = steady if microbatches is None else check_int("microbatches", microbatches, minimum=1)
    in_flight = inflight_microbatches(pp, m, schedule, v=v)[0]  # first rank, in whole-rank micro-batches

    w_bytes, g_bytes, o_bytes = _bytes_split(bytes_per_param)
    if check_flag("distributed_optimizer", distributed_optimizer):
        o_bytes /= dp
    per_param = w_bytes + g_bytes + o_bytes
    layer_params = rank_layers * _layer_params_per_gpu(spec, tp, ep)
    embedding_params = _embedding_params_per_gpu(spec, tp, pp)
    params = layer_params + embedding_params

    keywords: dict[str, Any] = dict(
        tp=tp,
        sequence_parallel=sequence_parallel,
        dtype_bytes=dtype_bytes,
        dropout=dropout,
        mask_bytes=mask_bytes,
        attention=attention,
        kernels=kernels,
    )
    per_layer = layer_activation_bytes(spec, micro_batch, recompute=recompute, **keywords)
    # the layer whose backward runs holds what it recomputed: the core (selective), all of it (full)
    working = {"none": 0.0, "selective": -per_layer, "full": 0.0}[mode]
    if mode != "none":
        working += layer_activation_bytes(spec, micro_batch, **keywords)
    layers_in_flight = in_flight * rank_layers
    e, b, s, h = float(dtype_bytes), micro_batch, spec.seq_len, spec.hidden
    sp = tp if sequence_parallel else 1
    embedding_act = in_flight * (mask_bytes if dropout else 0.0) * s * b * h / sp
    output_act = 0.0
    if pp == 1:
        norm_extra = e * s * b * h if kernels == "pytorch" and spec.rms_norm else 0.0
        output_act = (2 * e * s * b * h + norm_extra) / sp + 4.0 * s * b * spec.vocab / tp
    activations_layers = layers_in_flight * per_layer
    activations = activations_layers + embedding_act + output_act + working
    out = {
        "weights": params * w_bytes,
        "gradients": params * g_bytes,
        "optimizer": params * o_bytes,
        "parameters_and_optimizer": layer_params * per_param,
        "embedding": embedding_params * per_param,
        "model_states": params * per_param,
        "activations_per_layer": per_layer,
        "layers_in_flight": layers_in_flight,
        "activations_layers": activations_layers,
        "activations_embedding": embedding_act,
        "activations_output": output_act,
        "recompute_working_set": working,
        "activations": activations,
    }
    out["total"] = out["model_states"] + activations
    return out
