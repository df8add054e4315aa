"""The search's compiled peaks against the replay: the same plan, row by row."""

import numpy as np
import pandas as pd
import pytest

from pipeswift_lab import Profile
from pipeswift_lab.planning.inputs import check_plan_inputs
from pipeswift_lab.planning.planner import evaluator_of, search

GB = 1e9


def uneven_profile(bytes_per_param, layers=12):
    """Layers of uneven bytes and times, a heavy head, a loss: memory caps bind unevenly across splits."""
    rng = np.random.default_rng(7)
    params = rng.integers(1e8, 4e8, layers)
    fwd = rng.uniform(1, 3, layers)
    fwd[-1] = 6.0
    return Profile.synthetic(
        fwd_ms=fwd.tolist(),
        bwd_ms=(2 * fwd).tolist(),
        params=params.tolist(),
        param_bytes=(params * bytes_per_param).tolist(),
        activation_bytes=rng.integers(0.2 * GB, 1.0 * GB, layers).tolist(),
        output_bytes=rng.integers(0.01 * GB, 0.1 * GB, layers).tolist(),
        meta={"batch_size": 2, "device": "cuda", "loss_activation_bytes": 0.5 * GB, "loss_transient_bytes": GB},
    )


@pytest.mark.parametrize("precision, bytes_per_param", [(None, 4), ("bf16-mixed-zero1", 2)])
def test_compiled_peaks_plan_what_the_replay_plans(precision, bytes_per_param):
    inputs = check_plan_inputs(
        uneven_profile(bytes_per_param),
        gpus=16,
        global_batch=16,
        steps=1000,
        mem_per_gpu_bytes=24 * GB,
        availability=[(0, 8), (3600, 16)],
        exhaustive=True,
        progress=False,
        precision=precision,
    )
    fast_evaluator, replay_evaluator = evaluator_of(inputs), evaluator_of(inputs, replay=True)
    fast, replayed = search(inputs, fast_evaluator), search(inputs, replay_evaluator)
    columns = ["P", "D", "m", "microbatch_size", "schedule", "v", "strategy", "feasible", "reason"]
    assert fast.table[columns].equals(replayed.table[columns])
    feasible = fast.table["feasible"]
    assert 0 < feasible.sum() < len(fast.table)  # the cap leaves some configurations and rules others out
    assert fast.table["reason"].str.contains("no balanced split").any()
    assert set(fast.table.loc[feasible, "schedule"]) >= {"GPipe", "1F1B", "ZBVZeroBubble"}
    pd.testing.assert_series_equal(fast.table["peak_mem_bytes"], replayed.table["peak_mem_bytes"], rtol=1e-9)
    assert fast.best.label == replayed.best.label and fast.best.total_s == replayed.best.total_s
    weighed = replay_evaluator.peaks  # every split the search weighed, capped candidates included
    assert weighed.keys() == fast_evaluator.peaks.keys() and len(weighed) > len(fast.table[feasible])
    for key, peaks in weighed.items():
        assert fast_evaluator.peaks[key] == pytest.approx(peaks, rel=1e-9), key
