"""Megatron-LM's parameter and FLOP counts (Narayanan et al., SC 2021, Eq. 2 and Eq. 3, Table 1) and the general
count for grouped-query attention, gated MLPs and mixtures of experts."""

import pytest

import pipeswift_lab as psl
from pipeswift_lab.core.transformer_flops import forward_flops_per_token
from pipeswift_lab.core.transformer_spec import TransformerSpec

S, V = 2048, 51200
#: SC'21 Table 1: ``(billions of parameters as printed, heads, hidden h, layers L)``; V = 51200, s = 2048.
TABLE_1 = [
    (1.7, 24, 2304, 24),
    (3.6, 32, 3072, 30),
    (7.5, 32, 4096, 36),
    (18.4, 48, 6144, 40),
    (39.1, 64, 8192, 48),
    (76.1, 80, 10240, 60),
    (145.6, 96, 12288, 80),
    (310.1, 128, 16384, 96),
    (529.6, 128, 20480, 105),
    (1008.0, 160, 25600, 128),
]


def gpt(a, h, L, tied=True):
    return TransformerSpec(L, h, a, S, V, tied=tied)


@pytest.mark.parametrize("billions,a,h,L", TABLE_1)
def test_eq_2_gives_table_1(billions, a, h, L):
    params = psl.megatron_params(gpt(a, h, L)) / 1e9
    assert round(params, 1) == billions  # the table prints Eq. 2 rounded
    # within 1% from 7.5B up; the two smallest rows keep two significant digits (1.652 prints 1.7, 3.562 prints 3.6)
    assert params == pytest.approx(billions, rel=0.01 if billions > 5 else 0.03)


@pytest.mark.parametrize("billions,a,h,L", TABLE_1)
def test_eq_2_is_the_exact_count_less_the_final_norm(billions, a, h, L):
    """Eq. 2's ``13h`` per layer are the exact biases and norms (3h + h + 4h + h + 4h); it leaves out the final
    LayerNorm's ``2h`` and counts the output layer tied to the embedding."""
    tied, untied = gpt(a, h, L), gpt(a, h, L, tied=False)
    assert psl.megatron_params(tied) == pytest.approx(tied.params() - 2 * h, rel=1e-15)
    assert untied.params() - tied.params() == V * h


@pytest.mark.parametrize("billions,a,h,L", TABLE_1)
def test_eq_3_is_the_general_count_with_full_recomputation(billions, a, h, L):
    spec, B = gpt(a, h, L), 512
    eq_3 = 96 * B * S * L * h**2 * (1 + S / (6 * h) + V / (16 * L * h))
    assert psl.megatron_flops_per_iteration(spec, B) == pytest.approx(eq_3, rel=1e-12)
    assert psl.transformer_flops(spec, B * S, recompute="full") == pytest.approx(eq_3, rel=1e-12)
    three_passes = 72 * B * S * L * h**2 * (1 + S / (6 * h) + V / (12 * L * h))
    assert psl.megatron_flops_per_iteration(spec, B, recompute=False) == pytest.approx(three_passes, rel=1e-12)
    assert psl.transformer_flops(spec, B * S) == pytest.approx(three_passes, rel=1e-12)
    # the usual rule of thumb: 8 FLOPs per parameter and token with recomputation, 6 without, plus attention
    params = psl.megatron_params(spec)
    assert 1 < eq_3 / (8 * params * B * S) < 1 + S / (6 * h) + 0.01


def test_forward_per_token_and_its_parts():
    spec = gpt(16, 1024, 4)
    fwd = forward_flops_per_token(spec)
    assert fwd["layer"] == 24 * 1024**2 + 4 * S * 1024
    assert fwd["logits"] == 2 * 1024 * V
    assert fwd["total"] == 4 * fwd["layer"] + fwd["logits"]
    assert forward_flops_per_token(spec, causal=True)["attention"] == fwd["attention"] / 2
    n = 1000
    assert psl.transformer_flops(spec, n, training=False) == n * fwd["total"]
    selective = psl.transformer_flops(spec, n, recompute="selective") - psl.transformer_flops(spec, n)
    assert selective == n * 4 * fwd["attention"]


def test_gqa_gated_and_moe():
    h, f = 1024, 2816
    mha = TransformerSpec(4, h, 16, S, V, ffn=f, gated_mlp=True)
    gqa = TransformerSpec(4, h, 16, S, V, ffn=f, gated_mlp=True, kv_heads=4)
    # keys and values of 4 heads of 64 instead of 16: two projections of h × 768 less, 2 FLOPs a weight
    assert forward_flops_per_token(mha)["layer"] - forward_flops_per_token(gqa)["layer"] == 2 * 2 * h * 768
    assert forward_flops_per_token(gqa)["attention"] == forward_flops_per_token(mha)["attention"]  # q heads decide
    # a gated MLP multiplies three h × f matrices
    assert forward_flops_per_token(mha)["projections"] == 2 * (4 * h * h + 3 * h * f)
    # 8 experts, 2 per token: twice the MLP of one expert and the router; the idle experts cost nothing
    moe = TransformerSpec(4, h, 16, S, V, ffn=f, gated_mlp=True, experts=8, top_k=2)
    assert forward_flops_per_token(moe)["projections"] == 2 * (4 * h * h + 2 * 3 * h * f + 8 * h)


def test_refusals():
    spec = gpt(16, 1024, 4)
    with pytest.raises(ValueError, match="recompute"):
        psl.transformer_flops(spec, 10, recompute="some")
    with pytest.raises(ValueError, match="tokens"):
        psl.transformer_flops(spec, 0)
    with pytest.raises(ValueError, match="global_batch"):
        psl.megatron_flops_per_iteration(spec, 0)
