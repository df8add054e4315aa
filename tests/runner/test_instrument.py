"""The action recorder: what it records from a stage's methods, and that switching it off changes nothing."""

import time
from types import SimpleNamespace

import torch

from pipeswift_lab.runner.rank.instrument import ActionRecorder, wall_offset_ns
from pipeswift_lab.runner.run_files import KINDS

#: Error allowed in mapping perf_counter onto the wall clock: the offset comes from the tightest of several bracketed
#: reads, microseconds apart unless every one of them was interrupted.
SLACK_NS = 5_000_000


class FakeStage:
    """The three PipelineStage methods torch's schedules call, each sleeping 2 ms."""

    def __init__(self, index, is_last):
        self.stage_index, self.is_last = index, is_last

    def forward_one_chunk(self, fwd_chunk_id, args, kwargs=None, save_forward_output=True):
        time.sleep(0.002)
        return ("out", fwd_chunk_id)

    def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        time.sleep(0.002)

    def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
        time.sleep(0.002)


def fake_schedule():
    def _maybe_compute_loss(stage, output, target_mbs, mb_index, loss_kwargs=None):
        time.sleep(0.003 if stage.is_last else 0)

    return SimpleNamespace(_maybe_compute_loss=_maybe_compute_loss)


def test_records_every_kind_with_wall_clock_times_and_folds_the_loss_into_the_last_forward():
    first, last = FakeStage(0, False), FakeStage(3, True)
    schedule = fake_schedule()
    rec = ActionRecorder([first, last], schedule, torch.device("cpu"))
    before = time.time_ns()
    start = rec.start_step(5)
    assert first.forward_one_chunk(0, ()) == ("out", 0)
    schedule._maybe_compute_loss(first, None, None, 0)
    last.forward_one_chunk(1, ())
    schedule._maybe_compute_loss(last, None, None, 1)
    last.backward_one_chunk(1, loss=None, full_backward=False)
    last.backward_weight_one_chunk(1)
    first.backward_one_chunk(0)
    end = rec.end_step()
    rows = rec.rows()
    assert rows.dtype == torch.int64 and rows.shape == (5, 6)
    assert [(int(r[0]), KINDS[int(r[1])], int(r[2]), int(r[3])) for r in rows] == [
        (5, "F", 0, 0),
        (5, "F", 3, 1),
        (5, "I", 3, 1),
        (5, "W", 3, 1),
        (5, "B", 0, 0),
    ]
    ms = (rows[:, 5] - rows[:, 4]).double() / 1e6
    assert 2.0 <= ms[0] and 5.0 <= ms[1]  # the last stage's F covers its loss (2 + 3 ms); a sleep never ends early
    assert before - SLACK_NS <= start <= rows[0, 4] and rows[-1, 5] <= end <= time.time_ns() + SLACK_NS
    assert (rows[1:, 4] >= rows[:-1, 5]).all()


def test_switched_off_it_leaves_the_stages_alone():
    stage = FakeStage(0, True)
    original = stage.forward_one_chunk
    rec = ActionRecorder([stage], fake_schedule(), torch.device("cpu"), enabled=False)
    assert stage.forward_one_chunk == original and "forward_one_chunk" not in vars(stage)
    rec.start_step(0)
    stage.forward_one_chunk(0, ())
    rec.end_step()
    assert rec.rows().shape == (0, 6)


def test_wall_offset_maps_perf_counter_onto_the_wall_clock():
    offset = wall_offset_ns()
    # a wall-clock read bracketed by two perf_counter reads lies between them once mapped, whatever a busy core does
    # between the reads (they only widen the bracket); the slack is the offset's own error (its tightest bracket)
    before, wall, after = time.perf_counter_ns(), time.time_ns(), time.perf_counter_ns()
    assert before + offset - SLACK_NS <= wall <= after + offset + SLACK_NS
