"""Published runs: the shipped dataset and its sources, the checks a configuration must pass against its spec, the
prediction from an analytic profile (its tensor-parallel and collective terms held equal to the planner's), the one-
scale calibration, and the error measures (MAPE, Spearman, the pick's regret) on constructed cases."""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pandas as pd
import pytest

import pipeswift_lab as psl
from pipeswift_lab.data.published import PUBLISHED_COLUMNS, published_runs
from pipeswift_lab.fidelity import (
    PublishedRun,
    load_published,
    mape,
    pick_regret,
    predict_iteration,
    published_check,
    spearman,
)
from pipeswift_lab.fidelity.published import OPTIMIZER_TRAFFIC_FACTOR, even_cut, layout_profile

A100 = psl.hardware.A100_80GB
GQA = psl.TransformerSpec(8, 1024, 16, 2048, 51200, kv_heads=2)


def gpt(a, h, L, s=2048, vocab=51200):
    return psl.TransformerSpec(L, h, a, s, vocab, tied=True, name="toy")


def run(spec=None, **kw):
    base = dict(gpus=8, micro_batch=1, global_batch=8, dp=8, iteration_s=1.0, name="r")
    base.update(kw)
    return PublishedRun(spec or gpt(16, 1024, 8), A100, **base)


@pytest.fixture(scope="module")
def shipped():
    return {r.name: r for r in load_published()}


# -- the dataset ------------------------------------------------------------------------------------------------------
def test_dataset_loads_with_a_source_for_every_row(shipped):
    df = published_runs()
    assert list(df.columns) == list(PUBLISHED_COLUMNS)
    assert df["name"].is_unique and len(df) == len(shipped) == 14
    assert (df["source"].str.len() > 80).all()
    sc21 = df[df["framework"] == "Megatron-LM"]
    assert len(sc21) == 10 and sc21["source"].str.contains("run_table_1.sh").all()
    assert sc21["source"].str.contains("Table 1").all() and (sc21["hardware"] == "A100_80GB").all()
    assert df[df["framework"] == "torchtitan"]["source"].str.contains("pytorch/torchtitan benchmarks/").all()
    assert "Narayanan" in df.attrs["source"]


def test_measured_iterations_follow_the_published_units(shipped):
    # SC'21: Eq. 3 (full recomputation) over the achieved teraFLOP/s: the 1T model at 163 TFLOP/s on 3072 GPUs
    one_t = shipped["sc21-gpt-1t"]
    eq3 = psl.megatron_flops_per_iteration(one_t.spec, 3072)
    assert one_t.measured_s == pytest.approx(eq3 / (163e12 * 3072))
    assert 163e12 * 3072 / 1e15 == pytest.approx(502.0, rel=0.005)  # the aggregate 502 PFLOP/s (163 is rounded)
    # torchtitan: tokens per second per GPU; 16 sequences of 8192 tokens on 8 GPUs at 6,667 tokens/s each
    titan = shipped["titan-llama3.1-8b-fsdp8"]
    assert titan.measured_s == pytest.approx(16 * 8192 / (6667 * 8))
    assert titan.hardware.hbm_bandwidth == 2.4e12 and titan.hardware.peak_flops == psl.hardware.H100_SXM.peak_flops
    assert "2.4 TB/s" in titan.hardware.sources["hbm_bandwidth"]
    assert titan.spec.params() == pytest.approx(8.03e9, rel=0.01)  # Llama 3.1 8B
    assert shipped["sc21-gpt-76b"].m == 28 and shipped["sc21-gpt-76b"].layout == "tp8×pp4(v3)×dp32"


def test_a_row_that_does_not_fit_its_spec_is_named():
    df = published_runs()
    df.loc[df["name"] == "sc21-gpt-39b", "tp"] = 3
    with pytest.raises(ValueError, match=r"'sc21-gpt-39b'.*tp=3 does not divide heads=64"):
        load_published(df)
    df = published_runs()
    df.loc[df["name"] == "titan-llama3.1-8b-fsdp8", "hardware"] = "B200"
    with pytest.raises(ValueError, match="'titan-llama3.1-8b-fsdp8'.*B200"):
        load_published(df)


# -- validation -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,words",
    [
        (dict(tp=3, dp=1, gpus=3), "tp=3 does not divide heads=16"),
        (
            dict(spec=psl.TransformerSpec(8, 1024, 16, 2048, 51200, kv_heads=2), tp=4, dp=2),
            "tp=4 does not divide kv_heads=2",
        ),
        (dict(tp=16, dp=1, gpus=16, spec=gpt(32, 2048, 8)), "gpus_per_node=8"),
        (dict(pp=3, v=3, dp=1, gpus=3, global_batch=3, schedule="Interleaved1F1B"), r"pp·v=3·3=9 stages exceed"),
        (dict(pp=2, dp=4, stage_layers=(3, 4)), r"stage_layers=\[3, 4\] must give pp·v=2 stages summing to layers=8"),
        (dict(pp=2, dp=4, stage_layers=(8, 0)), r"stage_layers\[1\]"),
        (dict(pp=2, v=2, dp=4), "v=2 needs a multi-chunk schedule"),
        (dict(gpus=16), r"gpus=16 is not tp·pp·dp·fsdp"),
        (dict(global_batch=12), r"global_batch=12 is not a multiple of micro_batch·dp·fsdp"),
        (dict(tflops_per_gpu=100.0), "give one measurement"),
        (dict(iteration_s=-1.0), "iteration_s must be a finite number > 0"),
        (dict(recompute="some"), "recompute"),
        (dict(attention="linear"), "attention"),
        (dict(micro_batch=0), "micro_batch"),
        (dict(tp=2, dp=4, sequence_parallel=True, spec=gpt(16, 1024, 8, s=1001)), "seq_len=1001"),
    ],
)
def test_bad_configurations_name_the_run_and_the_field(kw, words):
    with pytest.raises(ValueError, match=words) as info:
        run(**kw)
    assert "PublishedRun 'r'" in str(info.value)


def test_a_good_configuration_reads_its_measures():
    r = run(tp=2, pp=2, dp=2, micro_batch=2, global_batch=16, recompute="", iteration_s=None, tokens_per_s_per_gpu=1e4)
    assert (r.m, r.recompute, r.tokens, r.layout) == (4, None, 16 * 2048, "tp2×pp2×dp2")
    assert r.measured_s == pytest.approx(16 * 2048 / (1e4 * 8))
    assert run(iteration_s=None).measured_s is None
    flops = run(iteration_s=None, tflops_per_gpu=100.0, recompute="full")
    assert flops.measured_s == pytest.approx(psl.megatron_flops_per_iteration(flops.spec, 8) / (100e12 * 8))


# -- prediction: the planner's terms ----------------------------------------------------------------------------------
def test_a_runs_tensor_parallelism_is_priced_by_the_planners_tp_table():
    from pipeswift_lab.fidelity import published
    from pipeswift_lab.planning import sharding

    assert published.tp_table is sharding.tp_table  # one function: the check prices what the planner prices
    prof = psl.analytic_profile(gpt(16, 1024, 4), A100, 2)
    assert sharding.tp_table(prof.df, 1, A100.topology().intra_node) is prof.df


def test_optimizer_traffic_is_the_planners():
    from pipeswift_lab.planning.placement import OPTIMIZER_TRAFFIC_FACTOR as planners

    assert planners == OPTIMIZER_TRAFFIC_FACTOR


def test_prediction_adds_the_collectives_the_planner_prices():
    r = run(tp=2, dp=4, global_batch=8, overlap_grad_sync=False)
    got = predict_iteration(r)
    part_params = layout_profile(r).df["params"].sum()
    link = r.topology.link_of("dp", D=4, tp=2)
    expected = psl.costs.allreduce_ms(part_params * 2, 4, link.bandwidth_GBps, link.latency_ms)
    assert got["dp_ms"] == pytest.approx(expected) and got["fsdp_ms"] == 0
    assert got["exposed_sync_ms"] == got["dp_ms"]
    assert got["iteration_ms"] == pytest.approx(got["pipeline_ms"] + got["dp_ms"] + got["optimizer_ms"])
    hidden = predict_iteration(run(tp=2, dp=4, global_batch=8, overlap_grad_sync=True))
    assert hidden["exposed_sync_ms"] == 0 < hidden["dp_ms"]  # within one micro-batch's backward
    sharded = predict_iteration(run(tp=2, dp=1, fsdp=4, global_batch=8, overlap_grad_sync=True))
    assert sharded["fsdp_ms"] > 0 and sharded["exposed_sync_ms"] == pytest.approx(sharded["fsdp_ms"] / 8)


def test_an_uneven_pipeline_is_cut_as_llama_3_cut_its_405b():
    """126 layers on 16 stages: 7, 8 × 14, 7 (the first and last stages also hold the embedding and the head); a
    run's own stage_layers is simulated as given, and the slower cut predicts a longer step."""
    assert even_cut(126, 16) == (7,) + (8,) * 14 + (7,)
    assert even_cut(10, 4) == (2, 3, 3, 2) and even_cut(9, 3) == (3, 3, 3) and even_cut(5, 4) == (1, 1, 2, 1)
    for layers, stages in ((126, 16), (7, 3), (40, 6), (5, 5)):
        cut = even_cut(layers, stages)
        assert sum(cut) == layers and max(cut) - min(cut) <= 1
    spec = gpt(16, 1024, 10)
    uneven = run(spec=spec, pp=4, dp=2, global_batch=64)
    assert uneven.stage_blocks == (2, 3, 3, 2)
    lopsided = run(spec=spec, pp=4, dp=2, global_batch=64, stage_layers=(1, 1, 1, 7))
    assert predict_iteration(lopsided)["pipeline_ms"] > predict_iteration(uneven)["pipeline_ms"]
    with pytest.raises(ValueError, match="5 stages exceed 4 layers"):
        even_cut(4, 5)


def test_pipelines_and_recomputation_lengthen_the_step():
    flat = predict_iteration(run(global_batch=64))
    piped = predict_iteration(run(pp=4, dp=2, global_batch=64))  # 8 micro-batches through 4 stages
    assert piped["pipeline_ms"] > flat["pipeline_ms"] * 8 / 8 / 4  # a bubble, not a quarter of the time
    assert predict_iteration(run(recompute="full"))["pipeline_ms"] > predict_iteration(run())["pipeline_ms"]


# -- calibration ------------------------------------------------------------------------------------------------------
def test_calibrate_recovers_an_injected_scale_and_applies_it():
    runs = [run(spec=gpt(16, 1024, L), name=f"L{L}", overlap_grad_sync=True) for L in (4, 8, 16)]
    measured = []
    for r in runs:
        p = predict_iteration(r)
        measured.append(dataclasses.replace(r, iteration_s=(1.3 * p["pipeline_ms"] + p["optimizer_ms"]) / 1e3))
    cal = psl.calibrate(measured)
    assert cal.compute_scale == {1: pytest.approx(1.3, rel=1e-3)}
    assert cal.meta["kind"] == "published" and cal.meta["runs"] == ("L4", "L8", "L16")
    table = cal.error(measured)
    assert table["rel_error_after"].abs().max() < 1e-3 < table["rel_error_before"].abs().min()
    assert table["in_fit"].all() and list(table["run"]) == ["L4", "L8", "L16"]
    # simulate takes it as it takes a measured calibration
    part = psl.partition(psl.analytic_profile(gpt(16, 1024, 4), A100, 1), 1)
    plain, scaled = psl.simulate(part, 1).step_ms, psl.simulate(part, 1, calibration=cal).step_ms
    assert scaled == pytest.approx(1.3 * plain, rel=1e-3)


def test_calibration_on_three_reduces_the_held_out_error(shipped):
    fit = [shipped[n] for n in ("sc21-gpt-1.7b", "sc21-gpt-3.6b", "sc21-gpt-7.5b")]
    held = [shipped[n] for n in ("sc21-gpt-18b", "sc21-gpt-39b", "sc21-gpt-145b")]
    cal = psl.calibrate(fit)
    table = cal.error(held)
    assert not table["in_fit"].any()
    assert table["rel_error_after"].abs().mean() < table["rel_error_before"].abs().mean()
    assert cal.compute_scale[1] > 1  # the analytic profile is faster than Selene's A100s were


def test_calibrate_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match=r"\('r'\) has no measurement"):
        psl.calibrate([run(iteration_s=None)])
    other = psl.analytic_profile(gpt(16, 1024, 4), A100, 1)
    with pytest.raises(ValueError, match="does not describe published run 'r'"):
        psl.calibrate([run()], other)
    with pytest.raises(TypeError, match="analytic Profile"):
        psl.calibrate([run()], other.df)
    with pytest.raises(TypeError, match="need the Profile"):
        psl.calibrate([object()])
    mine = psl.analytic_profile(gpt(16, 1024, 8), A100, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cal = psl.calibrate([run()], mine)
    assert cal.profile_batch_size == 1 and cal.compute_scale[1] > 0


def test_calibration_plot_takes_published_runs():
    import matplotlib

    matplotlib.use("Agg")
    r = run()
    cal = psl.calibrate([r])
    ax = cal.plot([r])
    assert ax.get_xlabel().startswith("measured")


# -- the measures -----------------------------------------------------------------------------------------------------
def test_mape_and_spearman_on_constructed_cases():
    assert mape([110, 90, 100], [100, 100, 100]) == pytest.approx(20 / 300)
    assert math.isnan(mape([], []))
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)  # 1 - 6·2 / (3·8)
    # ties take their mean rank: ranks (1, 2.5, 2.5) against (1, 2, 3)
    assert spearman([1, 2, 2], [1, 2, 3]) == pytest.approx(1.5 / math.sqrt(1.5 * 2))
    # no ties: 1 - 6 Σd² / (n (n² - 1)), ranks (3, 1, 4, 2, 5, 6) and (2, 4, 1, 5, 3, 6), Σd² = 32
    x, y = [3.0, 1.0, 4.0, 1.5, 5.0, 9.0], [2.0, 7.0, 1.0, 8.0, 2.5, 8.5]
    assert spearman(x, y) == pytest.approx(1 - 6 * 32 / (6 * 35))
    assert math.isnan(spearman([1.0], [2.0])) and math.isnan(spearman([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="length"):
        mape([1, 2], [1])


def test_pick_regret_on_a_constructed_table():
    table = pd.DataFrame(
        {
            "model": ["A", "A", "A", "B", "B", "C"],
            "gpus": [64, 64, 64, 8, 8, 8],
            "run": ["a1", "a2", "a3", "b1", "b2", "c1"],
            "measured_step_ms": [100.0, 103.0, 120.0, 50.0, 60.0, 10.0],
            "predicted_after_ms": [90.0, 80.0, 95.0, 70.0, 65.0, 9.0],
        }
    )
    picks = pick_regret(table).set_index("model")
    assert list(picks.index) == ["A", "B"]  # C has no alternative
    assert picks.loc["A", "pick"] == "a2" and picks.loc["A", "measured_best"] == "a1"
    assert picks.loc["A", "regret"] == pytest.approx(0.03) and picks.loc["A", "within_5pct"]
    assert picks.loc["B", "regret"] == pytest.approx(0.2) and not picks.loc["B", "within_5pct"]
    assert pick_regret(table[table["model"] == "C"]).empty


def test_published_check_reports_what_its_table_says():
    spec = gpt(16, 1024, 8)
    layouts = [dict(dp=8), dict(tp=2, dp=4), dict(tp=4, dp=2), dict(pp=2, dp=4, global_batch=16)]
    runs = []
    for i, (layout, factor) in enumerate(zip(layouts, (1.2, 1.25, 1.5, 1.1))):
        r = run(spec=spec, name=f"toy{i}", **{"global_batch": 8, **layout})
        seconds = factor * predict_iteration(r)["iteration_ms"] / 1e3
        runs.append(dataclasses.replace(r, iteration_s=seconds))
    check = published_check(runs, held_in=["toy0", "toy1"])
    table = check.table
    assert check.held_in == ("toy0", "toy1") and list(table["in_fit"]) == [True, True, False, False]
    out = table[~table["in_fit"]]
    assert check.mape_after == pytest.approx(out["rel_error_after"].abs().mean())
    assert check.mape_before == pytest.approx(out["rel_error_before"].abs().mean())
    measured = [r.measured_s * r.gpus / r.tokens for r in runs]
    np.testing.assert_allclose(table["measured_gpu_s_per_token"], measured)
    assert check.spearman == {
        "toy": pytest.approx(spearman(table["predicted_gpu_s_per_token"], table["measured_gpu_s_per_token"]))
    }
    assert len(check.picks) == 1 and check.picks.iloc[0]["layouts"] == 4
    assert "2 runs held out" in str(check)
    assert published_check(runs, held_in=1).held_in == ("toy0",)  # the smallest: fewest GPUs, then fastest
    with pytest.raises(ValueError, match="no held-in run"):
        published_check(runs, held_in=["nope"])
