import subprocess
import sys

import pandas as pd
import pytest

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it


def run(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "pipeswift_lab", *args], capture_output=True, text=True, cwd=cwd, timeout=600
    )


def test_help():
    result = run("--help")
    assert result.returncode == 0
    assert "report" in result.stdout


def test_report_subprocess_writes_html_and_csv(tmp_path):
    result = run("report", "--out", str(tmp_path / "rep"), "--quick", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "report.html" in result.stdout
    assert "bubble_ratio(P=8, m=16) = 0.304" in result.stdout
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "<img" in page and "data:image/png;base64," in page
    bubbles = pd.read_csv(tmp_path / "rep" / "bubbles.csv")
    assert {"P", "m", "schedule", "bubble_ratio", "bubble_overhead"} <= set(bubbles.columns)
    # the measured-run section calibrates on its own runs and publishes the error before and after
    errors = pd.read_csv(tmp_path / "rep" / "calibration_error.csv")
    assert {"rel_error_before", "rel_error_after", "in_fit"} <= set(errors.columns) and (~errors["in_fit"]).sum() == 1
    assert "compute_scale[P=2]" in set(pd.read_csv(tmp_path / "rep" / "calibration.csv")["parameter"])
    assert "median step after the first" in page and "held out" in page
    assert "% before calibration" in result.stdout


def test_unknown_command_fails():
    result = run("frobnicate")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr
