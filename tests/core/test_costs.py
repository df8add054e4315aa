import math
from types import SimpleNamespace

import pandas as pd
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


def test_asynchronous_checkpoints_stall_for_the_staging_copy():
    ckpt = CheckpointModel(write_GBps=1, staging_GBps=4, staging_latency_s=0.5, save_latency_s=1.0, teardown_s=5)
    assert ckpt.asynchronous  # the runner's default
    assert ckpt.stall_s(8e9) == pytest.approx(0.5 + 2.0) and ckpt.save_s(8e9) == pytest.approx(1.0 + 8.0)
    assert ckpt.stall_s(8e9) < ckpt.save_s(8e9)
    assert ckpt.cleanup_s(8e9) == pytest.approx(9.0 + 5.0)  # the final save is waited for: the whole write
    sync = CheckpointModel(write_GBps=1, staging_GBps=4, save_latency_s=1.0, asynchronous=False)
    assert sync.stall_s(8e9) == sync.save_s(8e9) == pytest.approx(9.0)
    with pytest.raises(ValueError, match="staging_GBps=0.0 is invalid"):
        CheckpointModel(staging_GBps=0)
    with pytest.raises(ValueError, match="staging_latency_s=-1.0 is invalid"):
        CheckpointModel(staging_latency_s=-1)
    with pytest.raises(TypeError, match="asynchronous must be True or False"):
        CheckpointModel(asynchronous=1)


def test_the_checkpoint_interval_is_young_daly_of_the_stall_floored_at_one_write():
    ckpt = CheckpointModel(write_GBps=1, staging_GBps=4)
    shard, mtbf = 40e9, 3600.0  # a 40 s write, a 10 s stall
    assert ckpt.min_interval_s(shard) == pytest.approx(40.0)
    assert ckpt.interval_s(shard, mtbf) == pytest.approx(young_daly_interval_s(10.0, mtbf))  # 268 s > 40 s
    assert ckpt.interval_s(shard, 60.0) == pytest.approx(40.0)  # √(2·10·60) ≈ 35 s: a save due sooner is skipped
    sync = CheckpointModel(write_GBps=1, asynchronous=False)
    assert sync.min_interval_s(shard) == 0.0
    assert sync.interval_s(shard, 60.0) == pytest.approx(young_daly_interval_s(40.0, 60.0))
    free = CheckpointModel(staging_GBps=4)
    assert free.interval_s(0.0, mtbf) == 0.0 and preemption_loss_s(100.0, 0.0, 1.0, mtbf, interval_s=0.0) > 0
    with pytest.raises(ValueError, match="interval_s=0.0 is invalid"):  # a checkpoint that costs needs an interval
        preemption_loss_s(100.0, 1.0, 1.0, mtbf, interval_s=0.0)


def fake_run(rows, cleanup_s=1.0, columns=None):
    """A stand-in for a RunResult with ``rows`` as its checkpoints table (``columns`` of it only, if given)."""
    table = pd.DataFrame(rows)
    if columns is not None:
        table = table[list(columns)]
    jct = SimpleNamespace(cleanup_s=cleanup_s)
    return SimpleNamespace(checkpoints=table, jct=jct, segments=None, meta={}, restore_s=0.0)


def row(step, kind="periodic", mode="async", status="committed", blocking=10.0, staging=10.0, write=90.0, size=1e6):
    committed = status == "committed"
    return {
        "step": step,
        "largest_rank_bytes": size * 1.01 if committed else math.nan,
        "largest_rank_state_bytes": size if committed else math.nan,
        "blocking_ms": blocking if committed else 0.0,
        "staging_ms": staging if committed else math.nan,
        "write_ms": write if committed else math.nan,
        "kind": kind,
        "status": status,
        "mode": mode,
    }


def test_calibrate_fits_the_stall_to_asynchronous_saves_and_the_write_to_all():
    rows = [
        row(1, staging=8.0, blocking=8.0, write=80.0),
        row(2, status="skipped"),  # due while step 1's save was written: ignored
        row(3, staging=12.0, blocking=12.0, write=100.0),
        row(4, kind="final", mode="waited", blocking=150.0, staging=9.0, write=90.0),
    ]
    with pytest.warns(UserWarning, match="nothing was restored"):
        model = CheckpointModel.calibrate(fake_run(rows, cleanup_s=0.4))
    assert model.asynchronous and model.staging_GBps == 4.0 and model.write_GBps == 1.0  # one size: defaults
    assert model.stall_s(1e6) == pytest.approx(0.010)  # the median staging stall
    # saves: staging + write of the asynchronous ones (88, 112 ms), the whole stall of the waited one (150 ms)
    assert model.save_s(1.01e6) == pytest.approx(0.112)
    assert model.stall_s(1e6) < model.save_s(1e6) == model.min_interval_s(1e6)
    assert model.teardown_s == pytest.approx(0.4 - 0.150)


def test_calibrate_reads_synchronous_and_older_runs_as_waited_saves():
    sync = [row(s, mode="sync", blocking=100.0 + s, staging=5.0, write=50.0) for s in (1, 2, 3)]
    old = [{k: v for k, v in r.items() if k not in ("staging_ms", "write_ms", "status", "mode")} for r in sync]
    for rows in (sync, old):
        with pytest.warns(UserWarning, match="nothing was restored"):
            model = CheckpointModel.calibrate(fake_run(rows))
        assert not model.asynchronous and model.staging_latency_s == 0.0 and model.staging_GBps == 4.0
        assert model.stall_s(1.01e6) == model.save_s(1.01e6) == pytest.approx(0.102)  # the median stall
        assert model.min_interval_s(1.01e6) == 0.0
    with pytest.raises(ValueError, match="saved checkpoints"):
        CheckpointModel.calibrate(fake_run([row(1, status="skipped")]))
