"""A user's own schedule run for real: torch's ``_PipelineScheduleRuntime`` executes the action lists, training equal
to one process, with memory predicted per rank along the order; refused before launch when it cannot run."""

import pytest
import torch
import torch.nn.functional as F
from test_runner import assert_same_parameters, make_batch, make_model, reference_training, uniform_partition
from tiny_transformers import M, llama, lm_loss, single_process, tokens

import pipeswift_lab as psl
from pipeswift_lab import Schedule, ScheduleDeadlock
from pipeswift_lab.fidelity.comparison import compare
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.profiling.measure import profile
from pipeswift_lab.runner import run

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it

#: ZB-H1 on two ranks and four micro-batches, written by hand (Qi et al. 2024, Figure 3 top)
ZB_H1 = """0F0,0F1,0I0,0F2,0I1,0F3,0I2,0W0,0I3,0W1,0W2,0W3
1F0,1I0,1F1,1I1,1W0,1F2,1I2,1W1,1F3,1I3,1W2,1W3
"""


def sgd(params):
    return torch.optim.SGD(params, lr=0.05)


def test_a_hand_written_csv_trains_a_hugging_face_model_as_one_process_with_its_memory_predicted(tmp_path):
    pytest.importorskip("transformers")
    assert M == 4
    model, (x, y) = llama(), tokens()
    sch = Schedule.from_csv(ZB_H1, name="ZB-H1 by hand")
    prof = profile(model, x[:2], target=y[:2], loss_fn=lm_loss, layers="auto", repeats=2, progress=False)
    part = partition(prof, 2, schedule=sch, m=M)
    result = run(
        model,
        (x, y),
        lm_loss,
        part,
        M,
        steps=3,
        optimizer=sgd,
        progress=False,
        checkpoint=psl.Checkpointing(tmp_path, every=2),
    )
    want = single_process(model, x, y, steps=3, optimizer=sgd)
    worst = max((result.state_dict()[k] - want[k]).abs().max().item() for k in want)
    assert worst <= 1e-5, f"max parameter difference {worst:.3g}"
    assert str(result.schedule) == "ZB-H1 by hand" and result.timeline.meta["schedule_csv"] == ZB_H1
    # every I and W of the order ran, on the rank the order puts it
    ran = result.timeline.df.query("step == 0 and kind in ['F', 'I', 'W', 'B']")
    assert sorted(zip(ran["rank"], ran["kind"], ran["stage"], ran["microbatch"])) == sorted(
        (rank, kind, stage, mb) for rank, row in enumerate(sch.actions) for kind, stage, mb in row
    )
    memory = result.memory
    assert memory["error"].abs().max() <= 0.10, memory[["rank", "measured_peak_bytes", "predicted_peak_bytes"]]
    compared = compare(psl.simulate(part, M, sch), result)
    assert compared.memory["rank"].tolist() == [0, 1]
    # resumed from its checkpoint under the same order, it ends where the uninterrupted run ended
    resumed = run(
        model, (x, y), lm_loss, part, M, steps=3, optimizer=sgd, progress=False, resume_from=tmp_path / "step-00000002"
    )
    worst = max((resumed.state_dict()[k] - want[k]).abs().max().item() for k in want)
    assert worst <= 1e-5


@pytest.mark.parametrize(
    "schedule, D, fsdp", [("V-Half", 1, 2), ("Interleaved1F1B", 2, 1)], ids=["V-Half-fsdp2", "Interleaved1F1B-D2"]
)
def test_an_order_runs_sharded_or_replicated_as_one_process(schedule, D, fsdp):
    """FSDP2 reduces a split backward's gradients; DDP's replicas run an order whose backward is whole (a split one
    is refused before launch, below)."""
    model = make_model(8)
    sch = psl.schedules.v_half(2, 4) if schedule == "V-Half" else Schedule.of("Interleaved1F1B", 2, 4, 2)
    part = uniform_partition(8, 2, 2, sch, m=4)
    assert part.stage_to_rank == ((0, 1, 1, 0) if schedule == "V-Half" else (0, 1, 0, 1))
    x, y = make_batch()
    result = run(model, (x, y), F.mse_loss, part, 4, steps=2, optimizer=sgd, D=D, fsdp=fsdp, progress=False)
    # one process on the whole batch: equal-sized micro-batches, so the replicas' mean of means is the batch's mean
    want, losses = reference_training(model, lambda step: (x, y), F.mse_loss, 4, 2, sgd)
    assert_same_parameters(result.state_dict(), want)
    if D == 1:  # with two replicas a step's loss is the first replica's
        assert result.losses == pytest.approx(losses, rel=1e-5)


def test_what_cannot_run_is_refused_before_launch():
    model = make_model(4)
    x, y = make_batch()
    part = uniform_partition(4, 2, 1, "1F1B", m=4)
    with pytest.raises(ValueError, match=r"m=4 \(the run has 8\)"):
        run(model, (x, y), F.mse_loss, part, 8, schedule=Schedule.from_csv(ZB_H1), steps=1, progress=False)
    with pytest.raises(ValueError, match=r"\(v shape\) but the partition places them"):
        loop = uniform_partition(8, 2, 2, "Interleaved1F1B", m=4)
        run(make_model(8), (x, y), F.mse_loss, loop, 4, schedule=psl.schedules.v_min(2, 4), steps=1, progress=False)
    stuck = "0F0,0I0,0F1,0I1,0W0,0W1\n1F1,1I1,1F0,1I0,1W0,1W1\n"  # rank 0 waits at 0I0 for rank 1, which waits at 1F1
    with pytest.raises(ValueError, match="D=2 replicas with schedule='ZB-H1' is not supported under DDP"):
        run(model, (x, y), F.mse_loss, part, 4, schedule=Schedule.from_csv(ZB_H1, name="ZB-H1"), D=2, steps=1,
            progress=False)  # fmt: skip
    with pytest.raises(ScheduleDeadlock, match=r"rank 0 waits forever at position 1, action 0I0"):
        run(model, (x, y), F.mse_loss, part, 2, schedule=Schedule.from_csv(stuck), steps=1, progress=False)
