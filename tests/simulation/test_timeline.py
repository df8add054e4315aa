import json

import matplotlib
import numpy as np
import pandas as pd
import pytest

from pipeswift_lab.core.link import Link
from pipeswift_lab.simulation.simulator import simulate
from pipeswift_lab.simulation.timeline import COLUMNS, Timeline

matplotlib.use("Agg")


def measured_two_steps():
    """Two measured steps of a 2-rank GPipe with m=1: step 0 spans 0-10 ms, step 1 spans 20-34 ms."""
    rows = [
        # step, rank, stage, mb, kind, start, end
        (0, 0, 0, 0, "F", 0.0, 2.0),
        (0, 1, 1, 0, "F", 2.0, 4.0),
        (0, 1, 1, 0, "B", 4.0, 7.0),
        (0, 0, 0, 0, "B", 7.0, 10.0),
        (1, 0, 0, 0, "F", 20.0, 22.0),
        (1, 1, 1, 0, "F", 22.0, 25.0),
        (1, 1, 1, 0, "B", 25.0, 30.0),
        (1, 0, 0, 0, "B", 30.0, 34.0),
    ]
    return pd.DataFrame(rows, columns=COLUMNS)


def test_metrics_of_a_measured_multi_step_timeline():
    tl = Timeline(measured_two_steps(), source="measured", meta={"P": 2})
    assert tl.steps == [0, 1]
    assert tl.step_spans["span_ms"].tolist() == [10.0, 14.0]
    assert tl.step_ms == 12.0  # median of 10 and 14
    idle = tl.idle_by_rank
    # rank 0 is busy 5 of 10 ms, then 6 of 14; rank 1 busy 5 of 10, then 8 of 14
    assert idle["busy_ms"].tolist() == [5.5, 6.5]
    assert idle["idle_ratio"].tolist() == pytest.approx([(0.5 + 8 / 14) / 2, (0.5 + 6 / 14) / 2])
    assert tl.bubble_ratio == pytest.approx((0.5 + 8 / 14 + 0.5 + 6 / 14) / 4)
    assert tl.peak_inflight.tolist() == [1.0, 1.0]


def test_simulated_gpipe_numbers():
    tl = simulate(
        pd.DataFrame({"fwd_ms": [1.0] * 3, "bwd_ms": [2.0] * 3, "activation_bytes": [10.0, 20.0, 30.0]}), 4, "GPipe"
    )
    assert tl.step_ms == 18.0  # (m + P - 1) * (F + B)
    assert tl.bubble_ratio == pytest.approx(2 / 6)
    assert tl.idle_by_rank["idle_ms"].tolist() == [6.0, 6.0, 6.0]
    assert tl.peak_inflight.tolist() == [4.0, 4.0, 4.0]
    assert tl.peak_activation_bytes.tolist() == [40.0, 80.0, 120.0]


def test_overlapping_compute_is_not_counted_twice():
    df = pd.DataFrame(
        [
            (0, 0, 0, 0, "F", 0.0, 4.0),
            (0, 0, 1, 0, "F", 2.0, 6.0),
            (0, 0, 1, 0, "B", 6.0, 8.0),
            (0, 0, 0, 0, "B", 8.0, 10.0),
            (0, 1, 2, 0, "F", 0.0, 1.0),
        ],
        columns=COLUMNS,
    )
    tl = Timeline(df, source="measured")
    assert tl.idle_by_rank.set_index("rank").loc[0, "busy_ms"] == 10.0  # 0-6 merged, 6-8, 8-10
    assert tl.idle_by_rank.set_index("rank").loc[1, "busy_ms"] == 1.0


def test_in_flight_counts_chunks_until_their_last_backward():
    # one rank, two stages (v=2): mb 0 of stage 0 is held 0-10, stage 1's 1-6 (its W ends at 6)
    df = pd.DataFrame(
        [
            (0, 0, 0, 0, "F", 0.0, 1.0),
            (0, 0, 1, 0, "F", 1.0, 2.0),
            (0, 0, 1, 0, "I", 2.0, 3.0),
            (0, 0, 0, 1, "F", 3.0, 4.0),
            (0, 0, 1, 0, "W", 5.0, 6.0),
            (0, 0, 0, 0, "B", 8.0, 10.0),
            (0, 0, 0, 1, "B", 10.0, 12.0),
        ],
        columns=COLUMNS,
    )
    tl = Timeline(df, meta={"v": 2, "stage_activation_bytes": [100.0, 7.0]})
    assert tl.peak_inflight.tolist() == [1.5]  # three chunks at 3-6 ms, each 1/2
    assert tl.peak_activation_bytes.tolist() == [207.0]
    with pytest.raises(ValueError, match="stage_activation_bytes"):
        _ = Timeline(df).peak_activation_bytes


def test_release_and_acquire_at_the_same_time_do_not_add_up():
    df = pd.DataFrame(
        [
            (0, 0, 0, 0, "F", 0.0, 1.0),
            (0, 0, 0, 0, "B", 1.0, 2.0),
            (0, 0, 0, 1, "F", 2.0, 3.0),
            (0, 0, 0, 1, "B", 3.0, 4.0),
        ],
        columns=COLUMNS,
    )
    assert Timeline(df).peak_inflight.tolist() == [1.0]


@pytest.mark.parametrize(
    "change, error, words",
    [
        (lambda d: d.assign(extra=1), ValueError, "unexpected \\['extra'\\]"),
        (lambda d: d.drop(columns="kind"), ValueError, "missing \\['kind'\\]"),
        (lambda d: d.assign(kind="X"), ValueError, "holds \\['X'\\]"),
        (lambda d: d.assign(time_source="gpu"), ValueError, "'time_source' holds \\['gpu'\\]; valid values"),
        (lambda d: d.assign(end_ms=d["start_ms"] - 1), ValueError, "ends before it starts"),
        (lambda d: d.assign(start_ms=np.nan), ValueError, "finite"),
        (lambda d: d.assign(rank=-1), ValueError, "integers >= 0"),
        (lambda d: d.assign(step=0.5), ValueError, "integers >= 0"),
        (lambda d: d.iloc[:0], ValueError, "no rows"),
    ],
)
def test_bad_rows_are_refused(change, error, words):
    with pytest.raises(error, match=words):
        Timeline(change(measured_two_steps()))


def test_bad_source_and_meta():
    with pytest.raises(ValueError, match="source='guessed'"):
        Timeline(measured_two_steps(), source="guessed")
    with pytest.raises(TypeError, match="meta must be a dict"):
        Timeline(measured_two_steps(), meta=[1])
    with pytest.raises(TypeError, match="DataFrame"):
        Timeline([1, 2, 3])


def test_gantt_chart_draws_one_bar_per_compute_action():
    tl = simulate(
        pd.DataFrame({"fwd_ms": [1.0] * 4, "bwd_ms": [2.0] * 4, "output_bytes": [1e6] * 4}),
        4,
        "1F1B",
        link=Link(0.1, 10),
    )
    ax = tl.plot()
    bars = [p for p in ax.patches]
    n_compute = int(tl.df["kind"].isin(["F", "B"]).sum())
    n_sends = int(tl.df["kind"].str.startswith("SEND").sum())
    assert len(bars) == n_compute + n_sends
    labels = {t.get_text() for t in ax.texts}
    assert labels == {"0", "1", "2", "3"}
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"rank {r}" for r in range(4)]
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"F", "B", "SEND_F", "SEND_B"}


def test_gantt_of_one_step_of_a_measured_timeline():
    tl = Timeline(measured_two_steps(), source="measured")
    ax = tl.plot(step=1, comms=False)
    assert len(ax.patches) == 4
    assert min(p.get_x() for p in ax.patches) == 0.0  # times start at the step's start
    assert max(p.get_x() + p.get_width() for p in ax.patches) == 14.0
    with pytest.raises(ValueError, match="step=5 is not in this timeline"):
        tl.plot(step=5)


def test_chrome_trace_has_every_action_and_flow_arrows(tmp_path):
    tl = simulate(
        pd.DataFrame({"fwd_ms": [1.0] * 2, "bwd_ms": [2.0] * 2, "output_bytes": [1e6] * 2}),
        2,
        "1F1B",
        link=Link(0.1, 10),
    )
    path = tl.to_chrome_trace(tmp_path / "trace.json")
    events = json.loads(open(path).read())["traceEvents"]
    x = [e for e in events if e["ph"] == "X"]
    assert len(x) == len(tl.df)
    f0 = next(e for e in x if e["name"] == "F0 s0")
    assert (f0["pid"], f0["tid"], f0["ts"], f0["dur"]) == (0, 0, 0.0, 1000.0)
    starts = [e for e in events if e["ph"] == "s"]
    finishes = [e for e in events if e["ph"] == "f"]
    assert len(starts) == len(finishes) == int(tl.df["kind"].str.startswith("SEND").sum()) == 4
    assert {e["pid"] for e in starts} == {0, 1}
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}


def test_chrome_trace_without_a_link_links_dependencies(tmp_path):
    tl = simulate(pd.DataFrame({"fwd_ms": [1.0] * 3, "bwd_ms": [2.0] * 3}), 2, "GPipe")
    events = json.loads(open(tl.to_chrome_trace(tmp_path / "t.json")).read())["traceEvents"]
    # per micro-batch: 2 forward hops and 2 backward hops
    assert sum(e["ph"] == "s" for e in events) == 2 * 4


def test_csv_round_trip_keeps_source_and_meta(tmp_path):
    tl = simulate(pd.DataFrame({"fwd_ms": [1.0, 2.0], "bwd_ms": [2.0, 3.0], "activation_bytes": [5.0, 6.0]}), 3, "1F1B")
    back = Timeline.read_csv(tl.to_csv(tmp_path / "tl.csv"))
    pd.testing.assert_frame_equal(back.df, tl.df)
    assert back.source == "simulated" and back.meta["schedule"] == "1F1B" and back.meta["P"] == 2
    assert back.peak_activation_bytes.tolist() == tl.peak_activation_bytes.tolist()
    measured = Timeline(measured_two_steps(), source="measured")
    plain = tmp_path / "plain.csv"
    measured.df.to_csv(plain, index=False)
    assert Timeline.read_csv(plain).step_ms == 12.0


def test_notebook_display():
    tl = Timeline(measured_two_steps(), source="measured")
    html = tl._repr_html_()
    assert "step 12 ms" in html and "idle_ratio" in html and "peak_inflight" in html
    assert "step_ms" in repr(tl)


def two_replicas():
    """measured_two_steps' step 0 on replica 0, and on replica 1 the same shifted by 1 ms, each with its all-reduce."""
    first = measured_two_steps().query("step == 0")
    second = first.assign(start_ms=first["start_ms"] + 1.0, end_ms=first["end_ms"] + 1.0)
    reduce = pd.DataFrame([(0, r, r, 0, "REDUCE_GRAD", 8.0 - 3 * r, 9.0 - 3 * r) for r in (0, 1)], columns=COLUMNS)
    parts = [first.assign(replica=0), second.assign(replica=1), reduce.assign(replica=0), reduce.assign(replica=1)]
    return Timeline(pd.concat(parts, ignore_index=True), source="measured", meta={"P": 2})


def test_every_replica_rank_is_a_device_of_its_own():
    tl = two_replicas()
    assert tl.replicas == [0, 1] and tl.step_ms == 11.0  # the step ends when the later replica ends
    idle = tl.idle_by_rank
    assert list(idle.columns[:2]) == ["replica", "rank"] and len(idle) == 4
    assert idle["busy_ms"].tolist() == [5.0, 5.0, 5.0, 5.0]  # not two replicas' actions merged on one rank
    assert tl.bubble_ratio == pytest.approx(6 / 11)
    assert tl.peak_inflight.tolist() == [1.0, 1.0]  # one micro-batch per device, not two per rank
    assert "REDUCE_GRAD" in set(tl.df["kind"])  # communication: not busy time


def test_gantt_and_trace_of_replicas_give_each_device_a_row(tmp_path):
    tl = two_replicas()
    ax = tl.plot()
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"replica {d} rank {r}" for d in (0, 1) for r in (0, 1)]
    assert len(ax.patches) == 8 + 4  # compute bars, then the all-reduce under each row
    assert "REDUCE_GRAD" in {t.get_text() for t in ax.get_legend().get_texts()}
    events = json.loads(open(tl.to_chrome_trace(tmp_path / "t.json")).read())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "replica 0 rank 0", 1: "replica 0 rank 1", 2: "replica 1 rank 0", 3: "replica 1 rank 1"}
    reduce = [e for e in events if e["ph"] == "X" and e["cat"] == "REDUCE_GRAD"]
    assert len(reduce) == 4 and {e["tid"] for e in reduce} == {1}
    assert sum(e["ph"] == "s" for e in events) == 2 * 2  # each replica's F and B hop, never across replicas


def test_transfer_arrows_stay_within_their_replica(tmp_path):
    rows = []
    for d in (0, 1):
        t = 10.0 * d
        rows += [
            (0, 0, 0, 0, "F", t, t + 1, d),
            (0, 0, 0, 0, "SEND_F", t + 1, t + 2, d),
            (0, 1, 1, 0, "RECV_F", t + 1, t + 2, d),
            (0, 1, 1, 0, "F", t + 2, t + 3, d),
        ]
    tl = Timeline(pd.DataFrame(rows, columns=list(COLUMNS) + ["replica"]), source="measured", meta={"P": 2})
    events = json.loads(open(tl.to_chrome_trace(tmp_path / "t.json")).read())["traceEvents"]
    starts = sorted((e["pid"], e["ts"]) for e in events if e["ph"] == "s")
    finishes = sorted((e["pid"], e["ts"]) for e in events if e["ph"] == "f")
    assert starts == [(0, 1000.0), (2, 11000.0)] and finishes == [
        (1, 2000.0),
        (3, 12000.0),
    ]  # replica d: pids 2d, 2d + 1
