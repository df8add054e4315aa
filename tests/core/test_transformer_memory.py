"""transformer_memory against Korthikanti et al. 2022 (arXiv 2205.05198): Table 2 term by term, §4.2.3's pipeline,
§4.3's embedding and output terms, Figure 1's four models and Figure 7's ratios; against Megatron-LM's
``theoretical_memory_usage.py``; and against what the profiler measures for small GPT, Llama, Qwen3 and Mixtral
models on this CPU."""

import dataclasses

import pytest
import torch

import pipeswift_lab as psl
from pipeswift_lab.core.transformer_memory import layer_activation_bytes
from pipeswift_lab.core.transformer_spec import TransformerSpec

# Korthikanti et al.'s Table 3 ``{model: (heads a, hidden h, layers L, tensor t, pipeline p)}`` (s = 2048, V = 51200,
# micro-batch 1), Figure 1 (GB per GPU) and Figure 7 (% of the baseline), shared with benchmarks/bench_analytic.py
from pipeswift_lab.data.published import KORTHIKANTI_FIGURE_1 as FIGURE_1
from pipeswift_lab.data.published import KORTHIKANTI_FIGURE_7 as FIGURE_7
from pipeswift_lab.data.published import KORTHIKANTI_TABLE_3 as TABLE_3

GB = 1e9
S, V = 2048, 51200


def gpt(a, h, L, s=S, vocab=V):
    """A GPT of the papers' (tied embedding, GeLU MLP of 4h, LayerNorm, biases, learned positions)."""
    return TransformerSpec(L, h, a, s, vocab, tied=True)


def table_3(name):
    a, h, L, t, p = TABLE_3[name]
    return gpt(a, h, L), t, p


# -- Table 2 ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("a,h,s,b,t", [(16, 1024, 512, 2, 4), (96, 12288, 2048, 1, 8), (8, 512, 4096, 3, 2)])
def test_table_2_per_layer_rows(a, h, s, b, t):
    spec = gpt(a, h, 4, s=s)
    sbh = s * b * h
    rows = {
        (1, False, None): sbh * (34 + 5 * a * s / h),
        (t, False, None): sbh * (10 + 24 / t + 5 * a * s / (h * t)),
        (t, True, None): sbh / t * (34 + 5 * a * s / h),
        (t, False, "selective"): sbh * (10 + 24 / t),
        (t, True, "selective"): sbh * 34 / t,
        (1, False, "full"): 2 * sbh,
        (t, False, "full"): 2 * sbh,
        (t, True, "full"): 2 * sbh / t,
    }
    for (tp, sp, recompute), expected in rows.items():
        got = layer_activation_bytes(spec, b, tp=tp, sequence_parallel=sp, recompute=recompute)
        assert got == pytest.approx(expected, rel=1e-12), (tp, sp, recompute)


def test_gqa_gated_and_moe_terms_reduce_to_table_2_and_count_what_they_add():
    base = gpt(8, 512, 2, s=1024)
    sbh, b = 1024 * 512, 1
    table_2 = sbh * (34 + 5 * 8 * 1024 / 512)
    assert layer_activation_bytes(TransformerSpec(2, 512, 8, 1024, V, kv_heads=8, tied=True), b) == table_2
    # flash keys and values at the grouped width: 2 of 8 heads keep 2·(h - h/4)·2 bytes less than 8 of 8
    mha = layer_activation_bytes(base, b, attention="flash")
    gqa = layer_activation_bytes(TransformerSpec(2, 512, 8, 1024, V, kv_heads=2, tied=True), b, attention="flash")
    assert mha - gqa == 2 * 2 * 1024 * (512 - 128)
    # eager attention expands them back to the query heads: nothing saved
    assert layer_activation_bytes(TransformerSpec(2, 512, 8, 1024, V, kv_heads=2), b) == table_2
    # a gated MLP keeps 3·f (fused SwiGLU) or 4·f (in PyTorch ops) instead of 2·f
    gated = TransformerSpec(2, 512, 8, 1024, V, gated_mlp=True)
    assert layer_activation_bytes(gated, b) - table_2 == 2 * 1024 * 2048
    assert layer_activation_bytes(gated, b, kernels="pytorch") - table_2 == 2 * 2 * 1024 * 2048
    # top-2 of 4 experts: twice the expert terms, the router's probabilities and choices, the dispatched copies
    moe = TransformerSpec(2, 512, 8, 1024, V, gated_mlp=True, experts=4, top_k=2)
    router = 4 * 1024 * 4 + 8 * 1024 * 2 + 2 * 1024 * (2 * 2 * 512 + 2)
    assert layer_activation_bytes(moe, b) - layer_activation_bytes(gated, b) == 3 * 2 * 1024 * 2048 + router


# -- §4.2.3 and §4.3: the first pipeline stage ------------------------------------------------------------------------
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_first_stage_holds_L_layers_whatever_p_and_more_interleaved(p):
    spec, s, b, h, t = gpt(16, 1024, 16), S, 1, 1024, 4
    out = psl.transformer_memory(spec, b, tp=t, pp=p, sequence_parallel=True, recompute="selective")
    assert out["layers_in_flight"] == 16
    assert out["activations_layers"] == pytest.approx(16 * s * b * h * 34 / t)
    assert out["activations_embedding"] == pytest.approx(s * b * h * p / t)  # sbhp/t, §4.3
    assert out["activations_output"] == (pytest.approx(4 * s * b * h / t * (1 + V / h)) if p == 1 else 0)
    if p > 1:
        for v in [v for v in (2, 4) if 16 % (p * v) == 0]:
            inter = psl.transformer_memory(spec, b, tp=t, pp=p, v=v, sequence_parallel=True, recompute="selective")
            assert inter["layers_in_flight"] == pytest.approx(16 * (1 + (p - 1) / (p * v)))


def test_activations_equal_megatrons_theoretical_memory_usage_less_its_token_ids():
    """``compute_activation_memory`` (SP + selective) of Megatron-LM: ``sbh(18 + 4f/h)`` a layer, ``sbhp`` of
    embedding dropout, ``8sbp`` of token ids (not in the paper, left out here), the interleaving penalty, and
    ``4sbh(1 + V/h)`` at ``p = 1``, all over ``t``."""
    for name in TABLE_3:
        spec, t, p = table_3(name)
        for v in (1, 2) if p > 1 and spec.layers % (2 * p) == 0 else (1,):
            s, b, h, L = S, 1, spec.hidden, spec.layers
            megatron = s * b * h * (18 + 4 * spec.ffn_ / h) * L + s * b * h * p
            megatron *= 1 + (p - 1) / (p * v) if v > 1 else 1
            megatron += 4 * s * b * h * (1 + V / h) if p == 1 else 0
            out = psl.transformer_memory(spec, b, tp=t, pp=p, v=v, sequence_parallel=True, recompute="selective")
            kept = out["activations_layers"] + out["activations_embedding"] + out["activations_output"]
            assert kept == pytest.approx(megatron / t, rel=1e-12), (name, v)
            assert out["recompute_working_set"] == pytest.approx(5 * spec.heads * s * s * b / t)


# -- parameters and optimizer -----------------------------------------------------------------------------------------
def test_parameters_are_megatrons_most_loaded_shard_with_biases_and_positions():
    h, L, t, p = 1024, 8, 2, 2
    spec = gpt(16, h, L)
    out = psl.transformer_memory(spec, 1, tp=t, pp=p)
    # per layer: 12h² weights and the column-parallel biases (3h + 4h) split, the row biases (2h) and norms (4h) whole
    layer = (12 * h * h + 7 * h) / t + 6 * h
    assert out["parameters_and_optimizer"] == 18 * (L // p) * layer  # the layers (the contract's name)
    assert out["embedding"] == 18 * (V * h / t + S * h)  # p > 1: no head on the first rank
    assert out["model_states"] == out["weights"] + out["gradients"] + out["optimizer"]
    assert out["model_states"] == out["parameters_and_optimizer"] + out["embedding"]
    assert out["weights"] * 9 == out["model_states"]
    # p = 1: the final norm and, untied, the output layer too
    tied, untied = (psl.transformer_memory(TransformerSpec(L, h, 16, S, V, tied=x), 1, tp=t) for x in (True, False))
    assert untied["embedding"] - tied["embedding"] == 18 * V * h / t
    assert tied["embedding"] == 18 * (V * h / t + S * h + 2 * h)
    # Megatron's distributed optimizer: 6 + 12/dp bytes per parameter
    shard = psl.transformer_memory(spec, 1, tp=t, pp=p, dp=8, distributed_optimizer=True)
    assert shard["model_states"] == pytest.approx(out["model_states"] * (6 + 12 / 8) / 18)
    custom = psl.transformer_memory(spec, 1, tp=t, pp=p, bytes_per_param=(2, 2, 12))
    assert custom["model_states"] == pytest.approx(out["model_states"] * 16 / 18)
    assert psl.transformer_memory(spec, 1, tp=t, pp=p, bytes_per_param=16)["optimizer"] == out["weights"] * 5


# -- Figure 1 and Figure 7 --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(TABLE_3))
def test_figure_1_memory_per_gpu(name):
    spec, t, p = table_3(name)
    a, h, L = spec.heads, spec.hidden, spec.layers
    baseline = psl.transformer_memory(spec, 1, tp=t, pp=p)
    present = psl.transformer_memory(spec, 1, tp=t, pp=p, sequence_parallel=True, recompute="selective")
    sbh = S * h
    assert baseline["activations_layers"] == pytest.approx(L * sbh * (10 + 24 / t + 5 * a * S / (h * t)))
    assert present["activations_layers"] == pytest.approx(L * sbh * 34 / t)
    params, base_act, present_act = FIGURE_1[name]
    assert baseline["model_states"] / GB == pytest.approx(params, abs=0.01)
    assert baseline["activations"] / GB == pytest.approx(base_act, abs=0.01)
    assert present["activations"] / GB == pytest.approx(present_act, abs=0.01)
    # the paper's result: the present work fits an 80 GB A100 for all four; the baseline does not beyond 22B
    assert present["total"] < 80 * GB
    assert (baseline["total"] > 80 * GB) == (name != "22B")
    # and the activations shrink about 5x
    assert 4.9 < baseline["activations_layers"] / present["activations_layers"] < 6.3


@pytest.mark.parametrize("name", list(TABLE_3))
def test_figure_7_ratios(name):
    spec, t, p = table_3(name)
    a, h = spec.heads, spec.hidden

    def per_layer(**kw):
        return layer_activation_bytes(spec, 1, tp=t, **kw)

    base = per_layer()
    got = tuple(
        round(100 * per_layer(**kw) / base, 1)
        for kw in (
            {"sequence_parallel": True},
            {"recompute": "selective"},
            {"sequence_parallel": True, "recompute": "selective"},
        )
    )
    assert got == FIGURE_7[name]
    x = 5 * a * S / (h * t)  # the attention core over sbh
    assert got[2] == round(100 * (34 / t) / (10 + 24 / t + x), 1)


def test_figure_7_sp_and_selective_save_alike_as_the_models_grow():
    gaps = [abs(FIGURE_7[n][0] - FIGURE_7[n][1]) for n in TABLE_3]
    assert gaps == sorted(gaps, reverse=True) and gaps[-1] < 5
    assert all(100 / both > 4.9 for _, _, both in FIGURE_7.values())  # "reduce the memory by about 5x"


# -- refusals ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec,kwargs,words",
    [
        (gpt(16, 1024, 8), {"recompute": "some"}, "recompute"),
        (gpt(12, 768, 8), {"tp": 8}, "heads=12"),
        (TransformerSpec(8, 1024, 16, S, V, kv_heads=2), {"tp": 4}, "kv_heads=2"),
        (gpt(16, 1024, 6), {"pp": 4, "v": 2}, "layers=6"),
        (gpt(16, 1024, 8), {"v": 2}, "pp=1"),
        (gpt(16, 1024, 8), {"pp": 4, "v": 4}, "v=4"),
        (gpt(16, 1024, 8), {"ep": 2}, "experts"),
        (gpt(16, 1024, 8), {"bytes_per_param": 4}, "tuple"),
        (gpt(16, 1024, 8), {"attention": "linear"}, "attention"),
        (TransformerSpec(8, 1024, 16, 1000, V), {"tp": 16, "sequence_parallel": True}, "seq_len=1000"),
    ],
)
def test_bad_input_names_itself(spec, kwargs, words):
    with pytest.raises(ValueError, match=words):
        psl.transformer_memory(spec, 1, **kwargs)


def test_a_pipeline_that_does_not_divide_the_layers_counts_its_busiest_rank():
    """Llama 3 405B's 126 layers on 16 stages (Dubey et al. 2024, Table 4): the first rank is counted with 8, the most
    any rank holds, in its parameters and in the layers' worth of activations it keeps."""
    llama = TransformerSpec(
        126, 16384, 128, 8192, 128256, ffn=53248, kv_heads=8, gated_mlp=True, bias=False, rms_norm=True,
        learned_positions=False,
    )  # fmt: skip
    uneven = psl.transformer_memory(llama, 1, tp=8, pp=16, sequence_parallel=True)
    even = psl.transformer_memory(dataclasses.replace(llama, layers=128), 1, tp=8, pp=16, sequence_parallel=True)
    assert uneven["parameters_and_optimizer"] == even["parameters_and_optimizer"]
    assert uneven["layers_in_flight"] == even["layers_in_flight"] == 16 * 8
    assert uneven["activations"] == pytest.approx(even["activations"])


# -- measured on this CPU ---------------------------------------------------------------------------------------------
SEQ, BATCH = 256, 2


def _measured(model, layers, name):
    tokens = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    prof = psl.profile(model, tokens, layers=layers, warmup=0, repeats=1, progress=False, tp_plan={})
    return float(prof.df.set_index("name").loc[name, "activation_bytes"])


def _hf(family, attn="eager", **config):
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=256, max_position_embeddings=SEQ, num_hidden_layers=2, attn_implementation=attn, **config
    )
    head = "LMHeadModel" if family == "GPT2" else "ForCausalLM"
    return getattr(transformers, f"{family}{head}")(cfg), cfg


LLAMA = dict(hidden_size=128, intermediate_size=352, num_attention_heads=4, num_key_value_heads=2)


def test_measured_gpt_reference_model_flash_attention():
    """psl.models.gpt: LayerNorm, SDPA (flash on this CPU, no dropout) keeping q, k, v, its output and log-sum-exp."""
    model = psl.models.gpt(vocab_size=256, seq_len=SEQ, d_model=128, n_layers=2, n_heads=4)
    measured = _measured(model, None, "block_0")
    spec = TransformerSpec(2, 128, 4, SEQ, 256)
    analytic = layer_activation_bytes(spec, BATCH, dtype_bytes=4, dropout=False, attention="flash")
    assert analytic == pytest.approx(measured, rel=0.01)


@pytest.mark.parametrize(
    "family,config,kernels",
    [
        # GPT-2 with exact GeLU (its default gelu_new is written in PyTorch ops and keeps four tensors of 4h) and its
        # dropouts at 0.1: the CPU's dropout keeps a mask of the activations' dtype, 4 bytes
        ("GPT2", dict(n_embd=128, n_head=4, activation_function="gelu", n_positions=SEQ), "fused"),
        ("Llama", LLAMA, "pytorch"),  # grouped-query attention and a gated MLP
        ("Qwen3", dict(LLAMA, intermediate_size=384, head_dim=32), "pytorch"),  # and q/k norms
        ("Mixtral", dict(LLAMA, intermediate_size=224, num_local_experts=4, num_experts_per_tok=2), "pytorch"),
    ],
)
def test_measured_hugging_face_models_eager_attention(family, config, kernels):
    model, cfg = _hf(family, **config)
    layer = "transformer.h.0" if family == "GPT2" else "model.layers.0"
    spec = TransformerSpec.from_config(cfg, seq_len=SEQ)
    dropout = family == "GPT2"
    analytic = layer_activation_bytes(spec, BATCH, dtype_bytes=4, dropout=dropout, mask_bytes=4, kernels=kernels)
    assert analytic == pytest.approx(_measured(model, "auto", layer), rel=0.01)


def test_measured_sdpa_llama_keeps_what_its_exported_graph_adds():
    """Hugging Face's SDPA path as torch.export captures it (what the pipeline runs) repeats the grouped keys and
    values to the query heads and makes the causal mask a float ``b × s × s`` tensor in every layer: the flash
    formula misses exactly those."""
    model, cfg = _hf("Llama", attn="sdpa", **LLAMA)
    spec = TransformerSpec.from_config(cfg, seq_len=SEQ)
    analytic = layer_activation_bytes(spec, BATCH, dtype_bytes=4, dropout=False, attention="flash", kernels="pytorch")
    repeated = 2 * 4 * BATCH * SEQ * (spec.q_width - spec.kv_width)
    mask = 4 * BATCH * SEQ * SEQ
    measured = _measured(model, "auto", "model.layers.0")
    assert analytic < 0.9 * measured
    assert analytic + repeated + mask == pytest.approx(measured, rel=0.002)
