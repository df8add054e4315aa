"""Replay: a step re-simulated with its own action durations."""

import pandas as pd
import pytest

from pipeswift_lab.core.link import Link
from pipeswift_lab.fidelity.replays import replay
from pipeswift_lab.simulation.simulator import simulate
from pipeswift_lab.simulation.timeline import Timeline

STAGES = pd.DataFrame({"fwd_ms": [1.0, 2.0, 1.5, 2.5], "bwd_ms": [2.0, 4.0, 3.0, 5.0], "output_bytes": [1e6] * 4})


@pytest.mark.parametrize("schedule,v", [("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)])
def test_replaying_a_simulated_step_gives_it_back(schedule, v):
    table = STAGES if v == 2 else STAGES.iloc[:2]
    tl = simulate(table, 4, schedule, v=v)
    back = replay(tl, 0)
    assert back.step_ms == pytest.approx(tl.step_ms)
    cols = ["rank", "stage", "microbatch", "kind", "start_ms", "end_ms"]
    pd.testing.assert_frame_equal(back.df[cols].reset_index(drop=True), tl.df[cols].reset_index(drop=True))


def test_replay_uses_the_measured_durations_transfers_and_gap():
    tl = simulate(STAGES.iloc[:2], 2, "1F1B")
    slow = tl.df.copy()
    slow.loc[(slow["stage"] == 1) & (slow["kind"] == "F"), "end_ms"] += 10.0  # one stage's forwards took 10 ms longer
    measured = Timeline(slow, source="measured", meta=tl.meta)
    assert replay(measured, 0).step_ms == pytest.approx(
        tl.step_ms + 2 * 10.0
    )  # both forwards of stage 1 are on the critical path
    linked = simulate(STAGES.iloc[:2], 2, "1F1B", link=Link(latency_ms=0.5, bandwidth_GBps=1e12))  # 0.5 ms per transfer
    assert (
        replay(tl, 0, transfer_ms=[0.5, 0.0]).step_ms == pytest.approx(linked.step_ms, abs=1e-6)
        and linked.step_ms > tl.step_ms
    )
    assert replay(tl, 0, gap_ms=1.0).step_ms > tl.step_ms
    assert replay(tl, 0, step_overhead_ms=7.0).meta["step_overhead_ms"] == 7.0
    with pytest.raises(ValueError, match="meta lacks"):
        replay(Timeline(tl.df, source="measured"), 0)
    with pytest.raises(ValueError, match="step=3 has no compute actions"):
        replay(tl, 3)
    with pytest.raises(ValueError, match="transfer_ms has 1 values"):
        replay(tl, 0, transfer_ms=[1.0])
