"""Parameters and floating-point operations of a transformer from its shape: Megatron-LM's closed forms and a general
count for grouped-query attention, gated MLPs and mixtures of experts.

Narayanan et al., *Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM* (SC 2021), count a
GPT of ``l`` layers, width ``h``, vocabulary ``V`` and sequence ``s`` (§5.1):

* Eq. 2, parameters: ``P = 12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))`` — per layer ``12h²`` weights and ``13h``
  biases and norm parameters, the token and position embeddings ``(V + s)·h``, the output layer tied to the
  embedding; it leaves out the final norm's ``2h`` (:meth:`TransformerSpec.params` counts it).
* Eq. 3, FLOPs per iteration of ``B`` sequences: ``F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))`` — a layer's forward
  is ``24·B·s·h²`` of projections and ``4·B·s²·h`` of attention (``QKᵀ`` and the weighting of ``V``, counted over
  the whole ``s × s`` square), the logits ``2·B·s·h·V``; the backward is twice the forward and full recomputation
  runs the layers' forward once more: 4 passes of the layers, 3 of the logits.

:func:`transformer_flops` counts the same way for any :class:`TransformerSpec`: per token and layer ``2×`` the
projection weights a token multiplies (``h·(q + 2k) + q·h`` in attention, ``top_k`` experts' MLP and the router
``h·E`` with experts), ``4·s·q`` of attention (``2·s·q`` with ``causal=True``: the masked half is skipped, as flash
kernels do), and ``2·h·V`` of logits per token; biases, norms, softmax and activations are left out (a few ``h``
per token against ``h²``). Multiply-adds count 2.
"""

from __future__ import annotations

from .checks import check_choice, check_flag, check_int
from .transformer_spec import TransformerSpec

__all__ = ["forward_flops_per_token", "megatron_flops_per_iteration", "megatron_params", "transformer_flops"]


def megatron_params(spec: TransformerSpec) -> float:
    """Eq. 2 of Narayanan et al. (SC 2021): ``12·l·h²·(1 + 13/(12h) + (V + s)/(12·l·h))`` parameters of a GPT of
    ``spec``'s ``layers``, ``hidden``, ``vocab`` and ``seq_len`` (its other fields are not read). Returns a float:
    ``spec.params()`` less the final norm for a tied GPT spec."""
    L, h, V, s = spec.layers, spec.hidden, spec.vocab, spec.seq_len
    return 12.0 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))


def megatron_flops_per_iteration(spec: TransformerSpec, global_batch: int, *, recompute: bool = True) -> float:
    """Eq. 3 of Narayanan et al. (SC 2021): floating-point operations of one iteration over ``global_batch``
    sequences of ``spec.seq_len`` tokens, ``96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))`` with full recomputation (4 passes
    of the layers: forward, recomputed forward, backward twice; 3 of the logits). ``recompute=False`` counts 3 passes
    of both: ``72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h))``. Returns a float."""
    B = check_int("global_batch", global_batch, minimum=1)
    L, h, V, s = spec.layers, spec.hidden, spec.vocab, spec.seq_len
    passes = 4 if check_flag("recompute", recompute) else 3
    return 24.0 * passes * B * s * L * h * h * (1 + s / (6 * h)) + 6.0 * B * s * h * V


def forward_flops_per_token(spec: TransformerSpec, *, causal: bool = False) -> dict[str, float]:
    """One token's forward FLOPs, as a dict: ``projections`` (one layer's attention and MLP weights, ``top_k``
    experts and the router with experts), ``attention`` (one layer's ``QKᵀ`` and weighting of ``V``: ``4·s·q``, or
    ``2·s·q`` with ``causal``), ``layer`` (their sum), ``logits`` (``2·h·V``) and ``total`` (``layers`` layers and
    the logits). For a GPT spec ``layer = 24h² + 4sh``, Eq. 3's forward per token and layer."""
    h, q, k, f = spec.hidden, spec.q_width, spec.kv_width, spec.ffn_
    mlp = (3 if spec.gated_mlp else 2) * h * f
    weights = h * (q + 2 * k) + q * h + spec.top_k_ * mlp + (h * spec.experts if spec.experts else 0)
    projections = 2.0 * weights
    attention = (2.0 if check_flag("causal", causal) else 4.0) * spec.seq_len * q
    layer = projections + attention
    logits = 2.0 * h * spec.vocab
    return {
        "projections": projections,
        "attention": attention,
        "layer": layer,
        "logits": logits,
        "total": spec.layers * layer + logits,
    }


def transformer_flops(
    spec: TransformerSpec,
    tokens: int,
    *,
    training: bool = True,
    recompute: str | None = None,
    causal: bool = False,
) -> float:
    """FLOPs of a training step (``training=False``: a forward) over ``tokens`` tokens of sequences of
    ``spec.seq_len``: the forward of :func:`forward_flops_per_token`, twice that for the backward, and the
    recomputed forward of the layers (``recompute="full"``) or of their attention (``"selective"``, Korthikanti et
    al. 2022's). For a GPT spec with ``tokens = B·s`` and ``recompute="full"`` it is Eq. 3 of Narayanan et al.
    exactly (:func:`megatron_flops_per_iteration`), with ``recompute=None`` its 3-pass form. Returns a float."""
    n = check_int("tokens", tokens, minimum=1)
    mode = "none" if recompute is None else check_choice("recompute", recompute, ("none", "selective", "full"))
    fwd = forward_flops_per_token(spec, causal=causal)
    if not check_flag("training", training):
        return n * fwd["total"]
    again = {"none": 0.0, "selective": fwd["attention"], "full": fwd["layer"]}[mode] * spec.layers
    return n * (3 * fwd["total"] + again)
