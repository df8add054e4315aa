"""Each term of the memory model, checked alone against the probe's measure of that term at a real run's peak.

Real runs (gloo, one CPU process per rank) of four FFN blocks ``x + down(gelu(up(x)))`` with a ``2 * x`` in front of
the third, cut before it: ``2 * x`` saves nothing, so the second block's output is freed by the whole model's forward
once read, and only the first stage's holding of its outputs (torch keeps them for the backward) keeps it. GPipe
peaks on both ranks in the first backward with every micro-batch's activations alive; 1F1B's last rank in its last
backward, with what MSE retains of every earlier micro-batch while its loss tensor lives.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.measure import profile
from pipeswift_lab.runner import run

pytestmark = pytest.mark.processes

WIDTH, HIDDEN, TOKENS, MICRO, M = 64, 256, 32, 2, 4


class FFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class Scale(nn.Module):
    def forward(self, x):
        return 2 * x


def model():
    torch.manual_seed(0)
    return nn.Sequential(FFN(), FFN(), Scale(), FFN(), FFN())


def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(MICRO * M, TOKENS, WIDTH, generator=g), torch.randn(MICRO * M, TOKENS, WIDTH, generator=g)


def memory_of(schedule):
    x, y = batch()
    net = model()
    prof = profile(net, x[:MICRO], target=y[:MICRO], loss_fn=F.mse_loss, warmup=1, repeats=1, progress=False)
    part = Partition.from_bounds(prof, [(0, 2), (2, 5)], schedule=schedule, m=M)
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-3)  # noqa: E731
    return prof, run(net, (x, y), F.mse_loss, part, M, schedule=schedule, steps=2, optimizer=adam, progress=False)


@pytest.fixture(scope="module")
def gpipe():
    return memory_of("GPipe")


@pytest.fixture(scope="module")
def one_f_one_b():
    return memory_of("1F1B")


HIDDEN_BYTES = MICRO * TOKENS * WIDTH * 4  # one micro-batch's hidden state
WIDE_BYTES = MICRO * TOKENS * HIDDEN * 4  # one micro-batch's FFN-wide tensor


def terms(memory, rank, moment="before backward"):
    """``{term: (measured, predicted)}`` of ``rank`` at ``moment`` (RunResult.memory_terms)."""
    table = memory[(memory["rank"] == rank) & (memory["moment"] == moment)]
    return {r.term: (r.measured_bytes, r.predicted_bytes) for r in table.itertuples()}


def test_both_ranks_peak_where_predicted(gpipe):
    _, result = gpipe
    memory = result.memory
    assert memory["peak_at"].tolist() == memory["measured_peak_at"].tolist() == ["B stage 0 mb 0", "B stage 1 mb 0"]
    assert (memory["error"].abs() <= 0.02).all(), memory[["measured_peak_bytes", "predicted_peak_bytes"]]


def test_saved_activations_each_storage_once(gpipe):
    prof, result = gpipe
    # a block holds what it allocates and the backward needs: up's output (GELU saves it), GELU's (down saves it) and
    # its own output where the next layer saves it (the next block's up does, 2 * x does not); 2 * x holds its output
    block = 2 * WIDE_BYTES + HIDDEN_BYTES
    assert prof.df["activation_bytes"].tolist() == [block, 2 * WIDE_BYTES, HIDDEN_BYTES, block, block]
    measured, predicted = terms(result.memory_terms(), 1)["activations"]  # all four micro-batches, before backward
    loss_kept = prof.meta["loss_activation_bytes"]
    assert predicted == M * (HIDDEN_BYTES + 2 * block + loss_kept) == measured


def test_the_stage_output_only_the_sending_stage_keeps(gpipe):
    prof, result = gpipe
    assert prof.df["cut_freed_bytes"].tolist()[2] == HIDDEN_BYTES  # 2 * x saves nothing: the model frees its input
    measured, predicted = terms(result.memory_terms(), 0)["activations"]
    assert predicted == M * (prof.df["activation_bytes"][:2].sum() + HIDDEN_BYTES) == measured


def test_receive_buffers_and_the_batch(gpipe):
    _, result = gpipe
    # rank 0: the step's inputs and a gradient buffer per micro-batch; rank 1: the targets and an input buffer each
    for rank in (0, 1):
        assert terms(result.memory_terms(), rank)["buffers"] == (2 * M * HIDDEN_BYTES, 2 * M * HIDDEN_BYTES)


def test_the_loss_tensors_retained_to_the_end_of_the_step(one_f_one_b):
    prof, result = one_f_one_b
    last = result.memory.set_index("rank").loc[1]
    assert last["peak_at"] == last["measured_peak_at"] == f"B stage 1 mb {M - 1}"
    assert prof.meta["loss_retained_bytes"] == HIDDEN_BYTES  # MSE keeps a tensor of its input's size after its backward
    peak = terms(result.memory_terms(), 1, "peak")
    # at the last backward: its micro-batch, and what the loss tensors of the three before it still hold
    assert (
        peak["activations"][1]
        == prof.df["activation_bytes"][2:].sum() + prof.meta["loss_activation_bytes"] + (M - 1) * HIDDEN_BYTES
    )
    assert abs(peak["activations"][0] - peak["activations"][1]) <= WIDE_BYTES  # what the backward frees as it goes


def test_gradients_and_optimizer_state(gpipe, one_f_one_b):
    for _, result in (gpipe, one_f_one_b):
        table = result.memory_terms()
        for rank in (0, 1):
            before = terms(table, rank)
            assert before["weights"][0] == before["weights"][1]
            # Adam's two moments; the state also holds a 4-byte step count per tensor, which the model leaves out
            assert 0 <= before["optimizer"][0] - before["optimizer"][1] <= 4 * 8
    peak = terms(one_f_one_b[1].memory_terms(), 0, "peak")  # 1F1B's first rank: its second backward, grads whole
    assert peak["grads"][0] == peak["grads"][1] > 0
