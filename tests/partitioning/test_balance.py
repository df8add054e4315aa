import itertools
import math

import matplotlib
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeswift_lab import analytic, models
from pipeswift_lab.core.link import Link
from pipeswift_lab.core.precision import OPTIMIZER_STATES
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.partitioning.bottleneck import Infeasible, MinMaxSplit
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.measure import profile
from pipeswift_lab.profiling.table import Profile

matplotlib.use("Agg")


def gpt_like(n_blocks=6):
    """Embedding, equal blocks, a heavy LM head: the shape of the reference GPT."""
    fwd = [0.5] + [4.0] * n_blocks + [16.0]
    bwd = [1.0] + [8.0] * n_blocks + [30.0]
    return Profile.synthetic(
        fwd_ms=fwd,
        bwd_ms=bwd,
        params=[1000] + [500] * n_blocks + [2000],
        param_bytes=[4000] + [2000] * n_blocks + [8000],
        activation_bytes=[10] + [100] * n_blocks + [50],
        output_bytes=[262144] * (n_blocks + 1) + [16777216],
        name=["embed"] + [f"block_{i}" for i in range(n_blocks)] + ["head"],
    )


def brute_force(costs, n, K, fits=lambda k, a, b: True):
    """Smallest bottleneck over every contiguous split of n layers into K stages (and its bounds)."""
    best = (math.inf, None)
    for cuts in itertools.combinations(range(1, n), K - 1):
        edges = (0,) + cuts + (n,)
        bounds = list(zip(edges[:-1], edges[1:]))
        if all(fits(k, a, b) for k, (a, b) in enumerate(bounds)):
            best = min(best, (max(costs(a, b) for a, b in bounds), tuple(bounds)))
    return best


def test_uniform_spreads_the_remainder():
    prof = Profile.synthetic(fwd_ms=[1.0] * 10, bwd_ms=[1.0] * 10)
    assert partition(prof, 4, method="uniform").bounds == ((0, 3), (3, 6), (6, 8), (8, 10))
    assert partition(prof, 5, method="uniform").bounds == tuple((2 * i, 2 * i + 2) for i in range(5))
    assert partition(prof, 10, method="uniform").bounds == tuple((i, i + 1) for i in range(10))


def test_balanced_beats_uniform_on_the_heavy_head():
    prof = gpt_like()
    uniform = partition(prof, 4, method="uniform")
    balanced = partition(prof, 4)
    assert uniform.bounds == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert uniform.bottleneck_ms == 12.0 + 46.0
    assert balanced.bottleneck_ms == 46.0  # the head alone: nothing can be faster
    assert balanced.bounds[-1] == (7, 8)
    assert balanced.imbalance < uniform.imbalance
    assert balanced.layer_names[-1] == ("head",)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9), st.integers(0, 5)), min_size=1, max_size=8),
    st.integers(1, 8),
    st.booleans(),
)
def test_balanced_is_exactly_optimal(layers, K, with_link):
    n = len(layers)
    K = min(K, n)
    fwd = [float(f) for f, _, _ in layers]
    bwd = [float(b) / 2 for _, b, _ in layers]
    out = [o * 1e6 for _, _, o in layers]
    prof = Profile.synthetic(fwd_ms=fwd, bwd_ms=bwd, output_bytes=out)
    link = Link(0.25, 2.0) if with_link else None
    part = partition(prof, K, link=link)
    c = [link.transfer_ms(o) if link else 0.0 for o in out]
    t = [f + b for f, b in zip(fwd, bwd)]

    def cost(a, b):
        return sum(t[a:b]) + (c[b - 1] if b < n else 0.0) + (c[a - 1] if a > 0 else 0.0)

    best, _ = brute_force(cost, n, K)
    assert part.bottleneck_ms == pytest.approx(best, abs=1e-9)
    assert part.stage_comm_ms == tuple(pytest.approx(cost(a, b) - sum(t[a:b])) for a, b in part.bounds)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 100), min_size=2, max_size=8), st.integers(1, 8))
def test_params_method_minimizes_the_largest_stage(params, K):
    n = len(params)
    K = min(K, n)
    prof = Profile.synthetic(fwd_ms=[1.0] * n, bwd_ms=[1.0] * n, params=params)
    part = partition(prof, K, method="params")
    best, _ = brute_force(lambda a, b: sum(params[a:b]), n, K)
    assert max(part.stage_params) == best


def test_multi_chunk_placement():
    prof = Profile.synthetic(fwd_ms=[1.0] * 12, bwd_ms=[2.0] * 12)
    inter = partition(prof, 3, v=2, schedule="Interleaved1F1B", method="uniform")
    assert inter.stage_to_rank == (0, 1, 2, 0, 1, 2)
    assert inter.bounds == tuple((2 * i, 2 * i + 2) for i in range(6))
    vshape = partition(prof, 3, v=2, schedule="ZBVZeroBubble")
    assert vshape.stage_to_rank == (0, 1, 2, 2, 1, 0)
    assert partition(prof, 3, v=2).stage_to_rank == (0, 1, 2, 0, 1, 2)


def test_memory_per_stage_by_hand():
    prof = gpt_like()
    part = partition(prof, 4, method="uniform", schedule="1F1B", m=8)
    inflight = analytic.inflight_microbatches(4, 8, "1F1B")
    assert part.stage_inflight == tuple(inflight) == (4.0, 3.0, 2.0, 1.0)
    # stage 0: embed + block_0 = 6000 param bytes x (weights + grads + 2 Adam moments); 110 activation bytes x 4
    assert part.stage_mem_bytes[0] == 6000 * 4 + 110 * 4
    sgd = partition(prof, 4, method="uniform", schedule="1F1B", m=8, optimizer="sgd")
    assert sgd.stage_mem_bytes[0] == 6000 * 2 + 110 * 4
    assert OPTIMIZER_STATES["sgd_momentum"] == 1.0
    # a rank's peak replays its actions (pipeswift_lab.core.memory_model): rank 0 peaks at its 5th forward, holding
    # 4 micro-batches' activations and outputs (110 + 262144 bytes each) and its 8 gradient receive buffers
    mem = part.memory()
    assert part.rank_mem_bytes == tuple(mem["predicted_peak_bytes"])
    assert mem.loc[0, "peak_at"] == "F stage 0 mb 4" and mem.loc[0, "grads_bytes"] == 6000
    assert mem.loc[0, "activations_bytes"] == 4 * (110 + 262144) and mem.loc[0, "buffers_bytes"] == 8 * 262144
    assert mem.loc[0, "predicted_peak_bytes"] == 6000 * 4 + 4 * (110 + 262144) + 8 * 262144
    # the last rank peaks in its second backward, the first with whole gradients (every later one is as full: torch
    # drops a receive buffer's gradient once it is sent): the 16 MiB gradient of the head's output on top of the rest
    assert mem.loc[3, "peak_at"] == "B stage 3 mb 1" and mem.loc[3, "transient_bytes"] == 16777216
    df = part.df
    assert df["mem_bytes"].tolist() == list(part.stage_mem_bytes)
    assert df[["start", "end"]].to_numpy().tolist() == [list(b) for b in part.bounds]


def test_memory_cap_gives_the_best_split_that_fits():
    # heavy layers 0..2 in time, heavy layer 5 in parameters: the fastest split does not fit
    fwd = [3.0, 3.0, 3.0, 1.0, 1.0, 1.0]
    pbytes = [10.0, 10.0, 10.0, 10.0, 10.0, 200.0]
    prof = Profile.synthetic(fwd_ms=fwd, bwd_ms=fwd, param_bytes=pbytes, activation_bytes=[1.0] * 6)
    free = partition(prof, 2, m=2, optimizer="sgd")
    # plain SGD: rank 0 peaks in its first backward (weights 20, both micro-batches' 2 activation bytes, and the
    # gradients of layers 0..1 as they appear, less the activation layer 1 frees: 20 + 4 + 20 - 1)
    assert free.bounds == ((0, 2), (2, 6)) and free.rank_mem_bytes[0] == 43.0
    cap = 450  # rank 1 can hold layers 3..5 but not 2..5
    capped = partition(prof, 2, m=2, mem_per_gpu_bytes=cap, optimizer="sgd")
    assert capped.bounds == ((0, 3), (3, 6)) and max(capped.rank_mem_bytes) <= cap

    def fits(k, a, b):
        whole = ((0, a), (a, b)) if k == 1 else ((a, b), (b, 6))
        if whole[0][1] == 0 or whole[-1][0] == 6:
            return True  # the other stage is empty: only this one is judged
        return Partition.from_bounds(prof, whole, m=2, optimizer="sgd").rank_mem_bytes[k] <= cap

    best, bounds = brute_force(lambda a, b: 2 * sum(fwd[a:b]), 6, 2, fits)
    assert capped.bottleneck_ms == best
    assert capped.bottleneck_ms >= free.bottleneck_ms
    assert partition(prof, 2, m=2, mem_per_gpu_bytes=10 * cap, optimizer="sgd").bounds == free.bounds


def test_a_cap_no_split_meets_names_the_stage_and_the_smallest_P():
    prof = Profile.synthetic(fwd_ms=[1.0] * 8, bwd_ms=[2.0] * 8, param_bytes=[200.0] * 8, activation_bytes=[0.0] * 8)
    # each layer needs 400 bytes with plain SGD (weights and gradients); 2 ranks of 4 layers need 1600 each
    sgd = {"optimizer": "sgd"}
    with pytest.raises(
        ValueError,
        match=r"stage 0 \(layers 0\.\.3: layer_0\.\.layer_3, rank 0\) needs 1600 bytes.*smallest P that fits .* is 4",
    ):
        partition(prof, 2, mem_per_gpu_bytes=800, **sgd)
    with pytest.raises(ValueError, match="smallest P that fits .* is 4"):
        partition(prof, 2, method="uniform", mem_per_gpu_bytes=800, **sgd)
    with pytest.raises(ValueError, match="No P up to 8 fits"):
        partition(prof, 2, mem_per_gpu_bytes=300, **sgd)
    assert partition(prof, 4, mem_per_gpu_bytes=800, **sgd).bounds == tuple((2 * i, 2 * i + 2) for i in range(4))


def test_a_cap_no_split_meets_names_the_fullest_rank_and_counts_gradients_of_a_layer_alone():
    # the head's stage is the smallest in steady bytes (410 against 1800) but its rank peaks highest once the loss's
    # logits and transients are replayed (2464 against 1860): the error names the head's stage, not stage 0
    prof = Profile.synthetic(
        fwd_ms=[1.0, 1.0, 1.0, 3.0],
        bwd_ms=[2.0, 2.0, 2.0, 6.0],
        param_bytes=[100.0] * 4,
        activation_bytes=[100.0, 100.0, 100.0, 10.0],
        output_bytes=[10.0, 10.0, 10.0, 4.0],
        name=["embed", "block_0", "block_1", "head"],
        meta={"batch_size": 1, "loss_activation_bytes": 1000.0, "loss_transient_bytes": 1000.0},
    )
    free = partition(prof, 2, schedule="1F1B", m=4)
    assert free.bounds == ((0, 3), (3, 4)) and free.stage_mem_bytes[0] > free.stage_mem_bytes[1]
    assert free.rank_mem_bytes[1] > free.rank_mem_bytes[0]
    cap = 0.95 * free.rank_mem_bytes[1]
    with pytest.raises(ValueError) as err:
        partition(prof, 2, schedule="1F1B", m=4, mem_per_gpu_bytes=cap)
    text = str(err.value)
    assert "stage 1 (layers 3..3: head, rank 1)" in text and "its rank, 1, the fullest, peaks at 2464 bytes" in text
    # the head alone, one micro-batch in flight after a first backward: weights, gradients (100 bytes, allocated by
    # then), Adam's two moments, the loss's logits and the backward's transient; at most its rank's replayed peak
    # (which adds the receive buffers), and more than the cap
    alone = float(text.split("alone needs at least ")[1].split(" bytes")[0])
    assert "grads 100," in text and "more than the cap" in text
    assert cap < alone <= free.rank_mem_bytes[1]


def test_from_bounds_checks_hand_written_splits():
    prof = gpt_like()
    part = Partition.from_bounds(prof, [(0, 3), (3, 7), (7, 8)])
    assert part.P == 3 and part.method == "manual"
    assert part.stage_fwd_ms == (8.5, 16.0, 16.0)
    for bounds, words in [
        ([(0, 3), (4, 8)], "must start at 3"),
        ([(0, 3), (3, 3), (3, 8)], "empty"),
        ([(0, 3), (3, 7)], "must end at 8"),
        ([(1, 8)], "must start at 0"),
        ([], "empty"),
        ([(0, 4), (4, 8), (8, 8)], "empty"),
        ([(0, 2), (2, 5), (5, 8)], "multiple of v=2"),
    ]:
        with pytest.raises(ValueError, match=words):
            Partition.from_bounds(prof, bounds, v=2 if "multiple" in words else 1)
    with pytest.raises(TypeError, match="pair"):
        Partition.from_bounds(prof, [(0, 3, 4)])
    with pytest.raises(ValueError, match="rank 0 needs"):
        Partition.from_bounds(prof, [(0, 4), (4, 8)], mem_per_gpu_bytes=100)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(P=9), ValueError, "P=9 exceeds the 8 profiled layers"),
        (dict(P=3, v=3), ValueError, r"P\*v=3\*3=9 stages exceeds the 8"),
        (dict(P=0), ValueError, "P=0"),
        (dict(P=2, method="greedy"), ValueError, "method='greedy'"),
        (dict(P=2, optimizer="lion"), ValueError, "optimizer='lion'"),
        (dict(P=2, schedule="ZBVZeroBubble"), ValueError, "v=1 is not allowed"),
        (dict(P=4, schedule="1F1B", m=2), ValueError, "P=4, m=2"),
        (dict(P=2, mem_per_gpu_bytes=-1), ValueError, "mem_per_gpu_bytes=-1"),
        (dict(P=2, link="fast"), TypeError, "Link"),
    ],
)
def test_bad_arguments(kwargs, error, words):
    with pytest.raises(error, match=words):
        partition(gpt_like(), **kwargs)


def test_bad_profiles():
    with pytest.raises(ValueError, match="layer 1 .* has nan"):
        partition(pd.DataFrame({"fwd_ms": [1.0, math.nan], "bwd_ms": [1.0, 1.0]}), 2)
    with pytest.raises(ValueError, match="fwd_ms and bwd_ms"):
        partition(pd.DataFrame({"fwd_ms": [1.0]}), 1)
    with pytest.raises(TypeError, match="Profile or a pandas DataFrame"):
        partition([1.0, 2.0], 1)
    with pytest.raises(ValueError, match="'params' column"):
        partition(pd.DataFrame({"fwd_ms": [1.0, 2.0], "bwd_ms": [1.0, 1.0]}), 2, method="params")
    with pytest.raises(ValueError, match="output_bytes"):
        partition(pd.DataFrame({"fwd_ms": [1.0, 2.0], "bwd_ms": [1.0, 1.0]}), 2, link=Link(0, 1))


def test_a_plain_dataframe_works_like_a_profile():
    prof = gpt_like()
    assert partition(prof.df, 3).bounds == partition(prof, 3).bounds
    shuffled = prof.df.sample(frac=1.0, random_state=0)
    assert partition(shuffled, 3).bounds == partition(prof, 3).bounds  # the 'layer' column orders the rows


def test_a_measured_profile_of_a_real_model():
    setup = models.reference("mlp", batch_size=4)
    prof = profile(
        setup.model, setup.inputs, target=setup.targets, loss_fn=setup.loss_fn, warmup=1, repeats=3, progress=False
    )
    part = partition(prof, 2)
    assert part.n_layers == prof.n_layers
    assert sum(part.stage_params) == int(prof.df["params"].sum())
    assert part.stage_ms == pytest.approx(
        tuple(prof.df["fwd_ms"].iloc[a:b].sum() + prof.df["bwd_ms"].iloc[a:b].sum() for a, b in part.bounds)
    )
    assert part.bottleneck_ms <= partition(prof, 2, method="uniform").bottleneck_ms + 1e-12


def test_large_profiles_split_fast_and_exactly():
    rng = np.random.default_rng(0)
    n = 1000
    prof = Profile.synthetic(fwd_ms=rng.uniform(0.5, 2, n), bwd_ms=rng.uniform(1, 4, n))
    part = partition(prof, 64)
    t = (prof.df["fwd_ms"] + prof.df["bwd_ms"]).to_numpy()
    # lower bound: no split beats the mean stage or the heaviest layer
    assert part.bottleneck_ms >= max(t.sum() / 64, t.max())
    # optimality certificate: a bottleneck just below the found one (beyond float rounding) is infeasible
    limit = part.bottleneck_ms * (1 - 1e-12)
    stages, acc = 1, 0.0
    for x in t:
        if acc + x > limit:
            stages, acc = stages + 1, x
        else:
            acc += x
    assert stages > 64


def test_display():
    part = partition(gpt_like(), 3)
    ax = part.plot()
    assert len(ax.patches) == 2 * 3
    assert "imbalance" in ax.get_title()
    html = part._repr_html_()
    assert "Partition: 3 stages of 8 layers" in html and "bottleneck_ms" in html
    assert "Partition [(0," in str(part)
    assert part.stage_table().columns.tolist() == ["fwd_ms", "bwd_ms", "output_bytes", "activation_bytes"]


def test_bottleneck_shortcut_for_prefix_sums_matches_the_range_maximum():
    """Without transfers the window maximum is read off the last reachable start; it must equal the sparse-table
    answer."""
    from pipeswift_lab.partitioning.bottleneck import MinMaxSplit

    rng = np.random.default_rng(3)
    for trial in range(20):
        n, K = int(rng.integers(5, 60)), int(rng.integers(2, 6))
        S = np.concatenate([[0.0], np.cumsum(rng.uniform(0, 3, n))])
        lo_by_k = [
            np.minimum(np.arange(n + 1), np.maximum(0, np.arange(n + 1) - int(rng.integers(1, n)))) for _ in range(K)
        ]
        fast, slow = MinMaxSplit(S, S, K, lo_by_k), MinMaxSplit(S, S, K, lo_by_k)
        slow.monotone = False
        assert fast.monotone
        for T in np.linspace(0, S[-1], 15):
            a, b = fast.reach(T), slow.reach(T)
            assert (a is None) == (b is None), (trial, T)
            if a is not None:
                assert np.array_equal(a, b)
        try:
            assert fast.solve() == slow.solve()
        except Exception as error:  # both infeasible alike
            with pytest.raises(type(error)):
                slow.solve()


def test_the_memory_cap_has_one_name():
    prof = Profile.synthetic(fwd_ms=[1.0] * 4, bwd_ms=[2.0] * 4, param_bytes=[100.0] * 4, activation_bytes=[10.0] * 4)
    assert partition(prof, 2, mem_per_gpu_bytes=1e6).mem_per_gpu_bytes == 1e6
    with pytest.raises(TypeError, match="unexpected keyword argument 'mem_limit_bytes'"):
        partition(prof, 2, mem_limit_bytes=1e6)
    with pytest.raises(ValueError, match="mem_per_gpu_bytes=0.0 is invalid"):
        partition(prof, 2, mem_per_gpu_bytes=0)


def bisected(split):
    """:meth:`MinMaxSplit.solve` without its early stop: the bisection run down to adjacent floats."""
    reach = split.reach(float(np.max(split.U) - np.min(split.D)))
    if reach is None:
        raise Infeasible
    best = split.backtrack(reach, float(np.max(split.U) - np.min(split.D)))
    hi, lo = split.max_cost(best), -1.0
    while float(np.nextafter(hi, -np.inf)) > lo:
        mid = lo + (hi - lo) / 2
        if not (lo < mid < hi):
            mid = float(np.nextafter(hi, -np.inf))
        reach = split.reach(mid)
        if reach is None:
            lo = mid
        else:
            best = split.backtrack(reach, mid)
            hi = split.max_cost(best)
    return best, hi


@settings(max_examples=150, deadline=None)
@given(
    times=st.lists(st.one_of(st.integers(0, 3).map(float), st.floats(0, 10)), min_size=1, max_size=24),
    data=st.data(),
)
def test_the_bisection_stops_early_with_the_answer_it_would_reach(times, data):
    """Once no stage cost below the best bottleneck is feasible the solver stops: same bounds, same bottleneck, with
    or without memory windows, with or without transfers (non-monotone starts)."""
    n = len(times)
    K = data.draw(st.integers(1, n))
    S = np.concatenate([[0.0], np.cumsum(times)])
    transfer = np.concatenate([[0.0], data.draw(st.lists(st.floats(0, 2), min_size=n - 1, max_size=n - 1)), [0.0]])
    U, D = (S + transfer, S - transfer) if data.draw(st.booleans()) else (S, S)
    windows = None
    if data.draw(st.booleans()):
        starts = st.lists(st.integers(0, n), min_size=n + 1, max_size=n + 1)
        windows = [np.maximum.accumulate(np.minimum(np.arange(n + 1), data.draw(starts))) for _ in range(K)]
    split = MinMaxSplit(U, D, K, windows)
    try:
        want = bisected(split)
    except Infeasible:
        with pytest.raises(Infeasible):
            split.solve()
        return
    assert split.solve() == want
