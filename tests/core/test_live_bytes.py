"""The CPU tensor-memory count: storages allocated, views and in-place results, frees, and what existed before."""

import threading
import warnings

import pytest
import torch
import torch.distributed as dist
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


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def _free_on_another_thread(tensors: list[torch.Tensor]) -> None:
    """Drop the last references to ``tensors`` on a thread of their own, as gloo's worker does a collective's."""
    thread = threading.Thread(target=tensors.clear)
    thread.start()
    thread.join()


def test_a_collectives_buffer_another_thread_frees_counts_as_freed_after_this_threads_last_read(one_process_group):
    tracker = LiveTensorBytes()
    with tracker:
        sent = torch.ones(MIB // 4)  # 1 MiB
        dist.all_reduce(sent)  # a collective reads it: its work may hold it for a while
        kept = sent * 2  # this thread's last read of it
        held_elsewhere = [sent]
        del sent
        later = torch.ones(MIB // 2)  # 2 MiB, while the other thread still holds the 1 MiB
        _free_on_another_thread(held_elsewhere)
        assert tracker.live_bytes == 3 * MIB
        assert tracker.peak_bytes == 3 * MIB  # kept and later: not the buffer this thread had let go
        assert tracker.peak_by == {"other": 3 * MIB}
        del kept, later


def test_a_storage_no_collective_read_counts_until_another_thread_frees_it():
    tracker = LiveTensorBytes()
    with tracker:
        handed = torch.ones(MIB // 4)
        held_elsewhere = [handed]
        del handed
        later = torch.ones(MIB // 2)
        _free_on_another_thread(held_elsewhere)
        assert tracker.live_bytes == 2 * MIB and tracker.peak_bytes == 3 * MIB
        del later


def test_a_storage_resized_in_place_counts_at_its_new_size_as_fsdp_frees_and_allocates_it():
    resize = torch.UntypedStorage.resize_
    tracker = LiveTensorBytes()
    with tracker:
        unsharded = torch.ones(MIB // 4)
        unsharded.untyped_storage().resize_(0)  # FSDP2's free_storage: no operator shows it
        assert tracker.live_bytes == 0
        reuses = torch.ones(MIB // 4)  # may take the freed address: counted all the same
        assert tracker.live_bytes == MIB
        unsharded.untyped_storage().resize_(2 * MIB)  # alloc_storage
        assert tracker.live_bytes == 3 * MIB
        del unsharded, reuses
        assert tracker.live_bytes == 0
    assert tracker.peak_bytes == 3 * MIB
    assert torch.UntypedStorage.resize_ is resize  # put back as the mode ends
