"""Bytes of training state per parameter, and how partition, sweep and plan count them."""

import math

import pandas as pd
import pytest

from pipeswift_lab import Profile, partition, plan, sweep
from pipeswift_lab.core.precision import (
    PRECISIONS,
    bytes_per_param,
    checkpoint_bytes_per_param,
    precision_table,
    state_bytes,
)

GB = 1e9


def bf16_profile(params_per_layer=1e9, layers=4):
    """A model profiled in bf16: param_bytes is 2 bytes per parameter."""
    return Profile.synthetic(
        fwd_ms=[1.0] * layers,
        bwd_ms=[2.0] * layers,
        params=[params_per_layer] * layers,
        param_bytes=[2 * params_per_layer] * layers,
        activation_bytes=[1e6] * layers,
        meta={"batch_size": 1},
    )


@pytest.mark.parametrize(
    "precision, optimizer, D, want",
    [
        ("fp32", "adam", 1, 16.0),  # 4 weights + 4 grads + 4 + 4 moments
        ("bf16-mixed", "adam", 1, 16.0),  # 2 + 2 + 4 master + 4 + 4 moments: not 8
        ("bf16-mixed", "adamw", 8, 16.0),  # not sharded: replicas change nothing
        ("bf16-mixed-zero1", "adam", 1, 16.0),
        ("bf16-mixed-zero1", "adam", 4, 2 + 2 + 12 / 4),
        ("bf16-mixed-zero1", "adam", 64, 2 + 2 + 12 / 64),
        ("fp32", "sgd_momentum", 1, 12.0),
        ("fp32", "sgd", 1, 8.0),
        ("bf16-mixed", "sgd", 1, 8.0),  # the master copy stays
    ],
)
def test_bytes_per_param(precision, optimizer, D, want):
    assert bytes_per_param(precision, optimizer, D) == pytest.approx(want)


def test_table_and_checkpoint_bytes():
    table = precision_table()
    assert list(table.index) == list(PRECISIONS)
    assert table["total_bytes"].tolist() == [16.0, 16.0, 16.0]
    assert precision_table(D=4).loc["bf16-mixed-zero1", "total_bytes"] == pytest.approx(7.0)
    assert checkpoint_bytes_per_param("fp32") == 12.0  # weights + moments, no gradients
    assert checkpoint_bytes_per_param("bf16-mixed") == 14.0
    assert checkpoint_bytes_per_param("bf16-mixed-zero1", D=4) == pytest.approx(2 + 3.0)


def test_none_keeps_the_profiles_param_bytes():
    assert state_bytes([10.0], [40.0], None).tolist() == [160.0]  # fp32 profile: 4 x param_bytes = 16 B/param
    assert state_bytes([10.0], [20.0], None).tolist() == [80.0]  # bf16 profile: only 8 B/param, the old undercount
    assert state_bytes(None, None, None) is None


def test_partition_counts_bf16_mixed_at_16_bytes_per_parameter():
    prof = bf16_profile()
    old = partition(prof, 2, m=2)
    mixed = partition(prof, 2, m=2, precision="bf16-mixed")
    assert old.stage_state_bytes == (2 * 2e9 * 4,) * 2  # param_bytes x (2 + 2): 8 B/param
    assert mixed.stage_state_bytes == (2 * 16e9,) * 2
    assert mixed.stage_mem_bytes[0] - old.stage_mem_bytes[0] == pytest.approx(2 * 8e9)
    assert partition(fp32_profile(), 2, m=2, precision="fp32").stage_state_bytes == mixed.stage_state_bytes
    zero = partition(prof, 2, m=2, precision="bf16-mixed-zero1", D=4)
    assert zero.stage_state_bytes == (2e9 * 7.0,) * 2
    assert zero.df["state_bytes"].tolist() == [14e9, 14e9]


def test_memory_cap_uses_the_precision():
    prof = bf16_profile()
    with pytest.raises(ValueError, match=r"bf16-mixed\)"):  # 2 layers x 16 GB per rank do not fit 20 GB
        partition(prof, 2, m=2, precision="bf16-mixed", mem_per_gpu_bytes=20 * GB)
    partition(prof, 2, m=2, mem_per_gpu_bytes=20 * GB, optimizer="sgd_momentum")  # the 6 B/param count fits, wrongly
    partition(prof, 2, m=2, precision="bf16-mixed-zero1", D=8, mem_per_gpu_bytes=20 * GB)  # 2 + 2 + 1.5 B/param fits


def test_sweep_peak_memory_follows_the_precision():
    prof = bf16_profile()
    rows = {p: sweep(prof, P=[2], m=[2], precision=p, progress=False).iloc[0] for p in (None, "bf16-mixed")}
    assert rows["bf16-mixed"].peak_mem_bytes - rows[None].peak_mem_bytes == pytest.approx(2 * 8e9)


def test_plan_rejects_what_does_not_fit_in_bf16_mixed_and_zero1_fits_it():
    prof = bf16_profile()
    kw = dict(
        gpus=8,
        global_batch=8,
        steps=100,
        mem_per_gpu_bytes=20 * GB,
        P=[2],
        schedules=["1F1B"],
        exhaustive=True,
        progress=False,
    )
    old = plan(prof, **kw)
    assert old.feasible.P.eq(2).any()  # 2 layers x 8 GB on a rank
    with pytest.raises(ValueError, match="no feasible configuration"):
        plan(prof, precision="bf16-mixed", **kw)  # 2 layers x 16 GB = 32 GB > 20 GB
    zero = plan(prof, precision="bf16-mixed-zero1", **kw)
    # ZeRO-1 shards by D: only configurations with enough replicas fit 20 GB (2 layers x (4 + 12/D) GB + activations)
    fits = {d for d in (1, 2, 4) if 2 * (4 + 12 / d) * GB + 4e6 <= 20 * GB}
    assert set(zero.feasible.D) == fits == {4}
    part = zero.partition_of(zero.best)
    assert part.precision == "bf16-mixed-zero1" and part.D == zero.best.D


def test_plan_allreduce_and_checkpoint_follow_the_precision():
    prof = bf16_profile()
    kw = dict(gpus=4, global_batch=8, steps=100, P=[2], schedules=["1F1B"], exhaustive=True, progress=False)
    fp32 = plan(fp32_profile(), precision="fp32", **kw).feasible.set_index(["D", "m"])
    mixed = plan(prof, precision="bf16-mixed", **kw).feasible.set_index(["D", "m"])
    row32, row16 = fp32.loc[(2, 4)], mixed.loc[(2, 4)]
    assert row32.allreduce_ms > row16.allreduce_ms  # fp32 gradients are twice as many bytes
    assert row32.cleanup_s != row16.cleanup_s  # 12 vs 14 B/param checkpointed


def fp32_profile(params_per_layer=1e9, layers=4):
    """The same model profiled in fp32: 4 bytes per parameter."""
    prof = bf16_profile(params_per_layer, layers)
    return Profile(prof.df.assign(param_bytes=4 * params_per_layer), prof.meta)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(precision="fp32"), r"precision='fp32' computes with 4-byte weights \(float32\), but the profile holds 2"),
        (dict(precision="fp16"), "precision='fp16' is not known; valid precisions are"),
        (dict(precision="bf16-mixed-zero1", D=0), "D"),
        (dict(precision="bf16-mixed", optimizer="lion"), "optimizer='lion' is not known"),
    ],
)
def test_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        partition(bf16_profile(), 2, **kwargs)


def test_named_precision_needs_params():
    table = pd.DataFrame({"fwd_ms": [1.0, 1.0], "bwd_ms": [2.0, 2.0], "param_bytes": [4.0, 4.0]})
    with pytest.raises(ValueError, match="no 'params' column"):
        partition(table, 2, precision="fp32")
    assert math.isfinite(partition(table, 2).stage_state_bytes[0])
    zeros = Profile.synthetic(fwd_ms=[1.0, 1.0], bwd_ms=[2.0, 2.0], param_bytes=[4.0, 4.0])  # params default to 0
    with pytest.raises(ValueError, match="layer 0 has params=0 and param_bytes > 0"):
        partition(zeros, 2, precision="fp32")
