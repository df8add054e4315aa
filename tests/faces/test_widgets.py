import matplotlib
import pytest

from pipeswift_lab import analytic
from pipeswift_lab.faces.widgets import bubble_explorer, plot_bubble_curve

matplotlib.use("Agg")


def test_bubble_explorer_follows_its_sliders():
    explorer = bubble_explorer(P=4, m=8, schedule="1F1B")
    assert explorer.result["bubble_ratio"] == pytest.approx(3 / 11)
    explorer.P = 8
    explorer.m = 16
    explorer.schedule = "GPipe"
    assert (explorer.P, explorer.m, explorer.schedule) == (8, 16, "GPipe")
    assert round(explorer.result["bubble_ratio"], 3) == 0.304
    assert explorer.result["bubble_overhead"] == pytest.approx(7 / 16)
    assert explorer.result["inflight_rank0"] == 16
    assert "0.304" in explorer._numbers.value


def test_schedule_pins_v():
    explorer = bubble_explorer(P=4, m=8, schedule="Interleaved1F1B", v=3)
    assert explorer.result["bubble_overhead"] == pytest.approx(3 / 24)
    explorer.schedule = "ZBVZeroBubble"
    assert explorer.v == 2 and explorer.result["v"] == 2
    explorer.schedule = "1F1B"
    assert explorer.v == 1
    assert explorer.result["bubble_ratio"] == analytic.bubble_ratio(4, 8, "1F1B")


def test_bad_start_values():
    with pytest.raises(ValueError, match="v=2 is not allowed for schedule='GPipe'"):
        bubble_explorer(schedule="GPipe", v=2)


def test_bubble_curve_plot():
    ax = plot_bubble_curve((2, 8), m_max=16, convention="overhead")
    assert len(ax.lines) == 2
    xs, ys = ax.lines[1].get_xdata(), ax.lines[1].get_ydata()
    assert xs[0] == 8  # torch's 1F1B needs m >= P: the curve starts at m = P
    assert ys[0] == pytest.approx(7 / 8) and ys[-1] == pytest.approx(7 / 16)
    assert plot_bubble_curve((8,), schedule="GPipe", m_max=4).lines[0].get_xdata()[0] == 1  # GPipe takes any m
    with pytest.raises(ValueError, match="convention='idle'"):
        plot_bubble_curve(convention="idle")


def test_pipeline_explorer_resimulates_on_every_change():
    from pipeswift_lab import Profile
    from pipeswift_lab.faces.widgets import pipeline_explorer

    prof = Profile.synthetic(fwd_ms=[1, 2, 3, 4, 1, 1], bwd_ms=[2, 4, 6, 8, 2, 2])
    explorer = pipeline_explorer(prof, P=2, m=4)
    # balanced halves: layers 0-2 (18 ms) and 3-5 (18 ms); 1F1B step (m + P - 1) * 18
    assert explorer.partition.bounds == ((0, 3), (3, 6))
    assert explorer.result["step_ms"] == pytest.approx(5 * 18)
    assert explorer.result["bubble_ratio"] == pytest.approx(1 / 5)
    explorer.P = 3
    assert explorer.m == 4 and list(explorer._m.options)[0] == 3  # 1F1B: only m >= P is offered
    explorer.m = 2  # refused by torch: snapped to the nearest valid m, and said so
    assert explorer.m == 3 and explorer.error is None and explorer.timeline is not None
    assert explorer.note == "m=2 is not accepted by torch's 1F1B with P=3; showing the nearest valid m=3"
    assert "m=2 is not accepted" in explorer._numbers.value
    explorer._m.value = 5  # moved by hand: the note goes
    assert explorer.note == "" and "not accepted" not in explorer._numbers.value
    explorer.m = 6
    assert explorer.error is None and explorer.result["P"] == 3
    assert len(explorer.timeline.df) == 2 * 3 * 6
    explorer.method = "uniform"
    assert explorer.partition.bounds == ((0, 2), (2, 4), (4, 6))
    assert explorer.result["bottleneck_ms"] == pytest.approx(3 * (3 + 4))
    assert explorer.result["bottleneck_rank_ms"] == explorer.result["bottleneck_ms"]  # v=1: a rank is a stage
    explorer.schedule = "Interleaved1F1B"
    assert explorer.result["v"] == 2 and len(explorer.partition.bounds) == 6
    part, r = explorer.partition, explorer.result
    by_rank = [sum(t for t, rank in zip(part.stage_cost_ms, part.stage_to_rank) if rank == k) for k in range(3)]
    assert r["bottleneck_rank_ms"] == pytest.approx(max(by_rank)) and r["bottleneck_rank_ms"] > r["bottleneck_ms"]
    assert r["rank_imbalance"] == pytest.approx(part.rank_imbalance)
    shown = explorer._numbers.value
    assert f"busiest rank {max(by_rank):.4g} ms per micro-batch" in shown and "slowest stage" in shown


def test_planner_explorer_replans_on_every_change():
    from pipeswift_lab import Profile
    from pipeswift_lab.faces.widgets import parse_availability, planner_explorer

    prof = Profile.synthetic(fwd_ms=[1.0] * 8, bwd_ms=[2.0] * 8, param_bytes=[1e8] * 8, meta={"batch_size": 1})
    explorer = planner_explorer(prof, gpus=8, global_batch=16, steps=1000, schedules=["1F1B"])
    first = explorer.plan.best
    assert first.gpus <= 8 and explorer.error is None
    explorer.gpus = 4  # with no availability given, all GPUs are free now
    assert explorer.availability == [(0.0, 4)] and explorer.plan.inputs["gpus"] == 4 and explorer.plan.best.gpus <= 4
    explorer.gpus = 8
    explorer.availability = [(0, 2), (3600, 8)]
    assert explorer.availability == [(0.0, 2), (3600.0, 8)]
    assert explorer.plan.inputs["availability"] == ((0.0, 2), (3600.0, 8))
    assert explorer.plan.best.total_s > first.total_s  # fewer GPUs now or a wait: the job ends later
    rows = explorer.plan.feasible
    assert set(rows["strategy"]) <= {"now", "wait", "grow", "shrink"}
    assert (rows.loc[rows["strategy"] == "wait", "queue_s"] == 3600).all() and (rows["strategy"] == "now").any()
    explorer.steps = 10
    assert explorer.plan.best.gpus <= 2  # a tiny job does not wait an hour
    explorer.global_batch = 7
    assert explorer.plan.best.m * explorer.plan.best.microbatch_size * explorer.plan.best.D == 7
    explorer._availability.value = "0:8, soon:16"
    assert explorer.plan is None and "'soon:16' is not 'seconds:gpus'" in explorer.error
    assert parse_availability("0:16; 7200:32") == [(0.0, 16), (7200.0, 32)]


def test_explorers_use_a_calibration():
    import math

    from pipeswift_lab import Profile
    from pipeswift_lab.faces.widgets import pipeline_explorer, planner_explorer
    from pipeswift_lab.fidelity.calibrator import Calibration

    cal = Calibration(
        compute_scale={2: 2.0},
        action_ms=0.5,
        loss_ms=(0.0, 0.0),
        gap={"single-chunk": 0.0, "multi-chunk": 0.0},
        step_overhead={"single-chunk": 10.0, "multi-chunk": 3.0},
        latency_ms=0.0,
        bandwidth_GBps=math.inf,
        step_cv=0.1,
    )
    prof = Profile.synthetic(fwd_ms=[1, 2, 3, 4, 1, 1], bwd_ms=[2, 4, 6, 8, 2, 2])
    explorer = pipeline_explorer(prof, P=2, m=4, calibration=cal)
    # every action doubles and pays 0.5 ms; the 1F1B step is (m + P - 1) x (2 x 18 + 2 x 0.5),
    # plus 10 ms of runtime per step
    assert explorer.result["step_ms"] == pytest.approx(5 * (2 * 18 + 1.0) + 10.0)
    assert "calibrated step" in explorer._numbers.value
    planner = planner_explorer(
        Profile.synthetic(fwd_ms=[1.0] * 8, bwd_ms=[2.0] * 8, meta={"batch_size": 1}),
        gpus=4,
        global_batch=8,
        steps=100,
        schedules=["1F1B"],
        calibration=cal,
        objective="p95",
    )
    assert planner.plan.inputs["calibration"] is cal and "total_s_p95" in planner.plan.table.columns


def test_widgets_and_costs_are_attributes_of_the_package_and_import_stays_light():
    import subprocess
    import sys

    code = (
        "import sys, pipeswift_lab as psl; "
        "assert 'pipeswift_lab.faces.widgets' not in sys.modules; "
        "assert callable(psl.widgets.pipeline_explorer) and psl.costs.Availability and psl.Comparison; "
        "heavy = [m for m in ('ipywidgets', 'IPython', 'matplotlib') if m in sys.modules]; "
        "assert not heavy, heavy; "
        "assert not {'explore', 'compute_orders', 'load_ipython_extension'} & set(psl.__all__); "
        "assert {'widgets', 'costs', 'Comparison'} <= set(psl.__all__); "
        "from pipeswift_lab import compute_orders, explore, load_ipython_extension"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_valid_microbatches_follow_torch_rules():
    from pipeswift_lab.faces.widgets import valid_microbatches

    assert valid_microbatches(4, "1F1B")[:3] == [4, 5, 6] and valid_microbatches(4, "GPipe")[0] == 1
    interleaved = valid_microbatches(4, "Interleaved1F1B")
    assert 8 in interleaved and 9 not in interleaved and 10 in interleaved  # m a multiple of max(1, m // P)
    assert valid_microbatches(40, "DualPipeV")[0] == 80  # beyond the usual 64: what the schedule needs


def test_pipeline_explorer_refuses_an_unknown_method_by_name():
    from pipeswift_lab import Profile
    from pipeswift_lab.faces.widgets import pipeline_explorer

    prof = Profile.synthetic(fwd_ms=[1, 2, 3, 4], bwd_ms=[2, 4, 6, 8])
    with pytest.raises(ValueError, match=r"method='fast' is not known; valid values are \['uniform'"):
        pipeline_explorer(prof, method="fast")
