"""The CPU tensor-memory count: storages allocated, views and in-place results, frees, and what existed before."""

import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pipeswift_lab.core.live_bytes import LiveTensorBytes, live_tensors, memory_meter

MIB = 2**20


def test_counts_new_storages_once_and_sees_them_freed():
    tracker = LiveTensorBytes()
    with tracker:
        a = [torch.ones(MIB // 4) for _ in range(4)]  # 4 x 1 MiB
        assert tracker.live_bytes == 4 * MIB
        view = a[0].view(2, -1)
        a[1].mul_(2)  # in place: the same storage
        assert tracker.live_bytes == 4 * MIB
        del a[:2]
        assert tracker.live_bytes == 3 * MIB  # a[0] lives on through its view
        del view
        assert tracker.live_bytes == 2 * MIB
        b = torch.cat(a)  # a new 2 MiB storage
        del a, b
    assert tracker.live_bytes == 0 and tracker.peak_bytes == 4 * MIB


def test_adopted_storages_count_and_an_in_place_update_of_them_adds_nothing():
    weight = torch.zeros(MIB // 4)
    tracker = LiveTensorBytes()
    tracker.adopt([weight, weight[:10]])  # one storage
    assert tracker.live_bytes == MIB
    with tracker:
        weight.add_(1.0)
        tmp = weight * 2
        assert tracker.live_bytes == 2 * MIB
        del tmp
    assert tracker.peak_bytes == 2 * MIB and tracker.live_bytes == MIB


def test_recategorized_storages_move_with_their_bytes_and_are_still_seen_freed():
    tracker = LiveTensorBytes("pass")
    with tracker:
        kept = torch.ones(MIB // 4)
        dropped = torch.ones(MIB // 2)
        tracker.recategorize("pass", "earlier")  # what one pass left is earlier to the next
        tracker.category = "pass"
        new = kept * 2
        assert tracker.live_by == {"pass": MIB, "earlier": 3 * MIB}
        del dropped
        assert tracker.live_by == {"pass": MIB, "earlier": MIB}
        tracker.recategorize("absent", "pass")  # nothing counted under it: nothing moves
        assert tracker.live_by == {"pass": MIB, "earlier": MIB}
        del kept, new
    assert tracker.live_bytes == 0


def test_live_tensors_reach_parameters_and_their_gradients():
    layer = torch.nn.Linear(64, 64)
    layer(torch.randn(2, 64)).sum().backward()
    ids = {id(t) for t in live_tensors()}
    assert id(layer.weight) in ids and id(layer.weight.grad) in ids


def test_meter_reads_the_tracker_and_resets_its_peak():
    tracker = LiveTensorBytes()
    meter = memory_meter(torch.device("cpu"), tracker)
    with tracker:
        x = torch.ones(MIB // 4)
        del x
        assert meter.peak() == MIB and meter.allocated() == 0
        meter.reset_peak()
        assert meter.peak() == 0


def test_a_fake_tensor_left_by_tracing_is_adopted_as_nothing_without_reading_its_pointer():
    with FakeTensorMode():
        fake = torch.randn(64, 64)
    real = torch.randn(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when a fake tensor's data pointer is read
        with LiveTensorBytes() as tracker:
            tracker.adopt([fake, real], "earlier")
    assert tracker.live_bytes == real.untyped_storage().nbytes()
