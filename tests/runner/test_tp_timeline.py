"""Tensor parallelism's collectives on the measured timeline: one ``TP_*`` row per collective, forward and backward,
per stage and micro-batch, nested in the action that ran it, as many as the plan's styles run; timed from the
functional collectives DTensor calls (:mod:`pipeswift_lab.runner.rank.tp_comm`)."""

import fnmatch
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import pipeswift_lab as psl
from pipeswift_lab.core.vocabulary import KINDS, TP_COLLECTIVE, TP_KINDS
from pipeswift_lab.models import GPT_TP_PLAN, gpt, gpt_batch, lm_loss
from pipeswift_lab.runner.rank import tp_comm
from pipeswift_lab.runner.rank.instrument import ActionRecorder, unsharded_bytes
from pipeswift_lab.runner.run_files import KINDS as CODED_KINDS

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

GPT = dict(vocab_size=64, seq_len=8, d_model=32, n_layers=2, n_heads=4)
#: The collectives each torch style of GPT_TP_PLAN runs: (forward, backward). A column cut takes the whole input, so
#: its backward all-reduces the input's gradient; a row cut's output is partial, so its forward all-reduces it; a
#: gathered output all-gathers in the forward; a split input all-gathers its gradient. The embedding's input (token
#: ids) has no gradient.
STYLE_COLLECTIVES = {
    "embedding_rowwise": ({"all_reduce": 1}, {}),
    "colwise_gather_output": ({"all_gather": 1}, {"all_reduce": 1}),
    "rowwise_split_input": ({"all_reduce": 1}, {"all_gather": 1}),
    "colwise": ({}, {"all_reduce": 1}),
    "rowwise": ({"all_reduce": 1}, {}),
}


def planned(model, layers):
    """``{"F": Counter, "B": Counter}``: the collectives one micro-batch's forward and backward run in ``layers``."""
    out = {"F": Counter(), "B": Counter()}
    for name, _ in model.named_modules():
        if name.split(".")[0] not in layers:
            continue
        for glob, style in GPT_TP_PLAN.items():
            if fnmatch.fnmatchcase(name, glob):
                forward, backward = STYLE_COLLECTIVES[style]
                out["F"].update(forward)
                out["B"].update(backward)
    return out


def test_the_tp_kinds_are_coded_after_the_others():
    assert CODED_KINDS[:6] == ("F", "B", "I", "W", "REDUCE_GRAD", "UNSHARD")  # recorded codes never change meaning
    assert CODED_KINDS[6:] == TP_KINDS and set(TP_KINDS) <= set(KINDS) and set(TP_COLLECTIVE) == set(TP_KINDS)


@pytest.fixture
def one_rank_group():
    """A one-process gloo group: its functional collectives run (and complete) in this process."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    tp_comm.uninstall()
    dist.destroy_process_group()


def test_the_timer_times_functional_and_group_collectives_inside_an_action_only(one_rank_group):
    rows = []
    clock = iter(range(100, 10_000, 10))
    timer = tp_comm.TPCommTimer(lambda: next(clock), lambda *row: rows.append(row), one_rank_group.group_name)
    originals = (funcol.all_reduce, funcol.wait_tensor, dist.all_reduce)
    tp_comm.install(timer)
    x = torch.ones(4, 3)
    funcol.all_reduce(x, "sum", one_rank_group).wait()  # no action running: not timed
    timer.begin(stage=2, microbatch=5)
    reduced = funcol.all_reduce(x, "sum", one_rank_group)
    assert rows == []  # issued, not yet waited
    assert torch.equal(reduced + 0, x)  # first use waits
    gathered = funcol.all_gather_single(x, 0, one_rank_group)
    dist.all_reduce(x, group=one_rank_group)  # the tensor-parallel group's blocking call
    timer.finish(end=9_999)  # the gather was never used: it ends with the action
    assert torch.equal(gathered.wait(), x)
    kinds = [(kind, stage, mb, nbytes) for kind, stage, mb, _, _, nbytes in rows]
    assert kinds == [("TP_ALL_REDUCE", 2, 5, 48), ("TP_ALL_REDUCE", 2, 5, 48), ("TP_ALL_GATHER", 2, 5, 48)]
    assert all(start < end for _, _, _, start, end, _ in rows) and rows[-1][4] == 9_999
    tp_comm.uninstall()
    assert (funcol.all_reduce, funcol.wait_tensor, dist.all_reduce) == originals


def test_a_shard_to_shard_all_to_all_is_one_row_whatever_it_runs_inside(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import placement_types

    rows = []
    clock = iter(range(100, 10_000, 10))
    timer = tp_comm.TPCommTimer(lambda: next(clock), lambda *row: rows.append(row), None)
    tp_comm.install(timer)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    x = torch.arange(12.0).reshape(3, 4)
    timer.begin(stage=0, microbatch=1)
    out = placement_types.shard_dim_alltoall(x, 0, 1, mesh, 0)  # gloo has no all-to-all: an all-gather inside
    dist.all_reduce(x, group=one_rank_group)  # not the tensor-parallel group (None here): not timed
    timer.finish(end=9_999)
    assert torch.equal(out, x)
    assert [(kind, stage, mb, nbytes) for kind, stage, mb, _, _, nbytes in rows] == [("TP_ALL_TO_ALL", 0, 1, 48)]
    assert tp_comm.tp_group_name([torch.nn.Linear(2, 2)]) is None


def test_rows_carry_bytes_only_when_asked():
    rec = ActionRecorder([], None, torch.device("cpu"), enabled=False)
    assert rec.rows().shape == (0, 6) and rec.rows(with_bytes=True).shape == (0, 7) and rec.tp is None
    linear = torch.nn.Linear(3, 2)
    assert unsharded_bytes(linear) == (3 * 2 + 2) * 4


@pytest.mark.processes
def test_every_micro_batch_forward_and_backward_records_its_planned_collectives_inside_its_action():
    x, y = gpt_batch(4, GPT["seq_len"], GPT["vocab_size"])
    prof = psl.profile(gpt(**GPT), x[:2], progress=False)
    part = psl.partition(prof, P=1, v=2, schedule="Interleaved1F1B")  # two stages on one pipeline rank
    m = 2
    result = psl.run(gpt(**GPT), (x, y), lm_loss, part, m, schedule="Interleaved1F1B", tp=2, steps=2, progress=False)
    df = result.timeline.df
    assert set(df["kind"]) == {"F", "B", "TP_ALL_REDUCE", "TP_ALL_GATHER"}
    tp = result.tp_collectives
    assert len(tp) == df["kind"].isin(TP_KINDS).sum() and tp["phase"].notna().all()  # each inside its F or B
    assert (tp["ms"] > 0).all()
    names, model = result.meta["layer_names"], gpt(**GPT)
    for stage, (a, b) in enumerate(result.meta["bounds"]):
        want = planned(model, set(names[a:b]))
        for step in result.measured_steps:
            for mb in range(m):
                mine = tp[(tp["step"] == step) & (tp["stage"] == stage) & (tp["microbatch"] == mb)]
                for phase in ("F", "B"):
                    got = Counter(mine.loc[mine["phase"] == phase, "collective"])
                    assert got == want[phase], (stage, step, mb, phase)
    per_step = tp.groupby("step")["ms"].sum()
    assert 0 < result.tp_comm_ms <= per_step.max()
    assert result.tp_comm_ms < result.steady_step_ms
    ax = result.plot()
    assert "TP collective" in ax.get_legend_handles_labels()[1]
