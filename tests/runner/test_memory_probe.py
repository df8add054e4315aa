"""The pieces of a rank's memory measure that need no run: which step is probed, the resident size, the release."""

import torch
from torch import nn

from pipeswift_lab.runner.rank.memory_probe import MemoryProbe, probed_step, resident_bytes
from pipeswift_lab.runner.stages.release import release_unheld


def test_the_second_step_run_is_probed():
    assert probed_step(0, 10) == 1 and probed_step(5, 10) == 6  # resumed at 5: its second step
    assert probed_step(0, 1) == 0 and probed_step(3, 3) is None


def test_resident_bytes_reads_proc():
    rss, hwm = resident_bytes()
    assert 0 < rss <= hwm


def test_a_probed_step_counts_what_it_allocates_on_top_of_what_lives():
    probe = MemoryProbe(torch.device("cpu"), probe_step=1)
    probe.start()
    layer = nn.Linear(256, 256)
    with probe.step(0):
        pass
    with probe.step(1):
        big = torch.ones(2**20)  # 4 MiB more than what lived before
        del big
    report = probe.report()
    assert report["probed_step"] == 1 and report["measured_peak_bytes"] >= 4 * 2**20 + layer.weight.numel() * 4


def test_release_empties_what_the_rank_does_not_hold_and_keeps_shared_storage():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    model[2].weight = model[0].weight  # tied: held by the rank through layer 0
    released = release_unheld(model, [model[0]])
    assert released == (8 * 8 + 8) * 4 + 8 * 4  # layer 1 entirely, and layer 2's own bias
    assert model[0].weight.numel() == 64 and model[2].weight is model[0].weight
    assert model[1].weight.numel() == 0 and model[1].weight.dtype == torch.float32
