"""Tests for pipeswift_lab.partitioning.memory: the pipeline a split is made for, and the memory windows of a cap."""

import numpy as np
import pytest

import pipeswift_lab as psl
from pipeswift_lab import models
from pipeswift_lab.partitioning.layers import Layers
from pipeswift_lab.partitioning.memory import memory_windows, rank_totals, resolve_layout
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


def test_the_room_docstring_examples():
    setup = models.reference("mlp")
    prof = psl.profile(
        setup.model, setup.inputs, target=setup.targets, loss_fn=setup.loss_fn, warmup=1, repeats=2, progress=False
    )
    table = prof.df[["name", "fwd_ms", "bwd_ms", "param_bytes", "activation_bytes"]]
    assert len(table) == 4 and (table["param_bytes"] > 0).all()
    part = psl.partition(prof, P=4, schedule="1F1B", m=8, mem_per_gpu_bytes=16 * 2**30)
    assert len(part.df) == 4 and part.bottleneck_ms == max(part.stage_cost_ms)
