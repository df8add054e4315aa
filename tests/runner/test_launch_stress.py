"""Cold launches with a core busy end cleanly: no worker aborts at exit (the full count: benchmarks/bench_launch.py)."""

import pytest
from launch_stress import busy_core, cold_run, save_spec, two_node_launch

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it

#: Cold launches the suite makes while a core is busy (each starts fresh interpreters that import torch, and the busy
#: core slows the suite's other workers meanwhile). A guard against a gross regression; the deterministic check is
#: every run's threads_after_teardown, the count the benchmark's (30 of each).
COLD_LAUNCHES = 1
TWO_NODE_LAUNCHES = 1


def test_cold_launches_with_a_core_busy_never_abort(tmp_path):
    spec = save_spec(tmp_path / "job.pkl", D=2)
    with busy_core():
        outcomes = [cold_run() for _ in range(COLD_LAUNCHES)] + [
            two_node_launch(spec) for _ in range(TWO_NODE_LAUNCHES)
        ]
    assert [o for o in outcomes if not o["ok"] or o["abort"]] == []
