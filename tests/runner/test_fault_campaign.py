"""The fault campaign in small: one trial of every fault kind, every check held (the 100-trial one:
benchmarks/bench_faults.py)."""

import pytest
from fault_campaign import CHECKS, KINDS, campaign

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it


def test_one_trial_of_every_fault_kind_passes_every_check():
    # the hang is stopped after 5 s, not the benchmark's 8: its job reaches the hung step (at most step 5 of 6) in about
    # 1 s here, 2 s with a core kept busy, and the watcher stops it half a second before the timeout
    rows = campaign(len(KINDS), seed=19, progress=False, hang_timeout_s=5)
    assert list(rows["kind"]) == list(KINDS)
    failed = rows[~rows[list(CHECKS)].all(axis=1)]
    assert failed.empty, failed.to_dict("records")
