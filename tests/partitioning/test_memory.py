"""Tests for pipeswift_lab.partitioning.memory: the pipeline a split is made for, and the memory windows of a cap."""

import numpy as np
import pytest

import pipeswift_lab as psl
from pipeswift_lab import models
from pipeswift_lab.partitioning.layers import Layers, capped_split
from pipeswift_lab.partitioning.memory import CAP_RETRIES, memory_windows, rank_totals, resolve_layout, windowed_bytes
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.table import Profile


def test_a_layout_places_stages_and_counts_their_micro_batches_in_flight():
    layout = resolve_layout(2, 2, "ZBVZeroBubble", None, "adam", None, 1)
    assert layout.n_stages == 4 and layout.m == 2 and layout.mem_schedule == "ZBVZeroBubble"
    assert layout.placement() == (0, 1, 1, 0)
    prof = Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4, activation_bytes=[10] * 4)
    part = Partition.from_bounds(prof, [(0, 1), (1, 2), (2, 3), (3, 4)], v=2, schedule="ZBVZeroBubble")
    assert part.stage_inflight == layout.inflight() and part.stage_to_rank == layout.placement()
    assert layout.with_P(3).placement() == (0, 1, 2, 2, 1, 0)
    with pytest.raises(ValueError, match=r"P\*v=2\*2=4 stages exceeds the 3 profiled layers"):
        resolve_layout(2, 2, None, None, "adam", None, 1, n_layers=3)


def test_memory_windows_give_the_first_start_whose_stage_fits():
    # 400 bytes of Adam state per layer (param_bytes * 4), no activations: a stage of k layers needs 400 k bytes
    prof = Profile.synthetic(fwd_ms=[1.0] * 6, bwd_ms=[2.0] * 6, param_bytes=[100] * 6)
    layers = Layers(prof)
    layout = resolve_layout(2, 1, None, None, "adam", None, 1)
    assert memory_windows(layers, layout, None) is None
    windows = memory_windows(layers, layout, 1200.0)
    ends = np.arange(7)
    for lo in windows:  # at most three layers per stage fit 1200 bytes
        assert (lo == np.maximum(ends - 3, 0)).all()
    assert rank_totals([1.0, 2.0, 3.0, 4.0], (0, 1, 1, 0), 2) == [5.0, 5.0]


def test_windowed_bytes_is_the_least_cap_whose_windows_allow_a_split():
    prof = Profile.synthetic(fwd_ms=[1.0] * 6, bwd_ms=[2.0] * 6, param_bytes=[100] * 6, activation_bytes=[10] * 6)
    layers = Layers(prof)
    layout = resolve_layout(2, 1, "1F1B", 4, "adam", None, 1)  # 1F1B: rank 0 holds 2 micro-batches, rank 1 one
    bounds = ((0, 2), (2, 6))
    assert windowed_bytes(layers, layout, bounds) == max(2 * 400 + 2 * 2 * 10, 4 * 400 + 1 * 4 * 10)
    for limit, allowed in ((1640.0, True), (1639.0, False)):
        windows = memory_windows(layers, layout, limit)
        assert all(lo[b] <= a for (a, b), lo in zip(bounds, windows)) is allowed


def test_a_capped_split_moves_to_another_split_on_every_retry():
    """The replay holds a transient the windows do not see. Lowered by the excess alone, the budget allowed the same
    split for ten retries and gave up; lowered below what the windows saw, the next retry solves the split that fits.
    """
    # layer 0 is slow: a time-balanced split wants it alone, and the other five (2,000 bytes of Adam state) on rank 1
    prof = Profile.synthetic(fwd_ms=[10.0] + [1.0] * 5, bwd_ms=[1.0] * 6, param_bytes=[100] * 6)
    layers = Layers(prof)
    layout = resolve_layout(2, 1, "1F1B", 2, "adam", None, 1)
    transient, limit = 110.0, 2100.0  # the (0,1),(1,6) split peaks 10 over: excess by excess, 10 retries
    peak_of = lambda bounds: [windowed_bytes(layers, layout, bounds) + transient]  # noqa: E731
    assert (limit - 5 * 400) / (5 * 400 + transient - limit) > CAP_RETRIES
    bounds = capped_split(layers, layout, "balanced", None, limit, peak_of)
    assert bounds == ((0, 2), (2, 6)) and max(peak_of(bounds)) <= limit


def test_the_room_docstring_examples():
    setup = models.reference("mlp")
    prof = psl.profile(
        setup.model, setup.inputs, target=setup.targets, loss_fn=setup.loss_fn, warmup=1, repeats=2, progress=False
    )
    table = prof.df[["name", "fwd_ms", "bwd_ms", "param_bytes", "activation_bytes"]]
    assert len(table) == 4 and (table["param_bytes"] > 0).all()
    part = psl.partition(prof, P=4, schedule="1F1B", m=8, mem_per_gpu_bytes=16 * 2**30)
    assert len(part.df) == 4 and part.bottleneck_ms == max(part.stage_cost_ms)
