"""psl.analytic_profile: a Profile of a TransformerSpec on a Hardware you do not have. Its bytes follow Korthikanti
et al. (2022, Table 2), its times a roofline with a GEMM-shape efficiency curve, and partition, simulate, sweep and a
3-D plan take it as they take a measured profile."""

import dataclasses
import math

import pytest

import pipeswift_lab as psl
from pipeswift_lab.core.hardware import A100_80GB, H100_SXM, H200, Hardware
from pipeswift_lab.core.transformer_activations import saved_tensors
from pipeswift_lab.core.transformer_memory import layer_activation_bytes
from pipeswift_lab.planning.costs import MicrobatchCosts
from pipeswift_lab.planning.sharding import tp_costs
from pipeswift_lab.profiling.analytic import analytic_profile, layer_row, tp_divides
from pipeswift_lab.profiling.analytic_bytes import layer_bytes
from pipeswift_lab.profiling.analytic_time import (
    KERNEL_OVERHEAD_MS,
    attention_ops,
    flash_attention_ms,
    gemm_efficiency,
    gemm_ms,
    layer_ops,
    memory_ms,
)
from pipeswift_lab.profiling.recompute_costs import RECOMPUTE_COLUMNS
from pipeswift_lab.profiling.table import COLUMNS, TP_COLUMNS
from pipeswift_lab.profiling.tp_rank import tp_table

GB = 1e9
#: Korthikanti et al.'s 22B model (Table 3): 48 layers, h = 6144, 64 heads, s = 2048, micro-batch 4, on 8 A100s.
GPT_22B = psl.TransformerSpec(48, 6144, 64, 2048, 51200, name="gpt-22b")
LLAMA_7B = psl.TransformerSpec(
    32, 4096, 32, 4096, 32000, ffn=11008, gated_mlp=True, bias=False, rms_norm=True, learned_positions=False,
    name="llama-7b",
)  # fmt: skip
LLAMA_70B = psl.TransformerSpec(
    80, 8192, 64, 4096, 32000, ffn=28672, kv_heads=8, gated_mlp=True, bias=False, rms_norm=True,
    learned_positions=False, name="llama-70b",
)  # fmt: skip


def test_a_gpt_block_saves_korthikanti_s_34_plus_5as_over_h_bytes_per_sbh():
    """Table 2 of Korthikanti et al.: ``s b h (34 + 5 a s / h)`` bytes per layer in bf16, with dropout, the scores
    written out; ``10 s b h`` stay whole under tensor parallelism, the rest is sharded; sequence parallelism slices
    it all."""
    s, b, h, a = 2048, 4, 6144, 64
    sbh = s * b * h
    block = layer_bytes("block", GPT_22B, b, attention="eager", dropout=True)
    assert block.activation_bytes == sbh * 34 + 5 * a * s * s * b
    assert block.tp_activation_bytes == sbh * 24 + 5 * a * s * s * b
    assert block.activation_bytes - block.tp_activation_bytes == 10 * sbh
    assert block.sp_activation_bytes == block.activation_bytes
    # without dropout the masks and the dropout's output go: 2 a s² b of the 5
    plain = layer_bytes("block", GPT_22B, b, attention="eager")
    assert plain.activation_bytes == sbh * 32 + 2 * a * s * s * b
    # flash attention keeps no s × s tensor: its output (the projection's input) and a log-sum-exp per row
    flash = layer_bytes("block", GPT_22B, b, attention="flash")
    assert flash.activation_bytes == sbh * 32 + 4 * s * b * a


@pytest.mark.parametrize("attention", ["eager", "flash"])
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("spec", [GPT_22B, LLAMA_70B, LLAMA_7B], ids=["gpt", "llama70b", "llama7b"])
def test_the_profile_s_bytes_are_transformer_memory_s(spec, dropout, attention):
    """One activation model: a block's columns sum the tensors psl.transformer_memory sums, at tp = 1 and as the
    planner divides them under tensor and sequence parallelism."""
    b, t = 2, 8
    block = layer_bytes("block", spec, b, attention=attention, dropout=dropout)
    kw = dict(attention=attention, dropout=dropout)
    assert block.activation_bytes == pytest.approx(layer_activation_bytes(spec, b, **kw))
    tp_kept = block.activation_bytes - block.tp_activation_bytes + block.tp_activation_bytes / t
    assert tp_kept == pytest.approx(layer_activation_bytes(spec, b, tp=t, **kw))
    sp = layer_activation_bytes(spec, b, tp=t, sequence_parallel=True, **kw)
    assert block.sp_activation_bytes / t == pytest.approx(sp)
    assert block.full_activation_bytes == layer_activation_bytes(spec, b, recompute="full", **kw)


def test_recomputation_keeps_the_input_or_the_gemm_results():
    """Full recomputation keeps the layer's input (Korthikanti's ``2 sbh``, the size of its output, as a measured
    profile counts it); selective keeps the GEMMs' results besides (QKV 3, output projection 1, up 4, down 1, input
    1: ``20 sbh`` in bf16, as the profiler measures the repo's selective policy, pipeswift_lab.core.recompute)."""
    s, b, h = 2048, 1, 6144
    block = layer_bytes("block", GPT_22B, b)
    assert block.full_activation_bytes == block.output_bytes == 2 * s * b * h
    assert block.selective_activation_bytes == 20 * s * b * h
    kept = {t.name for t in saved_tensors(GPT_22B, b) if t.kept}
    assert kept == {"input", "qkv", "attention_proj", "mlp_up", "mlp_down"}
    assert block.full_transient_bytes > block.selective_transient_bytes > block.accumulate_transient_bytes


def test_grouped_query_gated_and_mixture_of_experts_blocks():
    T, h = 4096, 8192
    llama = layer_bytes("block", LLAMA_70B, 1)
    q, kv, f = 8192, 1024, 28672
    # input, two norm outputs, residual, q/k/v, attention output, gate+up (2f) and SwiGLU's product (f), the lse
    expected = 2 * T * (h + h + h + (q + 2 * kv) + q + h + 3 * f) + 4 * T * 64
    assert llama.activation_bytes == expected
    assert llama.params == LLAMA_70B.layer_params() and llama.param_bytes == 2 * llama.params
    mixtral = psl.TransformerSpec(
        32, 4096, 32, 4096, 32000, ffn=14336, kv_heads=8, gated_mlp=True, experts=8, top_k=2, bias=False,
        rms_norm=True, learned_positions=False,
    )  # fmt: skip
    moe = layer_bytes("block", mixtral, 1)
    dense = layer_bytes("block", psl.TransformerSpec(**{**mixtral.__dict__, "experts": None, "top_k": None}), 1)
    # every token's MLP tensors twice (top_k = 2), the gathered tokens, the experts' outputs and their weights, the
    # router's fp32 probabilities and int64 choices
    T, h, f, k, E = 4096, 4096, 14336, 2, 8
    extra = 2 * (k - 1) * T * 3 * f + 2 * k * T * h + 2 * k * T * h + 2 * k * T + 4 * T * E + 8 * T * k
    assert moe.activation_bytes == dense.activation_bytes + extra
    assert moe.params == mixtral.layer_params()
    assert tp_divides(mixtral) == [8, 32, 14336]


def test_the_gemm_efficiency_curve():
    big = gemm_efficiency(8192, 8192, 8192, H100_SXM)
    assert 0.95 * H100_SXM.matmul_efficiency < big <= H100_SXM.matmul_efficiency  # the measured MAMF, nearly
    # tile quantization: one token more than a tile's multiple computes a whole tile row more
    no_waves = dataclasses.replace(H100_SXM, sm_count=None)
    assert gemm_efficiency(4097, 4096, 4096, no_waves) < 0.98 * gemm_efficiency(4096, 4096, 4096, no_waves)
    assert gemm_efficiency(4096, 4097, 4096, no_waves) < 0.95 * gemm_efficiency(4096, 4096, 4096, no_waves)
    # a short reduction (an attention head's 128) and a thin output lose efficiency
    assert gemm_efficiency(4096, 4096, 128, H100_SXM) < 0.7 * big
    assert gemm_efficiency(4096, 64, 4096, H100_SXM) < 0.3 * big
    # wave quantization: 133 tiles on 132 SMs run in two waves
    assert gemm_efficiency(128, 133 * 256, 8192, H100_SXM) < 0.55 * big


def test_the_roofline_takes_the_longer_of_compute_and_memory():
    m, n, k = 8192, 8192, 8192
    flops_ms = 2 * m * n * k / (H100_SXM.peak_flops * gemm_efficiency(m, n, k, H100_SXM)) * 1e3
    assert gemm_ms(m, n, k, H100_SXM) == pytest.approx(flops_ms + KERNEL_OVERHEAD_MS)
    # one token through a 8192 x 8192 weight: reading the weight is all it does
    weight_ms = 2 * 8192 * 8192 / (H100_SXM.hbm_bandwidth * H100_SXM.bandwidth_efficiency) * 1e3
    assert gemm_ms(1, 8192, 8192, H100_SXM) == pytest.approx(weight_ms + KERNEL_OVERHEAD_MS, rel=1e-3)
    assert gemm_ms(1, 8192, 8192, H200) < 0.75 * gemm_ms(1, 8192, 8192, H100_SXM)  # H200's 4.8 TB/s
    assert memory_ms(0, H100_SXM) == 0.0 and gemm_ms(0, 1, 1, H100_SXM) == 0.0
    forward, backward = flash_attention_ms(1, 4096, 32, 32, 128, H100_SXM)
    flops = 4 * 4096**2 * 32 * 128 * 0.5
    assert forward > flops / H100_SXM.peak_flops * 1e3 / H100_SXM.attention_efficiency
    assert 2.5 < backward / forward < 3.5


def test_selective_recomputation_is_priced_by_its_bytes_as_korthikanti_measured():
    """Korthikanti et al., Table 4: on the 22B model (8-way tensor parallel, micro-batch 4, A100), selective
    recomputation adds 1.3 ms to a layer's backward (11.9 to 13.2 ms). It re-runs attention's core: its FLOPs alone
    would take well under half a millisecond; its softmax and dropout over the scores are bandwidth bound."""
    rank = psl.TransformerSpec(1, 768, 8, 2048, 51200, head_dim=96)  # one of 8 ranks: 8 heads of 96
    core = attention_ops(rank, 4, A100_80GB, attention="eager", dropout=True)
    modelled = sum(op.fwd_ms for op in core)
    flops_only = 4 * 4 * 2048**2 * 768 / (A100_80GB.peak_flops * A100_80GB.matmul_efficiency) * 1e3
    assert flops_only < 0.4 * 1.3
    assert 1.3 / 1.5 < modelled < 1.3 * 1.5
    bandwidth = sum(op.fwd_ms for op in core if op.name in ("softmax", "attention_dropout"))
    assert bandwidth > 0.5 * modelled


def test_a_block_s_backward_is_about_twice_its_forward_and_its_weight_gradient_apart():
    ops = layer_ops("block", LLAMA_7B, 1, H100_SXM)
    fwd, bwd = sum(op.fwd_ms for op in ops), sum(op.bwd_ms for op in ops)
    wgrad = sum(op.wgrad_ms for op in ops)
    gemms = sum(op.fwd_ms for op in ops if op.wgrad_ms > 0)
    assert 1.8 < bwd / fwd < 2.3
    assert wgrad == pytest.approx(gemms, rel=0.05)  # each linear's weight gradient is as long as its forward
    row = layer_row("block", LLAMA_7B, 1, H100_SXM)
    assert row["wgrad_ms"] < row["bwd_ms"] and row["recompute_ms"] == pytest.approx(row["fwd_ms"])
    assert 0 < row["selective_recompute_ms"] < 0.3 * row["fwd_ms"]
    # 7B at 4k tokens on an H100: 6 N T model FLOPs, about 55-75% of the peak in the layers
    flops = 6 * LLAMA_7B.layer_params() * 4096 + 3 * 4 * 4096**2 * 4096 * 0.5
    assert 0.5 < flops / ((fwd + bwd) * 1e-3) / H100_SXM.peak_flops < 0.8


def test_the_profile_has_a_measured_profile_s_columns_and_meta(tmp_path):
    prof = psl.analytic_profile(LLAMA_7B, psl.hardware.H100_SXM, micro_batch=2)
    df = prof.df
    assert isinstance(prof, psl.Profile) and prof.n_layers == 34
    assert prof.layer_names[:2] == ("embed", "block_0") and prof.layer_names[-1] == "head"
    expected = {*COLUMNS, "wgrad_ms", *TP_COLUMNS, *RECOMPUTE_COLUMNS, "transient_bytes", "largest_param_bytes"}
    assert expected | {"accumulate_transient_bytes", "cut_bytes", "weight_pass_bytes"} <= set(df.columns)
    assert int(df["params"].sum()) == LLAMA_7B.params()
    assert (df["wgrad_ms"] <= df["bwd_ms"]).all() and (df["tp_param_bytes"] <= df["param_bytes"]).all()
    assert df["tp_flop_fraction"].between(0, 1).all() and (df["tp_duplicated_bytes"] == 0).all()
    assert (df["full_activation_bytes"] <= df["selective_activation_bytes"]).all()
    assert (df["selective_activation_bytes"] <= df["activation_bytes"]).all()
    assert list(df["cut_bytes"][1:]) == list(df["output_bytes"][:-1])
    meta = prof.meta
    assert meta["batch_size"] == 2 and meta["batch_shape"] == [2, 4096] and meta["hardware"] == "H100_SXM"
    assert meta["device"] == "cuda" and meta["dtype"] == "bfloat16" and meta["source"] == "analytic"
    assert meta["tp_divides"] == [32, 11008] and meta["sequence_parallel"] is True
    assert meta["loss_activation_bytes"] == 4 * 2 * 4096 * 32000 and meta["input_bytes"] == 8 * 2 * 4096
    path = tmp_path / "llama.csv"
    prof.to_csv(path)
    assert psl.Profile.read_csv(path) == prof
    # twice the micro-batch: activations twice, times at least as long per token
    one = psl.analytic_profile(LLAMA_7B, "H100_SXM")
    assert (df["activation_bytes"] == 2 * one.df["activation_bytes"]).all()
    assert prof.df["fwd_ms"].sum() < 2 * one.df["fwd_ms"].sum()
    bare = psl.analytic_profile(LLAMA_7B, H100_SXM, tp_plan=False)
    assert not set(TP_COLUMNS) & set(bare.df.columns) and "tp_divides" not in bare.meta


def test_partition_simulate_and_sweep_take_it():
    prof = psl.analytic_profile(LLAMA_7B, H100_SXM)
    part = psl.partition(prof, 4, "balanced", m=8, precision="bf16-mixed")
    assert part.P == 4
    timeline = psl.simulate(part, 8, "1F1B")
    assert timeline.step_ms > 8 * max(part.stage_ms)
    sweep = psl.sweep(prof, P=[2, 4], m=[8], schedules=["1F1B"])
    assert len(sweep.df) >= 2


def test_a_3d_plan_of_llama_7b_on_64_h100s_fits_80_gb():
    prof = psl.analytic_profile(LLAMA_7B, H100_SXM)
    result = psl.plan(
        prof,
        gpus=64,
        global_batch=256,
        steps=1000,
        topology=H100_SXM.topology(),
        tp=[1, 2, 4, 8],
        fsdp=[1],
        mem_per_gpu_bytes=H100_SXM.hbm_bytes,
        precision="bf16-mixed",
        sequence_parallel=True,
        schedules=["1F1B", "Interleaved1F1B"],
        microbatch_sizes=[1],
        progress=False,
    )
    best = result.best
    assert best.gpus <= 64 and best.gpus == best.P * best.D * best.fsdp * best.tp
    assert best.peak_mem_bytes <= 80 * GB
    assert set(result.table["tp"]) == {1, 2, 4, 8}
    # 256 sequences of 4096 tokens: a second or two on 64 H100s, not milliseconds nor minutes
    assert 500 < best.step_ms < 5000
    args = result.run_arguments(0)
    assert args["precision"] == "bf16-mixed" and args["partition"].P == best.P


def test_a_forced_recomputation_plan_of_an_analytic_profile():
    prof = psl.analytic_profile(LLAMA_7B, H100_SXM)
    kw = dict(gpus=8, global_batch=16, steps=100, schedules=["1F1B"], microbatch_sizes=[1], P=[8], progress=False)
    kw |= dict(precision="bf16-mixed", exhaustive=True)
    plain, full = psl.plan(prof, **kw), psl.plan(prof, recompute="full", **kw)
    assert full.best.recompute == " ".join(f"{s}:full" for s in range(8))
    assert full.best.step_ms > plain.best.step_ms and full.best.peak_mem_bytes < plain.best.peak_mem_bytes


def test_bad_input_is_refused_naming_it():
    gpt2 = psl.TransformerSpec(12, 768, 12, 1024, 50257)
    prof = psl.analytic_profile(gpt2, A100_80GB)
    assert prof.meta["tp_divides"] == [12, 3072]
    with pytest.raises(ValueError, match=r"tp=8 is not allowed: profile.meta\['tp_divides'\]=\[12, 3072\]"):
        psl.plan(prof, gpus=8, global_batch=8, steps=10, tp=8, topology=A100_80GB.topology(), progress=False)
    with pytest.raises(ValueError, match=r"precision='fp8' is not known; valid precisions are"):
        analytic_profile(gpt2, A100_80GB, precision="fp8")
    with pytest.raises(ValueError, match=r"precision='fp32' has no analytic time model"):
        analytic_profile(gpt2, A100_80GB, precision="fp32")
    partial = Hardware("half-known", peak_flops=1e15)
    with pytest.raises(ValueError, match=r"Hardware 'half-known' has no hbm_bandwidth: analytic_profile's time"):
        analytic_profile(gpt2, partial)
    with pytest.raises(ValueError, match=r"micro_batch=0 is invalid"):
        analytic_profile(gpt2, A100_80GB, micro_batch=0)
    with pytest.raises(ValueError, match=r"attention='sdpa' is not known"):
        analytic_profile(gpt2, A100_80GB, attention="sdpa")
    with pytest.raises(TypeError, match=r"spec must be a pipeswift_lab.TransformerSpec"):
        analytic_profile({"layers": 2}, A100_80GB)
    with pytest.raises(ValueError, match=r"'TPU' is not a named device"):
        analytic_profile(gpt2, "TPU")


def test_a_hugging_face_config_profiles_too():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048,
    )  # fmt: skip
    spec = psl.TransformerSpec.from_config(config)
    prof = analytic_profile(spec, H200, micro_batch=4)
    assert prof.meta["tp_divides"] == [4, 16, 2816]
    assert int(prof.df["params"].sum()) == spec.params()
    assert all(math.isfinite(x) and x > 0 for x in prof.df["fwd_ms"])


def test_the_vocabulary_parallel_loss_divides_under_tensor_parallelism():
    """An analytic profile's loss is Megatron-LM's vocabulary-parallel cross-entropy: its time divides by tp in the
    head's row and its bytes in the planner's meta; a measured profile's loss (on gathered logits) stays whole."""
    link = H100_SXM.intra_node_link
    prof = analytic_profile(LLAMA_7B, H100_SXM, 1)
    assert prof.meta["loss_vocab_parallel"] is True
    sharded = tp_costs(MicrobatchCosts(prof), 4, link).metas[1]
    for key in ("loss_activation_bytes", "loss_transient_bytes"):
        assert sharded[key] == pytest.approx(prof.meta[key] / 4)
    measured = psl.Profile(prof.df, {**prof.meta, "loss_vocab_parallel": False})
    whole = tp_costs(MicrobatchCosts(measured), 4, link).metas[1]
    assert whole["loss_activation_bytes"] == prof.meta["loss_activation_bytes"]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_tensor_parallel_rank_recomputes_what_its_shards_hold(sequence_parallel):
    """Under tp = 8 a block's recomputation keeps its input whole (sliced with sequence parallelism), as
    transformer_memory counts it, and its backward's recomputed activations shrink with the activations while the
    gradient temporaries shrink with the parameters."""
    t = 8
    df = analytic_profile(LLAMA_70B, H100_SXM, 1).df
    block = df.set_index("name").loc["block_0"]
    row = tp_table(df, t, H100_SXM.intra_node_link, sequence_parallel).set_index("name").loc["block_0"]
    full = layer_activation_bytes(
        LLAMA_70B, 1, tp=t, sequence_parallel=sequence_parallel, recompute="full", attention="flash", dropout=False
    )
    assert row["full_activation_bytes"] == pytest.approx(full)
    params_kept = row["param_bytes"] / block["param_bytes"]
    activations_kept = row["activation_bytes"] / block["activation_bytes"]
    recomputed = block["full_transient_bytes"] - block["accumulate_transient_bytes"]
    want = block["accumulate_transient_bytes"] * params_kept + recomputed * activations_kept
    assert row["full_transient_bytes"] == pytest.approx(want)
    assert row["full_transient_bytes"] < block["full_transient_bytes"] / 4
