"""P stages x D replicas: 4 gloo processes (P=2, D=2) train exactly like one process on the global batch.

Each replica reads its slice of the global batch; DDP all-reduces every stage's gradients at
the last micro-batch's backward. Tiny model, two steps.
"""

import copy

import pytest
import torch
from test_runner import assert_same_parameters, make_model
from torch import nn

from pipeswift_lab import Elastic, Launch
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.profiling.table import Profile
from pipeswift_lab.runner import run
from pipeswift_lab.runner.spec import make_spec

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it

MULTI = {"Interleaved1F1B": 2}


def global_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def one_process(model, x, y, pieces, steps):
    """Single-process training on the global batch: the mean of its ``pieces`` equal micro-batch losses."""
    ref = copy.deepcopy(model)
    opt = optimizer(list(ref.parameters()))
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.stack(
            [nn.functional.mse_loss(ref(a), b) for a, b in zip(x.tensor_split(pieces), y.tensor_split(pieces))]
        ).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return ref.state_dict(), losses


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B"])
def test_p2_d2_trains_like_one_process_on_the_global_batch(schedule):
    P, D, m, steps = 2, 2, 2, 2
    v = MULTI.get(schedule, 1)
    model = make_model(4)
    x, y = global_batch()
    part = partition(
        Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4), P, method="uniform", v=v, schedule=schedule, m=m
    )
    result = run(
        model,
        (x, y),
        nn.functional.mse_loss,
        part,
        m,
        steps=steps,
        optimizer=optimizer,
        progress=False,
        launch=Launch(timeout_s=120),
        D=D,
    )
    want_state, want_losses = one_process(model, x, y, m * D, steps)
    assert_same_parameters(result.state_dict(), want_state)
    assert result.losses == pytest.approx(want_losses, rel=1e-5)
    df = result.timeline.df
    assert "replica" in df.columns
    per_replica = df.groupby("replica").size()
    assert list(per_replica.index) == [0, 1] and per_replica.nunique() == 1  # both replicas ran every action
    assert set(df["rank"]) == {0, 1}  # the pipeline rank: stage_to_rank reads the same in every replica
    assert len(result.ranks) == P * D
    # the mesh is (pp, dp, fsdp, tp), torchtitan's order: global rank = pp_rank * D + replica
    assert list(result.ranks["replica"]) == [0, 1, 0, 1] and list(result.ranks["pp_rank"]) == [0, 0, 1, 1]
    assert result.meta["D"] == D
    assert_allreduce_inside_the_last_backward(df, P * v, steps, D)
    assert 0 < result.allreduce_ms <= max(result.step_ms)  # a step's all-reduce lies inside that step


def assert_allreduce_inside_the_last_backward(df, n_stages, steps, D):
    """One REDUCE_GRAD per (step, replica, stage), within the stage's last backward (DDP launches the buckets as
    gradients become ready and waits for them before that backward returns)."""
    reduce = df[df["kind"] == "REDUCE_GRAD"]
    assert len(reduce) == steps * D * n_stages
    assert not reduce.duplicated(["step", "replica", "stage"]).any()
    backward = df[df["kind"] == "B"].sort_values("start_ms").groupby(["step", "replica", "stage"]).last()
    for row in reduce.itertuples():
        last = backward.loc[(row.step, row.replica, row.stage)]
        assert last["start_ms"] <= row.start_ms <= row.end_ms <= last["end_ms"]
        assert row.microbatch == last["microbatch"]


def test_d1_timelines_have_replica_zero():
    model = make_model(2)
    x, y = global_batch()
    part = partition(Profile.synthetic(fwd_ms=[1.0] * 2, bwd_ms=[2.0] * 2), 2, method="uniform", schedule="1F1B", m=2)
    result = run(model, (x, y), nn.functional.mse_loss, part, 2, steps=1, progress=False, launch=Launch(timeout_s=120))
    assert set(result.timeline.df["replica"]) == {0}
    assert "REDUCE_GRAD" not in set(result.timeline.df["kind"]) and result.allreduce_ms != result.allreduce_ms  # NaN


def test_bad_replica_counts_are_refused_before_launch():
    model = make_model(4)
    x, y = global_batch()
    part = partition(Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4), 2, method="uniform", schedule="1F1B", m=2)
    single = partition(
        Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4), 1, method="uniform", schedule="GPipe", m=2
    )
    with pytest.raises(ValueError, match=r"D=3 does not divide the global batch size 8 of data"):
        make_spec(model, (x, y), nn.functional.mse_loss, single, 2, D=3)
    with pytest.raises(ValueError, match=r"m=4 does not divide each replica's batch 2 \(global batch 8 / D=4\)"):
        make_spec(model, (x, y), nn.functional.mse_loss, single, 4, D=4)
    with pytest.raises(ValueError, match=r"P\*D=2\*64 CPU ranks is more than this machine can run"):
        make_spec(model, (torch.randn(128, 6), torch.randn(128, 3)), nn.functional.mse_loss, part, 2, D=64)
    with pytest.raises(ValueError, match=r"D=0 is invalid|D must be|D=0"):
        make_spec(model, (x, y), nn.functional.mse_loss, part, 2, D=0)
    with pytest.raises(ValueError, match=r"D=2 replicas cannot be combined with rebalance_every"):
        run(
            model,
            (x, y),
            nn.functional.mse_loss,
            part,
            2,
            steps=1,
            D=2,
            elastic=Elastic(rebalance_every=1),
            progress=False,
        )
    zb = partition(
        Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4), 2, method="uniform", v=2, schedule="ZBVZeroBubble", m=4
    )
    with pytest.raises(ValueError, match=r"D=2 replicas with schedule='ZBVZeroBubble' is not supported"):
        make_spec(model, (x, y), nn.functional.mse_loss, zb, 4, D=2)


def test_a_planned_p2_d2_row_runs_as_is():
    import pipeswift_lab as psl
    from pipeswift_lab.runner import global_batch_of, run_arguments

    profile = Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4, meta={"batch_size": 1})
    plan = psl.plan(profile, 4, 8, 10, P=2, schedules=["1F1B"], exhaustive=True, progress=False)
    row = plan.table[(plan.table["D"] == 2) & (plan.table["P"] == 2) & plan.table["simulated"]].index[0]
    config = plan.config(row)
    args = run_arguments(plan, row)
    assert args.keys() == plan.run_arguments(row).keys() and args["D"] == 2  # the Plan's own method gives the same
    assert args["D"] == 2 and args["partition"].P == 2 and args["m"] == config.m
    model = make_model(4)
    x, y = global_batch()
    assert global_batch_of(config) == len(x)
    result = run(
        model,
        (x, y),
        nn.functional.mse_loss,
        steps=2,
        optimizer=optimizer,
        progress=False,
        launch=Launch(timeout_s=120),
        **args,
    )
    want_state, _ = one_process(model, x, y, config.m * config.D, 2)
    assert_same_parameters(result.state_dict(), want_state)
    from pipeswift_lab.fidelity.comparison import _one_step, compare

    comparison = compare(
        psl.simulate(args["partition"], args["m"]), result
    )  # one replica's pipeline against the prediction
    assert comparison.step_ms[1] > 0
    one = _one_step(result.timeline.df, 1)
    compute = result.timeline.df.query("step == 1 and kind in ['F', 'B']")
    assert set(one["replica"]) == {0} and len(one) == len(compute) // 2
    assert len(comparison.replayed.df.query("kind in ['F', 'B']")) == len(one)  # the replay is replica 0's step too


def test_replicas_checkpoint_and_resume_on_another_d(tmp_path):
    """Replica 0 saves the replicated state (once); the same D resumes it by reading each rank's file, any D by name
    through DCP."""
    model = make_model(4)
    x, y = global_batch()
    part = partition(Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4), 2, method="uniform", schedule="1F1B", m=2)
    first = run(
        model,
        (x, y),
        nn.functional.mse_loss,
        part,
        2,
        steps=1,
        optimizer=optimizer,
        progress=False,
        checkpoint=tmp_path / "ck",
        launch=Launch(timeout_s=120),
        D=2,
    )
    assert first.checkpoint is not None
    want_state, _ = one_process(model, x, y, 4, 2)
    again = run(
        model,
        (x, y),
        nn.functional.mse_loss,
        part,
        2,
        steps=2,
        optimizer=optimizer,
        progress=False,
        launch=Launch(timeout_s=120),
        D=2,
        resume_from=tmp_path / "ck",
    )
    assert again.first_step == 1 and again.meta["restore_read"] == "direct"
    assert_same_parameters(again.state_dict(), want_state)
    single = run(
        model,
        (x, y),
        nn.functional.mse_loss,
        part,
        4,
        steps=2,
        optimizer=optimizer,
        progress=False,
        launch=Launch(timeout_s=120),
        resume_from=tmp_path / "ck",
    )  # D=1: m=4 micro-batches of the same global batch
    assert_same_parameters(single.state_dict(), want_state)
