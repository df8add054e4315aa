"""A job's speed and costs on any GPU count, from its profile and the cost models."""

import math

import pytest

from pipeswift_lab import Profile, analytic, partition
from pipeswift_lab.cluster import ScalingModel, default_profile, profile_library
from pipeswift_lab.core.costs import AssemblyModel, CheckpointModel


def test_library_and_default_choice():
    library = profile_library()
    assert set(library) == {"gpt-small", "gpt-medium", "gpt-xl"}
    assert [default_profile(g) for g in (1, 2, 8, 9, 128)] == [
        "gpt-small",
        "gpt-medium",
        "gpt-medium",
        "gpt-xl",
        "gpt-xl",
    ]
    params = {name: p.df["params"].sum() for name, p in library.items()}
    assert params["gpt-small"] < params["gpt-medium"] < params["gpt-xl"]
    assert 1.4e9 < params["gpt-xl"] < 1.7e9  # GPT-2 XL scale (tied embeddings counted twice here)


def test_speed_grows_but_never_falls_and_costs_follow_the_configuration():
    model = ScalingModel(profile_library()["gpt-medium"])
    model.ensure(128)
    speeds = model.speed[1:129]
    assert all(b >= a for a, b in zip(speeds, speeds[1:]))
    assert speeds[1] / speeds[0] > 1.9  # two replicas nearly double the throughput at this batch
    assert speeds[127] / speeds[0] < 128  # but not linearly all the way
    for n in (1, 8, 64, 128):
        P, D = model.P[n], model.D[n]
        assert P * D <= n
        assert model.assembly_s[n] == AssemblyModel().seconds(P, D)
    assert model.max_useful_gpus == model.n_layers * 64


def test_step_is_the_closed_form_of_the_slowest_balanced_stage():
    prof = Profile.synthetic(
        fwd_ms=[1, 2, 3, 4], bwd_ms=[2, 4, 6, 8], param_bytes=[1e6] * 4, meta={"batch_size": 2, "global_batch": 16}
    )
    model = ScalingModel(prof)
    part = partition(prof, 2)
    slow = max(range(2), key=lambda s: part.stage_ms[s])
    expected = analytic.step_ms(2, 8, "1F1B", fwd_ms=part.stage_fwd_ms[slow], bwd_ms=part.stage_bwd_ms[slow])
    assert model.step_ms(2, 1) == pytest.approx(expected)
    assert model.step_ms(5, 1) == math.inf  # more stages than layers
    assert model.step_ms(1, 9) == math.inf  # more replicas than micro-batches in the global batch
    model.ensure(4)
    for n in (1, 2, 4):
        shard = max(partition(prof, model.P[n]).stage_param_bytes) * 3  # parameters + Adam's two moments
        assert model.save_s[n] == pytest.approx(CheckpointModel().save_s(shard))
        assert (
            model.stall_s[n] == pytest.approx(CheckpointModel().stall_s(shard)) and model.stall_s[n] < model.save_s[n]
        )
        assert model.restore_s[n] == pytest.approx(CheckpointModel().restore_s(shard))
    sync = ScalingModel(prof, checkpoint=CheckpointModel(asynchronous=False))
    sync.ensure(4)
    assert sync.stall_s[1:] == sync.save_s[1:] == model.save_s[1:]  # a synchronous checkpoint stalls for its write


def test_memory_decides_the_fewest_gpus():
    model = ScalingModel(profile_library()["gpt-xl"])
    assert model.min_gpus == 2  # 1.5B fp32 parameters with Adam state do not fit one 32 GB GPU
    assert model.speed[1] == 0 and math.isnan(model.assembly_s[1])
    small = ScalingModel(profile_library()["gpt-small"])
    assert small.min_gpus == 1
    tiny = ScalingModel(profile_library()["gpt-small"], memory_bytes=1e6)
    assert tiny.min_gpus == 0  # fits nowhere


def test_bad_profile():
    with pytest.raises(TypeError, match="profile must be a pipeswift_lab.Profile"):
        ScalingModel("gpt-small")


def test_table():
    t = ScalingModel(profile_library()["gpt-small"]).table(4)
    assert t["gpus"].tolist() == [1, 2, 3, 4]
    assert {"P", "D", "speed_samples_per_s", "assembly_s", "stall_s", "save_s", "restore_s", "cleanup_s"} <= set(
        t.columns
    )
    assert (t["stall_s"] < t["save_s"]).all()
