"""What one transformer block keeps for its backward, tensor by tensor: the one activation model behind both
:func:`~pipeswift_lab.transformer_memory` (Korthikanti et al.'s per-GPU totals) and
:func:`~pipeswift_lab.analytic_profile` (the per-layer memory columns the planner reads).

:func:`saved_tensors` lists the tensors of one block on ``b`` sequences of ``s`` tokens (``T = s·b``), width ``h``,
``a`` heads, queries ``q = heads·head_dim`` wide, keys and values ``k = kv_heads·head_dim`` wide, MLP inner size
``f``, ``e`` bytes per element and ``d`` bytes per dropout-mask element (0 without dropout): Korthikanti et al.,
*Reducing Activation Recomputation in Large Transformer Models* (MLSys 2023, arXiv 2205.05198), §4.1, generalized
term by term. Each :class:`Saved` says where it lives (:attr:`Saved.region`):

* ``"outside"`` the tensor-parallel regions, whole on every TP rank unless sequence parallelism slices it: the
  block's input and the residual after attention (the two norms' inputs), the norms' outputs (the QKV and first MLP
  projections' inputs), the two residual dropout masks; an RMSNorm written in PyTorch ops (``kernels="pytorch"``,
  Hugging Face's) keeps its normalized input too; a mixture of experts keeps the router's fp32 probabilities
  ``4·T·E``, its int64 choices ``8·T·K``, and per routed copy (``K = top_k`` per token) the gathered token, the
  expert's output and its weight;
* ``"inside"`` (split by ``t`` TP ranks): ``Q``, ``K`` and ``V`` (with ``attention="eager"`` the grouped keys and
  values expanded to the query heads too, as unfused attention does, Megatron-LM's and Hugging Face's alike), q/k
  norms' inputs, the output projection's input; the MLP's activation input and the second projection's input
  (GeLU ``2·e·T·f``; a gated MLP, Megatron-LM's fused SwiGLU, ``3·e·T·f``, in PyTorch ops ``4·e·T·f``; a mixture of
  experts ``K`` times that);
* ``"core"`` (split by ``t``): attention's core, what Korthikanti's selective recomputation drops. Eager: the softmax
  output ``e·a·s²·b``, its dropout mask ``d·a·s²·b`` and output ``e·a·s²·b`` (without dropout the next matmul keeps
  the softmax output itself); flash: its fp32 log-sum-exp ``4·a·s·b``.

For GPT (``q = k = h``, ``f = 4h``, ``e = 2``, ``d = 1``) the regions hold ``10·sbh``, ``24·sbh`` and ``5·as²b``:
Table 2's ``sbh(34 + 5as/h)``. Two entries are not saved without recomputation (``plain=False``) but kept by the
toolkit's own selective recomputation (:attr:`Saved.kept`: the GEMMs' results and the block's input,
:mod:`pipeswift_lab.core.recompute`): the attention output projection's and the dense MLP's down projection's
results. The norms' fp32 statistics (``4·T`` or ``8·T`` bytes, under 0.1% at any width worth planning) are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from .checks import check_choice, check_flag, check_int, check_time
from .transformer_spec import TransformerSpec

__all__ = ["ATTENTION_KINDS", "KERNEL_KINDS", "REGIONS", "Saved", "saved_tensors"]

#: Where a saved tensor lives under tensor parallelism (the module docs).
REGIONS = ("outside", "inside", "core")
#: How attention's core runs: scores written out (``"eager"``) or fused (``"flash"``).
ATTENTION_KINDS = ("eager", "flash")
#: Whose kernels: Megatron-LM's fused ones (``"fused"``) or modules written in PyTorch ops (``"pytorch"``).
KERNEL_KINDS = ("fused", "pytorch")


@dataclass(frozen=True)
class Saved:
    """One tensor a block's forward keeps for its backward (or keeps under selective recomputation)."""

    name: str
    nbytes: float
    region: str
    """``"outside"``, ``"inside"`` or ``"core"`` (the module docs)."""
    plain: bool = True
    """Saved by a forward without recomputation."""
    kept: bool = False
    """Kept by the toolkit's selective recomputation (a GEMM's result, the block's input)."""

    @property
    def tp(self) -> bool:
        """A local shard under tensor parallelism (without sequence parallelism)."""
        return self.region != "outside"


def saved_tensors(
    spec: TransformerSpec,
    micro_batch: int,
    *,
    dtype_bytes: float = 2,
    dropout: bool = True,
    mask_bytes: float = 1,
    attention: str = "eager",
    kernels: str = "fused",
) -> list[Saved]:
    """The tensors one block of ``spec`` keeps on ``micro_batch`` sequences (the module docs derive them), those of
    zero bytes left out. ``dtype_bytes``: bytes of an activation element; ``dropout``: the block applies dropout,
    keeping masks of ``mask_bytes`` per element; ``attention``: ``"eager"`` or ``"flash"``; ``kernels``:
    ``"fused"`` or ``"pytorch"``. Returns a list of :class:`Saved`."""
    b = check_int("micro_batch", micro_batch, minimum=1)
    e = check_time("dtype_bytes", dtype_bytes, allow_zero=False)
    d = check_time("mask_bytes", mask_bytes) if check_flag("dropout", dropout) else 0.0
    check_choice("attention", attention, ATTENTION_KINDS, noun="attention kinds")
    check_choice("kernels", kernels, KERNEL_KINDS, noun="kernel kinds")
    s, h, f, a = spec.seq_len, spec.hidden, spec.ffn_, spec.heads
    q, k, T = spec.q_width, spec.kv_width, s * b
    unfused = kernels == "pytorch"
    normalized = e * T * h if unfused and spec.rms_norm else 0.0
    routed = T * spec.top_k_ if spec.experts is not None else T
    out = [
        Saved("input", e * T * h, "outside", kept=True),
        Saved("norm_attention_normalized", normalized, "outside"),
        Saved("norm_attention_out", e * T * h, "outside"),
        Saved("qkv", e * T * (q + 2 * k), "inside", kept=True),
    ]
    if attention == "eager" and k < q:
        out.append(Saved("kv_expanded", 2 * e * T * (q - k), "inside"))
    if spec.qk_norm:
        out.append(Saved("qk_norm_in", e * T * (q + k) * (2 if unfused else 1), "inside"))
    if attention == "flash":
        out.append(Saved("attention_lse", 4.0 * a * T, "core"))
    else:
        scores = a * s * s * b
        out.append(Saved("softmax", e * scores, "core"))
        if d:
            out += [Saved("softmax_dropout_mask", d * scores, "core"), Saved("softmax_dropout", e * scores, "core")]
    out += [
        Saved("attention_out", e * T * q, "inside"),
        Saved("attention_proj", e * T * h, "outside", plain=False, kept=True),
        Saved("attention_dropout_mask", d * T * h, "outside"),
        Saved("residual", e * T * h, "outside"),
        Saved("norm_mlp_normalized", normalized, "outside"),
        Saved("norm_mlp_out", e * T * h, "outside"),
    ]
    if spec.experts is not None:
        E, K = spec.experts, spec.top_k_
        out += [
            Saved("router_probs", 4.0 * T * E, "outside", kept=True),
            Saved("router_choices", 8.0 * T * K, "outside", kept=True),
            Saved("routed_tokens", e * routed * h, "outside"),
        ]
    out.append(Saved("mlp_up", e * routed * (2 * f if spec.gated_mlp else f), "inside", kept=True))
    if spec.gated_mlp and unfused:
        out.append(Saved("mlp_activation", e * routed * f, "inside"))
    out.append(Saved("mlp_hidden", e * routed * f, "inside"))
    if spec.experts is None:
        out.append(Saved("mlp_down", e * T * h, "outside", plain=False, kept=True))
    else:
        out += [
            Saved("expert_outputs", e * routed * h, "outside", kept=True),
            Saved("routing_weights", e * routed, "outside"),
        ]
    out.append(Saved("mlp_dropout_mask", d * T * h, "outside"))
    return [item for item in out if item.nbytes > 0]
