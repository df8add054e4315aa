"""The pieces of a rank's memory measure that need no run: which step is probed, the resident size, the release."""

import pytest
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


@pytest.fixture
def one_process_group():
    """torch.distributed in this process alone (gloo, world size 1): a one-stage pipeline sends nothing."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_the_probed_step_tells_its_peak_apart_term_by_term(one_process_group):
    """One stage of two Linear(256 -> 256) layers under torch's own GPipe, m = 2 micro-batches of 8 rows, Adam: every
    term the probe reports is what the step really holds."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256))
    stage = PipelineStage(module, 0, 1, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=nn.functional.mse_loss)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    probe = MemoryProbe(torch.device("cpu"), probe_step=1)
    probe.watch([stage], schedule, optimizer)
    x, y = torch.randn(64, 256)[:16], torch.randn(16, 256)  # the inputs a slice of a larger batch
    probe.start()

    def schedule_step():  # as the runner's: the losses kept in a list until the step's loss is read
        losses = []
        schedule.step(x, target=y, losses=losses, return_outputs=False)
        return float(torch.stack([loss.detach() for loss in losses]).mean())

    for step in range(2):
        with probe.step(step):
            probe.note_batch([x, y])
            schedule_step()
            probe.settle()
            with probe.during("optimizer step"):
                optimizer.step()
            probe.note_state([module], optimizer)
            optimizer.zero_grad(set_to_none=True)
    report = probe.report()
    params = sum(p.numel() * 4 for p in module.parameters())
    terms = ("weights", "grads", "optimizer", "activations", "buffers", "transient", "staging")
    assert report["measured_peak_bytes"] == sum(report[f"measured_{t}_bytes"] for t in terms)
    assert report["measured_weights_bytes"] == params == report["state_param_bytes"]
    assert report["measured_optimizer_bytes"] == 2 * params + 4 * 4  # two moments, each tensor's float32 step count
    assert report["measured_buffers_bytes"] == 2 * 16 * 256 * 4  # the batch's own bytes, not its storages'
    assert report["measured_staging_bytes"] == 0
    # the peak is Adam's step (single-tensor on CPU: temporaries of the tensor being updated) with every gradient
    # present and nothing of the micro-batches left
    assert report["measured_peak_at"] == "optimizer step"
    assert report["measured_grads_bytes"] == params and report["measured_activations_bytes"] == 0
    assert 2 * 256 * 256 * 4 <= report["measured_transient_bytes"] <= 3 * 256 * 256 * 4


def test_release_empties_what_the_rank_does_not_hold_and_keeps_shared_storage():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    model[2].weight = model[0].weight  # tied: held by the rank through layer 0
    released = release_unheld(model, [model[0]])
    assert released == (8 * 8 + 8) * 4 + 8 * 4  # layer 1 entirely, and layer 2's own bias
    assert model[0].weight.numel() == 64 and model[2].weight is model[0].weight
    assert model[1].weight.numel() == 0 and model[1].weight.dtype == torch.float32
