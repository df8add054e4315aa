"""How long a transformer's operators take on a GPU you do not have: a roofline with a GEMM-shape efficiency curve,
the time model of :func:`~pipeswift_lab.profiling.analytic.analytic_profile`.

Every operator of a layer is priced on a :class:`~pipeswift_lab.core.hardware.Hardware` as the longer of its compute
and its memory traffic (the roofline: Williams, Waterman and Patterson, *Roofline: An Insightful Visual Performance
Model for Multicore Architectures*, CACM 2009), plus a kernel's fixed cost:

* a GEMM of ``(m × k) · (k × n)``: ``max(2 m n k / (peak · efficiency(m, n, k)), bytes / (bandwidth · eb))``,
  ``bytes = e (m k + k n + m n)`` (each operand read once, the result written once);
* the efficiency curve (:func:`gemm_efficiency`): ``matmul_efficiency · q(m, 128) · q(n, 256) · k / (k + 64) ·
  waves``. ``matmul_efficiency`` is the device's best large GEMM over its peak (its measured MAMF, the Hardware's
  source); ``q(d, t) = d / (t ⌈d / t⌉)`` is *tile quantization*: a GEMM is computed in output tiles of 128 × 256
  (cuBLAS' and CUTLASS' large bf16 tiles on A100/H100), so a dimension that is not a multiple of its tile computes
  padding, and one smaller than its tile wastes the rest (fewer than 128 rows run a tile of the next power of two,
  at least 16, the skinny kernels cuBLAS picks for few tokens: one token through a weight is bound by reading the
  weight, as it is); ``k / (k + 64)`` is the main loop's depth: each tile walks ``k`` in steps of 64 and pays about
  one step more for its prologue and epilogue, so short reductions (an attention head's dimension) lose efficiency;
  ``waves`` is *wave quantization*: the tiles run in waves of ``sm_count``, the last one partly idle (``tiles /
  (sm_count ⌈tiles / sm_count⌉)``; 1 where the device's SM count is unknown). Tile and wave quantization are
  NVIDIA's (*Matrix Multiplication Background User's Guide*, Deep Learning Performance documentation). Thin outputs
  (``n`` well below 256) are punished hardest; cuBLAS may pick narrower tiles for them, so the curve overstates
  their time, but they are short and bandwidth- or launch-bound besides. The constants are assumptions of this
  model, not measurements: calibrate them (or ``matmul_efficiency``) against a profile of your own GPU;
* elementwise work (norms, activations, residuals, dropout, softmax, rotary embeddings, the loss): bandwidth bound,
  the bytes read and written over ``hbm_bandwidth · bandwidth_efficiency``;
* attention's core with flash attention (Dao et al., NeurIPS 2022; the s × s scores never reach memory):
  ``4 b s² a d`` FLOPs forward (``QKᵀ`` and ``AV``, half of them skipped under a causal mask), at the device's
  ``attention_efficiency`` scaled by ``s / (s + 256)`` (short sequences do not fill the GPU: an approximation of
  FlashAttention-2's A100 benchmarks, Dao 2023 §4.1, whose throughput rises with the sequence length and nears its
  plateau by a few thousand tokens) and by
  ``min(1, (d / (d + 64)) / (128 / 192))`` (its efficiency is quoted at head dimension 128); its backward does
  :data:`FLASH_BACKWARD_FLOPS` times the forward's FLOPs (it recomputes ``QKᵀ``: five GEMMs for two) at
  :data:`FLASH_BACKWARD_EFFICIENCY` of the forward's efficiency (FlashAttention-2: up to 73% of A100's peak
  forward, 63% backward);
* attention's core written out (``attention="eager"``, Megatron-LM's without flash attention): the ``QKᵀ`` and
  ``AV`` batched GEMMs on the curve, and the scale-mask-softmax and dropout over the ``b a s²`` scores by their
  bytes: the bandwidth-bound part that made selective recomputation cost Korthikanti et al. (2022, Table 4) 1.3 ms
  per layer of their 22B model on A100s where its FLOPs alone predict a fraction of that (this model: 1.16 ms,
  the FLOPs at the matmul efficiency 0.19 ms). Selective recomputation runs this core again whole, its two GEMMs
  included, as Korthikanti et al.'s does.

Backward: a GEMM ``Y = X W`` has an input gradient ``dX = dY Wᵀ`` (``m × k``, reducing over ``n``) and a weight
gradient ``dW = Xᵀ dY`` (``k × n``, reducing over ``m``), each as many FLOPs as the forward and each on the curve at
its own shape: the backward is about twice the forward, and its weight-gradient part (``wgrad_ms``, what a
zero-bubble schedule's ``W`` runs) is priced apart. Elementwise backwards read the forward's saved input and the
output's gradient and write the input's gradient.

Each operator is an :class:`OpTime`: its forward, input-gradient and weight-gradient times, whether tensor
parallelism divides its work (:attr:`OpTime.tp`), whether selective recomputation runs it again (everything but the
GEMMs, whose results it keeps: :mod:`pipeswift_lab.core.recompute`) and whether full recomputation does (everything
in the layer: the loss is not). :func:`layer_ops` lists a layer's operators.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..core.hardware import Hardware
from ..core.transformer_spec import TransformerSpec

__all__ = [
    "ATTENTIONS",
    "FLASH_BACKWARD_EFFICIENCY",
    "FLASH_BACKWARD_FLOPS",
    "KERNEL_OVERHEAD_MS",
    "MIN_TILE_M",
    "TILE_K",
    "TILE_M",
    "TILE_N",
    "OpTime",
    "attention_ops",
    "elementwise_op",
    "flash_attention_ms",
    "gemm_efficiency",
    "gemm_ms",
    "layer_ops",
    "linear_op",
    "memory_ms",
]

#: Output tile rows (the GEMM's ``m``, tokens) of the efficiency curve's tile quantization.
TILE_M = 128
#: The fewest tile rows: a GEMM of fewer tokens than :data:`TILE_M` runs the power-of-two tile that holds them.
MIN_TILE_M = 16
#: Output tile columns (the GEMM's ``n``).
TILE_N = 256
#: The main loop's step along ``k``: a tile's prologue and epilogue cost about one step (``k / (k + TILE_K)``).
TILE_K = 64
#: A kernel's fixed cost, ms: launch and tail of an otherwise empty kernel, the order of a few microseconds on
#: A100/H100 (an assumption; calibrate it).
KERNEL_OVERHEAD_MS = 0.004
#: A flash attention backward's FLOPs over its forward's: it recomputes ``QKᵀ`` and computes ``dV``, ``dP``, ``dQ``
#: and ``dK``, five GEMMs against the forward's two (Dao, FlashAttention-2, ICLR 2024, §3.1.2).
FLASH_BACKWARD_FLOPS = 2.5
#: A flash attention backward's efficiency over its forward's (FlashAttention-2 reaches up to 73% of A100's peak
#: forward and 63% backward: about 0.85).
FLASH_BACKWARD_EFFICIENCY = 0.85
#: The sequence length at which flash attention reaches half its long-sequence efficiency.
ATTENTION_HALF_SEQ = 256
#: How attention's core runs: ``"flash"`` (fused, the scores never reach memory) or ``"eager"`` (written out).
ATTENTIONS = ("flash", "eager")


@dataclass(frozen=True)
class OpTime:
    """One operator of a layer, per micro-batch, in ms (see the module docs)."""

    name: str
    fwd_ms: float
    """Its forward."""
    igrad_ms: float
    """The part of its backward that computes its inputs' gradients."""
    wgrad_ms: float = 0.0
    """The part of its backward that computes its weights' gradients."""
    tp: bool = False
    """Tensor parallelism divides its work among the ``tp`` ranks (a sharded GEMM, attention's heads)."""
    selective: bool = False
    """Selective recomputation runs its forward again in the backward (everything but the GEMMs)."""
    full: bool = True
    """Full recomputation runs its forward again (everything of the layer; the loss is outside it)."""

    @property
    def bwd_ms(self) -> float:
        """Its whole backward: input and weight gradients."""
        return self.igrad_ms + self.wgrad_ms


def _quantized(d: float, tile: int) -> float:
    """``d / (tile ⌈d / tile⌉)``: the useful share of the tiles covering a dimension of ``d``."""
    return d / (tile * math.ceil(d / tile))


def _row_tile(m: float) -> int:
    """The tile rows a GEMM of ``m`` rows runs: :data:`TILE_M`, or for fewer rows the power of two that holds them
    (at least :data:`MIN_TILE_M`), as cuBLAS' heuristics pick skinny kernels for few tokens."""
    if m >= TILE_M:
        return TILE_M
    return max(MIN_TILE_M, 2 ** math.ceil(math.log2(m)))


def gemm_efficiency(m: float, n: float, k: float, hardware: Hardware, batch: int = 1) -> float:
    """The share of ``hardware.peak_flops`` a GEMM of ``(m × k) · (k × n)`` (``batch`` of them at once) reaches:
    ``matmul_efficiency · q(m, 128) · q(n, 256) · k / (k + 64) · waves`` (the module docs derive it). Returns a
    share in ``(0, 1]``."""
    m, n, k = max(1.0, float(m)), max(1.0, float(n)), max(1.0, float(k))
    tile_m = _row_tile(m)
    efficiency = hardware.matmul_efficiency * _quantized(m, tile_m) * _quantized(n, TILE_N) * k / (k + TILE_K)
    if hardware.sm_count is not None:
        tiles = batch * math.ceil(m / tile_m) * math.ceil(n / TILE_N)
        efficiency *= tiles / (hardware.sm_count * math.ceil(tiles / hardware.sm_count))
    return efficiency


def gemm_ms(m: float, n: float, k: float, hardware: Hardware, *, batch: int = 1, element_bytes: int = 2) -> float:
    """Milliseconds of ``batch`` GEMMs of ``(m × k) · (k × n)`` with ``element_bytes``-byte operands: the roofline
    ``max(2 m n k / (peak · efficiency), bytes / (bandwidth · eb))`` plus :data:`KERNEL_OVERHEAD_MS` (0 for an empty
    GEMM)."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return 0.0
    peak, bandwidth = _peaks(hardware)
    flops = 2.0 * m * n * k * batch
    compute_s = flops / (peak * gemm_efficiency(m, n, k, hardware, batch))
    memory_s = element_bytes * batch * (m * k + k * n + m * n) / bandwidth
    return 1e3 * max(compute_s, memory_s) + KERNEL_OVERHEAD_MS


def memory_ms(nbytes: float, hardware: Hardware) -> float:
    """Milliseconds of a bandwidth-bound kernel that reads and writes ``nbytes`` in all:
    ``nbytes / (hbm_bandwidth · bandwidth_efficiency)`` plus :data:`KERNEL_OVERHEAD_MS` (0 for no bytes)."""
    if nbytes <= 0:
        return 0.0
    return 1e3 * nbytes / _peaks(hardware)[1] + KERNEL_OVERHEAD_MS


def _peaks(hardware: Hardware) -> tuple[float, float]:
    """``(peak FLOP/s, sustained bytes/s)`` of ``hardware``; raises ``ValueError`` naming a missing number."""
    hardware.require("peak_flops", "hbm_bandwidth", purpose="the analytic time model")
    assert hardware.peak_flops is not None and hardware.hbm_bandwidth is not None
    return hardware.peak_flops, hardware.hbm_bandwidth * hardware.bandwidth_efficiency


def flash_attention_ms(
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    hardware: Hardware,
    *,
    causal: bool = True,
    element_bytes: int = 2,
) -> tuple[float, float]:
    """``(forward ms, backward ms)`` of a flash attention over ``batch`` sequences of ``seq`` tokens, ``heads``
    query heads sharing ``kv_heads`` key/value heads of ``head_dim``: the FLOPs of ``QKᵀ`` and ``AV`` (halved under
    a ``causal`` mask) at the device's attention efficiency, shaped by sequence length and head dimension, or its
    q/k/v/o traffic if longer (the module docs give the curve and its sources)."""
    peak, bandwidth = _peaks(hardware)
    flops = 4.0 * batch * seq * seq * heads * head_dim * (0.5 if causal else 1.0)
    depth = min(1.0, (head_dim / (head_dim + TILE_K)) / (128 / (128 + TILE_K)))
    efficiency = hardware.attention_efficiency * seq / (seq + ATTENTION_HALF_SEQ) * depth
    tokens = batch * seq
    lse = 4.0 * tokens * heads  # the fp32 log-sum-exp of each row, kept for the backward
    forward_bytes = element_bytes * tokens * (2 * heads + 2 * kv_heads) * head_dim + lse
    backward_bytes = element_bytes * tokens * (5 * heads + 4 * kv_heads) * head_dim + lse
    forward = 1e3 * max(flops / (peak * efficiency), forward_bytes / bandwidth) + KERNEL_OVERHEAD_MS
    backward_efficiency = efficiency * FLASH_BACKWARD_EFFICIENCY
    backward_s = max(FLASH_BACKWARD_FLOPS * flops / (peak * backward_efficiency), backward_bytes / bandwidth)
    return forward, 1e3 * backward_s + KERNEL_OVERHEAD_MS


def linear_op(
    name: str, m: float, n: float, k: float, hardware: Hardware, *, element_bytes: int, tp: bool, batch: int = 1
) -> OpTime:
    """A linear layer ``Y = X W`` on ``m`` tokens, ``k`` in, ``n`` out (``batch`` of them, a mixture's experts):
    forward ``(m, n, k)``, input gradient ``(m, k, n)``, weight gradient ``(k, n, m)`` on the curve. Selective
    recomputation keeps its result. Returns an :class:`OpTime`."""
    kw = {"batch": batch, "element_bytes": element_bytes}
    return OpTime(
        name,
        fwd_ms=gemm_ms(m, n, k, hardware, **kw),
        igrad_ms=gemm_ms(m, k, n, hardware, **kw),
        wgrad_ms=gemm_ms(k, n, m, hardware, **kw),
        tp=tp,
    )


def elementwise_op(
    name: str, forward_bytes: float, backward_bytes: float, hardware: Hardware, *, tp: bool = False
) -> OpTime:
    """A bandwidth-bound operator that moves ``forward_bytes`` forward and ``backward_bytes`` backward (its input
    gradient); selective recomputation runs it again. Returns an :class:`OpTime`."""
    return OpTime(name, memory_ms(forward_bytes, hardware), memory_ms(backward_bytes, hardware), tp=tp, selective=True)


def attention_ops(
    spec: TransformerSpec,
    micro_batch: int,
    hardware: Hardware,
    *,
    attention: str = "flash",
    dropout: bool = False,
    element_bytes: int = 2,
) -> list[OpTime]:
    """The operators of attention's core (between the QKV projection and the output projection) of one block of
    ``spec`` on ``micro_batch`` sequences, all divided by tensor parallelism (they run per head) and all run again by
    selective recomputation. ``attention="flash"``: one fused kernel; ``"eager"``: the ``QKᵀ`` GEMMs, the
    scale-mask-softmax and (``dropout``) the dropout over the scores, and the ``AV`` GEMMs. Returns a list of
    :class:`OpTime`."""
    b, s, a, d, e = micro_batch, spec.seq_len, spec.heads, spec.head_dim_, element_bytes
    if attention == "flash":
        forward, backward = flash_attention_ms(b, s, a, spec.kv_heads_, d, hardware, element_bytes=e)
        return [OpTime("flash_attention", forward, backward, tp=True, selective=True)]
    scores = float(b) * a * s * s
    kw = {"batch": b * a, "element_bytes": e}
    ops = [
        OpTime(
            "scores_qk",
            gemm_ms(s, s, d, hardware, **kw),
            2 * gemm_ms(s, d, s, hardware, **kw),  # dQ = dS K and dK = dSᵀ Q
            tp=True,
            selective=True,
        ),
        elementwise_op("softmax", 2 * e * scores, 3 * e * scores, hardware, tp=True),
    ]
    if dropout:
        ops.append(elementwise_op("attention_dropout", (2 * e + 1) * scores, (2 * e + 1) * scores, hardware, tp=True))
    ops.append(
        OpTime(
            "attention_av",
            gemm_ms(s, d, s, hardware, **kw),
            gemm_ms(s, s, d, hardware, **kw) + gemm_ms(s, d, s, hardware, **kw),  # dP = dO Vᵀ and dV = Pᵀ dO
            tp=True,
            selective=True,
        )
    )
    return ops


def layer_ops(
    kind: str,
    spec: TransformerSpec,
    micro_batch: int,
    hardware: Hardware,
    *,
    attention: str = "flash",
    dropout: bool = False,
    element_bytes: int = 2,
) -> list[OpTime]:
    """The operators of one layer of ``spec`` on ``micro_batch`` sequences: ``kind`` is ``"embedding"``,
    ``"block"`` or ``"head"`` (the final norm, the projection to the vocabulary and the loss). Returns a list of
    :class:`OpTime` in execution order."""
    if kind == "embedding":
        return _embedding_ops(spec, micro_batch, hardware, dropout, element_bytes)
    if kind == "head":
        return _head_ops(spec, micro_batch, hardware, element_bytes)
    if kind != "block":
        raise ValueError(f"kind={kind!r} is not 'embedding', 'block' or 'head'")
    return _block_ops(spec, micro_batch, hardware, attention, dropout, element_bytes)


def _norm(name: str, tokens: float, width: int, e: int, hardware: Hardware, tp: bool = False) -> OpTime:
    """A LayerNorm or RMSNorm over ``tokens × width``: reads the input and writes the output (and its fp32
    statistics) forward; reads the input and the gradient and writes the input's gradient backward."""
    return elementwise_op(name, 2 * e * tokens * width + 8 * tokens, 3 * e * tokens * width, hardware, tp=tp)


def _residual(name: str, tokens: float, h: int, e: int, dropout: bool, hardware: Hardware) -> OpTime:
    """The (bias-)dropout-add onto the residual stream: reads the branch and the stream, writes the sum (and a
    one-byte mask with ``dropout``); backward adds the branch's gradient to the stream's."""
    mask = tokens * h if dropout else 0.0
    return elementwise_op(name, 3 * e * tokens * h + mask, 3 * e * tokens * h + mask, hardware)


def _block_ops(
    spec: TransformerSpec, b: int, hardware: Hardware, attention: str, dropout: bool, e: int
) -> list[OpTime]:
    """A pre-norm block: norm, QKV, (q/k norms, rotary), attention's core, output projection, residual; norm, MLP
    (dense, gated or a mixture of experts), residual."""
    T, h, f = float(b * spec.seq_len), spec.hidden, spec.ffn_
    hq, hkv = spec.q_width, spec.kv_width
    ops = [
        _norm("norm_attention", T, h, e, hardware),
        linear_op("qkv", T, hq + 2 * hkv, h, hardware, element_bytes=e, tp=True),
    ]
    if spec.qk_norm:
        ops.append(_norm("qk_norm", T, hq + hkv, e, hardware, tp=True))
    if not spec.learned_positions:
        ops.append(elementwise_op("rotary", 2 * e * T * (hq + hkv), 2 * e * T * (hq + hkv), hardware, tp=True))
    ops += attention_ops(spec, b, hardware, attention=attention, dropout=dropout, element_bytes=e)
    ops += [
        linear_op("attention_out", T, h, hq, hardware, element_bytes=e, tp=True),
        _residual("residual_attention", T, h, e, dropout, hardware),
        _norm("norm_mlp", T, h, e, hardware),
    ]
    up = 2 * f if spec.gated_mlp else f
    routed, experts = T, 1
    if spec.experts is not None:
        E, k = spec.experts, spec.top_k_
        routed, experts = math.ceil(T * k / E), E
        ops += [
            linear_op("router", T, E, h, hardware, element_bytes=e, tp=False),
            elementwise_op("routing", T * E * (e + 8), T * E * (e + 8), hardware),
            elementwise_op("permute", 2 * e * k * T * h, 2 * e * k * T * h, hardware),
        ]
    ops.append(linear_op("mlp_up", routed, up, h, hardware, element_bytes=e, tp=True, batch=experts))
    act_tokens = routed * experts
    forward, backward = (3, 5) if spec.gated_mlp else (2, 3)  # SwiGLU reads gate and up; GeLU reads one
    ops.append(
        elementwise_op("activation", forward * e * act_tokens * f, backward * e * act_tokens * f, hardware, tp=True)
    )
    ops.append(linear_op("mlp_down", routed, h, f, hardware, element_bytes=e, tp=True, batch=experts))
    if spec.experts is not None:
        k = spec.top_k_
        ops.append(elementwise_op("unpermute", e * T * h * (k + 1), e * T * h * (2 * k + 1), hardware))
    ops.append(_residual("residual_mlp", T, h, e, dropout, hardware))
    return ops


def _embedding_ops(spec: TransformerSpec, b: int, hardware: Hardware, dropout: bool, e: int) -> list[OpTime]:
    """The token lookup (and learned positions, dropout); backward, the table's gradient: zeroed, then the tokens'
    rows added (a weight gradient; the token ids have none)."""
    T, h = float(b * spec.seq_len), spec.hidden
    ops = [
        OpTime("lookup", memory_ms(2 * e * T * h + 8 * T, hardware), 0.0, selective=True),
        OpTime("table_grad", 0.0, 0.0, memory_ms(e * spec.vocab * h + 3 * e * T * h, hardware), tp=True),
    ]
    if spec.learned_positions:
        positions = memory_ms(3 * e * T * h, hardware), memory_ms(2 * e * T * h, hardware)
        ops.append(OpTime("positions", positions[0], 0.0, positions[1], selective=True))
    if dropout:
        ops.append(elementwise_op("embedding_dropout", (2 * e + 1) * T * h, (2 * e + 1) * T * h, hardware))
    return ops


def _head_ops(spec: TransformerSpec, b: int, hardware: Hardware, e: int) -> list[OpTime]:
    """The final norm, the projection to the vocabulary (its weight gradient computed tied or not) and the
    cross-entropy loss, vocabulary-parallel under tensor parallelism (Megatron-LM's): fp32 softmax over the logits
    forward (read the logits, write the exponentials, read them back), their gradient backward."""
    T, h, V = float(b * spec.seq_len), spec.hidden, spec.vocab
    loss_forward, loss_backward = (e + 8) * T * V, (4 + e) * T * V
    return [
        _norm("final_norm", T, h, e, hardware),
        linear_op("vocab_projection", T, V, h, hardware, element_bytes=e, tp=True),
        OpTime("loss", memory_ms(loss_forward, hardware), memory_ms(loss_backward, hardware), tp=True, full=False),
    ]
