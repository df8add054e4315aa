"""plan(..., recompute="search") (pipeswift_lab.planning.recompute_search): where memory binds, each stage's
recomputation is chosen with the split, for the least time that fits; the plan carries it to run()."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pipeswift_lab import Profile
from pipeswift_lab.core.memory_model import default_optimizer_memory
from pipeswift_lab.models import reference
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.planning.planner import plan
from pipeswift_lab.planning.recompute_search import recompute_splits
from pipeswift_lab.profiling.measure import profile
from pipeswift_lab.runner import run

# one intra-op thread (tests/conftest.py): the profiles measured here are held to their bytes, which threads do not
# change, and two threads contend on a loaded 2-core machine
pytestmark = pytest.mark.usefixtures("one_torch_thread")

GB = 1e9


def recomputable(layers=8):
    """Equal layers of 1 ms forward, 2 ms backward, 1 GB held per micro-batch: selective recomputation keeps half
    for 0.3 ms more, full keeps 5% for 1 ms more (selective saves more per millisecond)."""
    return Profile.synthetic(
        fwd_ms=[1.0] * layers,
        bwd_ms=[2.0] * layers,
        param_bytes=[1e8] * layers,
        activation_bytes=[1e9] * layers,
        output_bytes=[1e6] * layers,
        recompute_ms=[1.0] * layers,
        selective_recompute_ms=[0.3] * layers,
        full_activation_bytes=[5e7] * layers,
        selective_activation_bytes=[5e8] * layers,
        full_transient_bytes=[0.0] * layers,
        selective_transient_bytes=[0.0] * layers,
        meta={"batch_size": 1, "device": "cuda"},
    )


KW = dict(global_batch=8, steps=1000, schedules=["1F1B"], microbatch_sizes=[1], progress=False, exhaustive=True)


def rows_on(result, P):
    return result.feasible[(result.feasible["P"] == P) & (result.feasible["strategy"] == "now")]


def test_recomputation_fits_where_no_split_does_and_the_first_stages_recompute_more():
    """Under 1F1B the first of 4 ranks holds 4 micro-batches, the last 1: at 3.5 GB no split fits 4 GPUs (one layer
    on the first rank holds 4 GB), and with recomputation the first stages recompute, the last does not."""
    cap = 3.5 * GB
    with pytest.raises(ValueError, match=r'no feasible configuration(.|\n)*recompute="search"'):
        plan(recomputable(), gpus=4, mem_per_gpu_bytes=cap, **KW)
    searched = plan(recomputable(), gpus=4, mem_per_gpu_bytes=cap, recompute="search", **KW)
    best = rows_on(searched, 4).iloc[0]
    modes = {int(s): mode for s, mode in (item.split(":") for item in best["recompute"].split())}
    assert modes.get(0) == "full" and 3 not in modes, best["recompute"]
    levels = ["", "selective", "full"]
    assert [levels.index(modes.get(s, "")) for s in range(4)] == sorted(
        (levels.index(modes.get(s, "")) for s in range(4)), reverse=True
    ), "a later stage, holding fewer micro-batches, recomputes no more than an earlier one"
    assert best["peak_mem_bytes"] <= cap
    bounds = [tuple(int(x) for x in item.split("-")) for item in best["stage_bounds"].split()]
    assert bounds[0][0] == 0 and bounds[-1][1] == 8 and len(bounds) == 4
    replayed = Partition.from_bounds(
        recomputable().with_recompute({f"layer_{i}": mode for s, mode in modes.items() for i in range(*bounds[s])}),
        bounds,
        schedule="1F1B",
        m=8,
    )
    assert max(replayed.memory(micro_batch_size=1)["predicted_peak_bytes"]) == pytest.approx(best["peak_mem_bytes"])
    assert searched.best.label.endswith(f"recompute {best['recompute']}") or searched.best.P != 4


def test_the_search_takes_recomputation_only_where_it_is_faster_than_moving_layers():
    """At 6 GB a split that moves layers off the first rank fits; the plan weighs it against recomputing and the
    faster wins: no configuration of the searched plan is slower than the same one planned without recomputation."""
    cap = 6 * GB
    plain = plan(recomputable(), gpus=4, mem_per_gpu_bytes=cap, **KW)
    searched = plan(recomputable(), gpus=4, mem_per_gpu_bytes=cap, recompute="search", **KW)
    key = ["P", "D", "m", "microbatch_size", "schedule"]
    both = rows_on(plain, 4).merge(rows_on(searched, 4), on=key, suffixes=("_plain", "_searched"))
    assert not both.empty
    assert (both["step_ms_searched"] <= both["step_ms_plain"] * (1 + 1e-9)).all()
    unbound = plan(recomputable(), gpus=4, mem_per_gpu_bytes=100 * GB, recompute="search", **KW)
    assert (unbound.feasible["recompute"] == "").all(), "nothing recomputes where memory does not bind"


def test_recomputing_on_fewer_gpus_now_beats_waiting_for_more():
    """Two GPUs now, four in an hour: without recomputation P=2 does not fit and the plan waits; recomputing, it
    starts now, and its JCT is shorter."""
    kw = dict(KW, steps=20_000, availability=[(0, 2), (3600, 4)], gpus=4, mem_per_gpu_bytes=6 * GB)
    plain = plan(recomputable(), **kw)
    searched = plan(recomputable(), recompute="search", **kw)
    assert plain.best.queue_s == 3600 and plain.best.recompute == ""
    assert searched.best.P == 2 and searched.best.queue_s == 0 and searched.best.recompute
    assert searched.best.total_s < plain.best.total_s
    assert searched.best.recompute in searched.strategy_rows("now")["recompute"].tolist()


def split_arguments(prof, P):
    """recompute_splits' arguments but the cap: ``prof`` for times and bytes, P ranks of 1F1B, m=8, Adam on CUDA."""
    return dict(
        timing_table=prof.df,
        memory_table=prof.df,
        meta=prof.meta,
        scale=1.0,
        P=P,
        v=1,
        m=8,
        schedule="1F1B",
        optimizer=default_optimizer_memory("adam", "cuda"),
        precision=None,
        D=1,
    )


def test_every_split_is_lowered_where_it_fits_and_none_is_found_where_nothing_does():
    prof = recomputable()
    kwargs = split_arguments(prof, P=4)
    answers = recompute_splits(limit=3.5 * GB, **kwargs)
    assert answers and all(max(found.peaks) <= 3.5 * GB for found in answers)
    assert len({(found.bounds, found.modes) for found in answers}) == len(answers)
    levels = ("", "selective", "full")
    for found in answers:  # no stage recomputes more than its split needs: lowering any breaks it
        for s, mode in enumerate(found.modes):
            for lower in levels[: levels.index(mode)]:
                chosen = [lower if t == s else m for t, m in enumerate(found.modes)]
                layers = {f"layer_{i}": m for (a, e), m in zip(found.bounds, chosen) if m for i in range(a, e)}
                part = Partition.from_bounds(prof.with_recompute(layers or None), found.bounds, schedule="1F1B", m=8)
                assert max(part.memory(micro_batch_size=1)["predicted_peak_bytes"]) > 3.5 * GB, (s, lower)
    assert recompute_splits(limit=0.5 * GB, **kwargs) == []


def lopsided(layers=8):
    """The first half of the layers quick (0.1 ms forward), the second slow (1 ms), all alike in memory: a split
    balanced by time piles the quick ones, with their weights and optimizer state, onto the first rank."""
    quick = layers // 2
    slow = layers - quick
    return Profile.synthetic(
        fwd_ms=[0.1] * quick + [1.0] * slow,
        bwd_ms=[0.2] * quick + [2.0] * slow,
        param_bytes=[1e8] * layers,
        activation_bytes=[1e9] * layers,
        output_bytes=[1e6] * layers,
        recompute_ms=[0.1] * quick + [1.0] * slow,
        selective_recompute_ms=[0.03] * quick + [0.3] * slow,
        full_activation_bytes=[5e7] * layers,
        selective_activation_bytes=[5e8] * layers,
        full_transient_bytes=[0.0] * layers,
        selective_transient_bytes=[0.0] * layers,
        meta={"batch_size": 1, "device": "cuda"},
    )


def test_where_no_recomputation_of_a_time_balanced_split_fits_full_recomputation_fits_a_capped_split():
    """At 2.4 GB a time-balanced split holds 5 or 6 layers on the first rank, over the cap however they recompute;
    every stage recomputing fully on the split balanced within the cap (4 and 4 layers) fits, and the plan finds it."""
    prof = lopsided()
    kwargs = split_arguments(prof, P=2)
    answers = recompute_splits(limit=2.4 * GB, **kwargs)
    assert [(found.bounds, found.modes) for found in answers] == [(((0, 4), (4, 8)), ("full", "full"))]
    found = answers[0]
    layers = {f"layer_{i}": "full" for i in range(8)}
    replayed = Partition.from_bounds(prof.with_recompute(layers), found.bounds, schedule="1F1B", m=8)
    assert max(replayed.memory(micro_batch_size=1)["predicted_peak_bytes"]) == pytest.approx(max(found.peaks))
    assert max(found.peaks) <= 2.4 * GB
    # between this floor and the cap the greedy search meets alone (3.5 GB), every cap is met
    assert all(recompute_splits(limit=cap * GB, **kwargs) for cap in (2.2, 2.6, 2.8, 3.0, 3.5))
    assert recompute_splits(limit=1.5 * GB, **kwargs) == []
    with pytest.raises(ValueError, match="no feasible configuration"):
        plan(prof, gpus=2, mem_per_gpu_bytes=2.4 * GB, **KW)
    searched = plan(prof, gpus=2, mem_per_gpu_bytes=2.4 * GB, recompute="search", **KW)
    assert searched.best.P == 2 and searched.best.recompute == "0:full 1:full"


#: Per-layer times (ms) of notebook 13's GPT (embed, 6 blocks, head) as a loaded machine measured them.
LOADED_MS = {
    "fwd_ms": [0.20, 4.16, 4.26, 2.92, 4.92, 4.10, 3.28, 0.69],
    "bwd_ms": [0.14, 7.22, 6.10, 5.10, 7.79, 6.05, 6.38, 2.48],
    "recompute_ms": [0.32, 3.91, 3.53, 3.23, 3.78, 2.80, 2.23, 0.32],
    "selective_recompute_ms": [0.60, 3.44, 2.82, 3.37, 3.01, 2.99, 3.04, 0.63],
    "recompute_forward_ms": [0.10, 0.25, 0.12, 0.14, 0.02, 0.0, 0.05, 0.01],
    "selective_recompute_forward_ms": [0.26, 0.90, 0.97, 0.85, 0.83, 0.84, 0.87, 0.28],
    "input_pass_ms": [float("nan"), 5.53, 4.92, 4.18, 4.87, 3.83, 5.25, 0.94],
    "weight_pass_ms": [float("nan"), 3.47, 3.43, 2.03, 2.75, 2.78, 2.22, 0.82],
}


def test_a_looser_cap_never_plans_a_slower_step_than_a_tighter_one():
    """Notebook 13's GPT, its bytes profiled here and its times as a loaded machine measured them. At 20.2 MiB the
    greedy raise and every stage recomputing fully on the split balanced by those times both settle on stages 0-2
    2-4 4-5 5-8 recomputing 0, 1 and 3 (168.6 ms): its busiest rank is the least, but three stages recompute the
    most layers. At 15 MiB the split has to change to 0-2 2-4 4-6 6-8 with the last stage not recomputing, a
    shorter step (163.9 ms). The search at 20.2 MiB now also tries the splits tighter caps give, and keeps the
    shortest simulated step."""
    torch.manual_seed(0)
    gpt = reference("gpt", batch_size=4, vocab_size=512, seq_len=128, d_model=128, n_layers=6, n_heads=4)
    measured = profile(
        gpt.model,
        gpt.inputs,
        target=gpt.targets,
        loss_fn=gpt.loss_fn,
        warmup=0,
        repeats=1,
        progress=False,
        recompute=True,
    )
    df = measured.df.copy()
    for column, values in LOADED_MS.items():
        df[column] = values
    df["total_ms"] = df["fwd_ms"] + df["bwd_ms"]
    loaded = Profile(df, measured.meta)
    # P=4 alone: only its rows are read, and the other pipeline sizes do not change them (exhaustive search)
    kw = dict(KW, global_batch=16, microbatch_sizes=[4], optimizer="adam", gpus=4, P=[4], recompute="search")
    MiB = 2**20
    planned = {}
    for cap in (15.0, 17.5, 20.2, 22.5, 25.5):
        rows = plan(loaded, mem_per_gpu_bytes=cap * MiB, **kw).feasible
        planned[cap] = rows[rows["P"] == 4].iloc[0]
        assert planned[cap]["peak_mem_bytes"] <= cap * MiB
    steps = [row["step_ms"] for row in planned.values()]
    assert steps == sorted(steps, reverse=True), steps
    assert planned[20.2]["step_ms"] <= planned[15.0]["step_ms"]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(recompute="sometimes"), ValueError, r"recompute='sometimes' is not 'search' .*'full' or 'selective'"),
        (dict(recompute="search", mem_per_gpu_bytes=None), ValueError, r"needs mem_per_gpu_bytes"),
    ],
)
def test_bad_recompute_arguments_are_refused(kwargs, error, match):
    args = dict(KW, gpus=4, mem_per_gpu_bytes=3.5 * GB) | kwargs
    with pytest.raises(error, match=match):
        plan(recomputable(), **args)


def test_a_profile_without_the_recompute_columns_is_refused():
    prof = Profile.synthetic(
        fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4, activation_bytes=[1e9] * 4, meta={"device": "cuda", "batch_size": 1}
    )
    with pytest.raises(ValueError, match=r"profile the model with recompute=True"):
        plan(prof, gpus=2, mem_per_gpu_bytes=GB, recompute="search", **KW)


class Block(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.ln, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.ln(x))))


@pytest.mark.processes
def test_the_planned_recomputation_runs_as_planned():
    """A plan on a measured profile whose cap only recomputation meets on 2 GPUs: run(**plan.run_arguments(best))
    trains it, and every rank's measured peak is within 10% of what the plan predicted, under the cap."""
    torch.manual_seed(0)
    net = nn.Sequential(*[Block() for _ in range(6)])
    x, y = torch.randn(16, 64, 64), torch.randn(16, 64, 64)
    prof = profile(net, x[:2], target=y[:2], loss_fn=F.mse_loss, warmup=1, repeats=1, progress=False, recompute=True)
    kw = dict(gpus=2, global_batch=16, steps=100, schedules=["1F1B"], microbatch_sizes=[2], progress=False)

    def smallest_cap(recompute):  # bisected on the plan's feasibility at P = 2
        lo, hi = 1e5, 1e9
        for _ in range(16):
            mid = (lo + hi) / 2
            try:
                fits = (plan(prof, mem_per_gpu_bytes=mid, recompute=recompute, optimizer="adam", **kw).feasible["P"]
                        == 2).any()  # fmt: skip
            except ValueError:
                fits = False
            lo, hi = (lo, mid) if fits else (mid, hi)
        return hi

    floor, plain = smallest_cap("search"), smallest_cap(None)
    assert floor < 0.9 * plain, (floor, plain)
    cap = floor + 0.3 * (plain - floor)
    searched = plan(prof, mem_per_gpu_bytes=cap, recompute="search", optimizer="adam", **kw)
    best = searched.best
    assert best.P == 2 and best.recompute, searched.table[["P", "reason", "recompute"]]
    args = searched.run_arguments(best)
    assert args["recompute"] == best.recompute_by_stage() and args["m"] == 8
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-3)  # noqa: E731
    result = run(net, (x, y), F.mse_loss, steps=2, optimizer=adam, progress=False, **args)
    memory = result.memory
    assert (memory["error"].abs() <= 0.10).all(), memory[["rank", "error", "term_off"]]
    assert memory["measured_peak_bytes"].max() <= cap * 1.10
    assert max(memory["predicted_peak_bytes"]) == pytest.approx(best.peak_mem_bytes, rel=1e-6)
