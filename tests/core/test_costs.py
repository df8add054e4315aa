import math

import pytest

from pipeswift_lab.core.costs import (
    AssemblyModel,
    Availability,
    CheckpointModel,
    allreduce_ms,
    preemption_loss_s,
    young_daly_interval_s,
)


def test_availability_wait_and_free():
    a = Availability([(0, 16), (7200, 32)])
    assert a.wait_s(8) == 0 and a.wait_s(16) == 0
    assert a.wait_s(32) == 7200
    assert a.wait_s(33) == math.inf
    assert a.free_at(100) == 16 and a.free_at(7200) == 32
    assert a.max_gpus == 32
    assert Availability(a) == a and Availability.now(4).wait_s(4) == 0


@pytest.mark.parametrize(
    "points, message",
    [
        ([], "availability is empty"),
        ([(10, 4)], "must start at seconds_from_now=0"),
        ([(0, 4), (0, 8)], "strictly increasing"),
        ([(0, -1)], r"free_gpus=-1 is invalid"),
        ([(0, 4, 5)], "is not a .* pair"),
        ([(0, 4), (-5, 8)], r"seconds_from_now=-5.0 is invalid"),
    ],
)
def test_availability_bad_input(points, message):
    with pytest.raises(ValueError, match=message):
        Availability(points)


def test_assembly_model_and_calibration():
    model = AssemblyModel()
    assert model.seconds(4, 2) == 60 + 2 * 4 + 0.25 * 8
    fitted = AssemblyModel.calibrate([(2, 5.0), (4, 9.0), (8, 17.0)])
    assert fitted.per_stage_s == pytest.approx(2.0) and fitted.base_s == pytest.approx(1.0)
    one = AssemblyModel.calibrate([(2, 3.0), (2, 5.0)])
    assert one.seconds(2) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="at least one"):
        AssemblyModel.calibrate([])
    with pytest.raises(ValueError, match="base_s=-1.0 is invalid"):
        AssemblyModel(base_s=-1)


def test_checkpoint_model():
    ckpt = CheckpointModel(write_GBps=2, read_GBps=4, teardown_s=5)
    assert ckpt.save_s(4e9) == 2.0 and ckpt.restore_s(4e9) == 1.0
    assert ckpt.cleanup_s(4e9) == 7.0
    with pytest.raises(ValueError, match="write_GBps=0.0 is invalid; it must be > 0"):
        CheckpointModel(write_GBps=0)


def test_young_daly():
    assert young_daly_interval_s(60, 24 * 3600) == pytest.approx(math.sqrt(2 * 60 * 86400))
    with pytest.raises(ValueError, match="mtbf_s=0.0 is invalid"):
        young_daly_interval_s(60, 0)


def test_preemption_loss_matches_hand_computation():
    # T = 100,000 s of work, C = 50 s, restart 200 s, MTBF 10,000 s, interval 1,000 s:
    # overhead = 100 * 50 = 5,000; per failure = 500 + 200 = 700; wall = 105,000 / (1 - 0.07).
    loss = preemption_loss_s(100_000, 50, 200, 10_000, interval_s=1000)
    assert loss == pytest.approx(105_000 / 0.93 - 100_000)


def test_young_daly_interval_is_near_optimal():
    args = (100_000, 50, 200, 10_000)
    best = preemption_loss_s(*args)
    for tau in (300, 600, 2000, 4000):
        assert best <= preemption_loss_s(*args, interval_s=tau) * 1.01


def test_preemption_that_never_finishes():
    assert preemption_loss_s(1000, 10, 500, 400) == math.inf


def test_allreduce():
    assert allreduce_ms(1e9, 1, 10) == 0.0
    assert allreduce_ms(1e9, 4, 10, latency_ms=0.01) == pytest.approx(2 * 3 / 4 * 100 + 6 * 0.01)
    with pytest.raises(ValueError, match="bandwidth_GBps=0.0 is invalid"):
        allreduce_ms(1, 2, 0)


def test_checkpoint_model_latency_and_bandwidth_fit():
    from pipeswift_lab.core.costs import _latency_bandwidth

    samples = [(b, 0.05 + b / 2e9) for b in (1e8, 2e8, 4e8)]  # 50 ms fixed, 2 GB/s
    latency, GBps = _latency_bandwidth(samples, 1.0)
    assert latency == pytest.approx(0.05) and GBps == pytest.approx(2.0)
    latency, GBps = _latency_bandwidth([(1e6, 0.1), (1e6, 0.3)], 1.0)  # one size: all latency, default bandwidth
    assert GBps == 1.0 and latency == pytest.approx(0.2 - 1e6 / 1e9)
    model = CheckpointModel(save_latency_s=0.5, restore_latency_s=0.25)
    assert model.save_s(1e9) == pytest.approx(1.5) and model.restore_s(2e9) == pytest.approx(1.25)
    with pytest.raises(ValueError, match="save_latency_s"):
        CheckpointModel(save_latency_s=-1)
