import hashlib
from fnmatch import fnmatch
from importlib import resources
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tomllib

import pipeswift_lab as psl
from pipeswift_lab.data import (
    PHILLY_SHA256,
    SPOT_FILE,
    SPOT_REQUESTED,
    SPOT_SHA256,
    data_path,
    philly_jobs,
    spot_instances,
)


@pytest.fixture(scope="module")
def trace():
    return philly_jobs()


def test_trace_is_found_through_importlib_resources_with_its_attribution():
    files = resources.files("pipeswift_lab.data")
    assert files.joinpath("philly_jobs.csv").is_file()
    digest = hashlib.sha256(data_path("philly_jobs.csv").read_bytes()).hexdigest()
    assert digest == PHILLY_SHA256
    readme = data_path("README.md").read_text(encoding="utf-8")
    for needle in ("Jeon et al.", "Pollux", "CC BY 4.0", "Apache-2.0", PHILLY_SHA256):
        assert needle in readme
    with pytest.raises(FileNotFoundError, match="not shipped"):
        data_path("nope.csv")


def test_package_data_globs_cover_the_shipped_files():
    """pyproject's package-data must name the files that sit in the package, or the wheel lacks them."""
    root = Path(__file__).resolve().parents[2]
    config = tomllib.loads((root / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["pipeswift_lab.data"]
    folder = root / "pipeswift_lab" / "data"
    assert (folder / "__init__.py").is_file()
    for name in ("philly_jobs.csv", "aws_spot_p2_xlarge.csv", "README.md"):
        assert (folder / name).is_file()
        assert any(fnmatch(name, g) for g in globs), (name, globs)


def test_philly_jobs_columns_order_and_counts(trace):
    assert list(trace.columns) == ["name", "submit_s", "gpus", "duration_s", "gpu_s", "cluster", "timestamp"]
    assert len(trace) == 82_247
    assert trace["submit_s"].iloc[0] == 0.0
    assert trace["submit_s"].is_monotonic_increasing
    assert trace["gpus"].between(1, 128).all() and (trace["duration_s"] > 0).all()
    assert np.allclose(trace["gpu_s"], trace["gpus"] * trace["duration_s"])
    assert trace["cluster"].nunique() == 15
    assert trace["name"].is_unique
    assert trace["timestamp"].min() == pd.Timestamp("2017-09-04 10:30:41")
    assert (trace["timestamp"] - trace["timestamp"].min()).dt.total_seconds().equals(trace["submit_s"])
    assert "Jeon et al." in trace.attrs["source"]
    # the README's numbers: multi-GPU jobs are 6.8% of jobs and 81.9% of GPU-time
    multi = trace["gpus"] >= 2
    assert round(multi.mean(), 3) == 0.068
    assert round(trace.loc[multi, "gpu_s"].sum() / trace["gpu_s"].sum(), 3) == 0.819


def test_window_and_sample(trace):
    week = philly_jobs(window=(14 * 86400, 21 * 86400))
    expected = trace[(trace["submit_s"] >= 14 * 86400) & (trace["submit_s"] < 21 * 86400)]
    assert len(week) == len(expected) > 0
    assert week["submit_s"].min() >= 14 * 86400  # not shifted: windows line up with the trace
    a = philly_jobs(window=(14 * 86400, 21 * 86400), sample=100, seed=1)
    b = philly_jobs(window=(14 * 86400, 21 * 86400), sample=100, seed=1)
    c = philly_jobs(window=(14 * 86400, 21 * 86400), sample=100, seed=2)
    pd.testing.assert_frame_equal(a, b)
    assert len(a) == 100 and a["submit_s"].is_monotonic_increasing and set(a["name"]) <= set(week["name"])
    assert not a["name"].equals(c["name"])


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"window": (10, 5)}, ValueError, r"window=\(10, 5\) is invalid"),
        ({"window": (-1, 5)}, ValueError, "0 <= start_s < end_s"),
        ({"window": 5}, TypeError, "window must be a"),
        ({"sample": -3}, ValueError, "sample=-3 is invalid"),
        ({"sample": 10**6}, ValueError, "exceeds the 82247 jobs"),
        ({"sample": 2.5}, TypeError, "sample must be an integer; got float 2.5"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        philly_jobs(**kwargs)


def test_top_level_access():
    assert psl.data.philly_jobs is philly_jobs


def test_data_and_cluster_keep_the_package_import_light():
    import subprocess
    import sys

    code = (
        "import sys, pipeswift_lab as psl; psl.data.philly_jobs(window=(0, 86400)); "
        "heavy = [m for m in ('matplotlib', 'seaborn', 'IPython', 'ipywidgets') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_spot_trace_is_the_published_file_with_its_attribution():
    digest = hashlib.sha256(data_path(SPOT_FILE).read_bytes()).hexdigest()
    assert digest == SPOT_SHA256
    readme = data_path("README.md").read_text(encoding="utf-8")
    for needle in ("Bamboo", "NSDI 2023", "MIT", "847083d", SPOT_SHA256):
        assert needle in readme


def test_spot_instances_reads_as_a_capacity_trace():
    df = spot_instances()
    assert list(df.columns) == ["hour", "instances"]
    assert df["hour"].is_monotonic_increasing and df["hour"].iloc[0] == 0.0
    assert df["instances"].between(0, SPOT_REQUESTED).all() and df["instances"].max() == SPOT_REQUESTED
    assert "Bamboo" in df.attrs["source"]
    capacity = psl.cluster.read_capacity(df, time_column="hour", gpus_column="instances", time_unit="h", scale=8)
    # two points a change become one; the counts it keeps are the trace's, times 8 GPUs an instance
    assert set(capacity["gpus"]) <= set(df["instances"] * 8)
    assert (capacity["gpus"].diff().dropna() != 0).all()
    assert capacity["time_s"].iloc[-1] == pytest.approx(df["hour"].iloc[-1] * 3600)


def test_top_level_data_folder_points_at_the_shipped_files():
    """``data/`` at the top of the checkout holds each shipped dataset once: links into the package."""
    root = Path(__file__).resolve().parents[2]
    for name in ("philly_jobs.csv", "aws_spot_p2_xlarge.csv"):
        link = root / "data" / name
        assert link.is_symlink(), name
        assert link.resolve() == (root / "pipeswift_lab" / "data" / name).resolve()
    assert "Bamboo" in (root / "data" / "README.md").read_text(encoding="utf-8")


def test_saved_profiles_load_and_match_the_reference_model():
    """``data/profiles`` holds profiles of the tutorials' small GPT that ``notebooks/00_start_here`` reads."""
    root = Path(__file__).resolve().parents[2]
    setup = psl.models.reference("gpt", batch_size=16, vocab_size=4096, seq_len=32, d_model=64, n_layers=4, n_heads=4)
    names = [name for name, _ in setup.model.named_children()]
    for b in (1, 2, 4, 8):
        prof = psl.Profile.read_csv(root / "data" / "profiles" / f"gpt_small_cpu_b{b}.csv")
        assert prof.df["name"].tolist() == names
        assert prof.meta["microbatch_size"] == b and prof.meta["batch_shape"] == [b, 32]
        assert (prof.df["total_ms"] > 0).all() and prof.meta["cores"] >= 1
