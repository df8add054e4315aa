"""Per-rank figures of an interleaved partition: a rank holding v stages works through all of them per micro-batch,
so its time is the sum of its stages', and the per-stage figures keep their per-stage meaning."""

import matplotlib
import pytest

from pipeswift_lab.core.link import Link
from pipeswift_lab.partitioning.balance import partition
from pipeswift_lab.partitioning.stages import Partition
from pipeswift_lab.profiling.table import Profile

matplotlib.use("Agg")


def skewed(n=8):
    """Layer costs that rise along the model, so the two stages of one rank differ."""
    return Profile.synthetic(
        fwd_ms=[1.0 + i for i in range(n)],
        bwd_ms=[2.0 + 2 * i for i in range(n)],
        output_bytes=[1e6] * n,
    )


def test_an_interleaved_rank_is_the_sum_of_its_stages():
    part = Partition.from_bounds(skewed(), [(0, 1), (1, 2), (2, 3), (3, 8)], v=2, schedule="Interleaved1F1B", m=4)
    assert part.P == 2 and part.stage_to_rank == (0, 1, 0, 1)
    stage = part.stage_ms  # (1+2), (2+4), (3+6), (4+5+6+7+8) + 2*(4+5+6+7+8)
    assert stage == pytest.approx((3.0, 6.0, 9.0, 90.0))
    assert part.rank_ms == pytest.approx((stage[0] + stage[2], stage[1] + stage[3]))  # 12 and 96
    assert part.bottleneck_rank_ms == pytest.approx(96.0) and part.bottleneck_ms == pytest.approx(90.0)
    assert part.imbalance == pytest.approx(90.0 / (108.0 / 4))  # the slowest stage over the mean stage
    assert part.rank_imbalance == pytest.approx(96.0 / 54.0)  # the busiest rank over the mean rank
    assert part.rank_imbalance != pytest.approx(part.imbalance)
    card = repr(part)
    assert "bottleneck_rank_ms" in card and "rank_imbalance" in card
    assert "rank 1.78" in part.plot().get_title()


def test_transfers_count_in_the_rank_cost():
    part = Partition.from_bounds(
        skewed(),
        [(0, 2), (2, 4), (4, 6), (6, 8)],
        v=2,
        schedule="Interleaved1F1B",
        m=4,
        link=Link(bandwidth_GBps=1.0, latency_ms=0.5),
    )
    by_rank = {r: [s for s, rr in enumerate(part.stage_to_rank) if rr == r] for r in range(part.P)}
    for r, stages in by_rank.items():
        assert part.rank_cost_ms[r] == pytest.approx(sum(part.stage_cost_ms[s] for s in stages))
        assert part.rank_cost_ms[r] > part.rank_ms[r]
    assert part.bottleneck_rank_ms == pytest.approx(max(part.rank_cost_ms))


def test_one_stage_per_rank_gives_the_stage_figures():
    part = partition(skewed(), 4, method="balanced", schedule="1F1B", m=4)
    assert part.rank_ms == pytest.approx(part.stage_ms) and part.rank_cost_ms == pytest.approx(part.stage_cost_ms)
    assert part.bottleneck_rank_ms == part.bottleneck_ms and part.rank_imbalance == part.imbalance
    assert "rank_imbalance" not in repr(part)
