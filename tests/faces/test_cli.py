import os
import subprocess
import sys

import pandas as pd
import pytest

from pipeswift_lab.faces.cli import main

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it


def run(*args, cwd=None, env=None):
    return subprocess.run(
        [sys.executable, "-m", "pipeswift_lab", *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600
    )


def test_help(capsys):  # in this process: the report's test below runs `python -m pipeswift_lab`
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    assert "report" in capsys.readouterr().out


def test_report_subprocess_writes_html_and_csv(tmp_path):
    # one OpenMP thread in the report's own process, as each rank of its runs has: on a loaded 2-core machine a second
    # one waits for a busy core (at load 6 the profiled step took 1.4 s instead of 50 ms, the report up to 1.8x as long)
    result = run(
        "report", "--out", str(tmp_path / "rep"), "--quick", "--no-progress", env=os.environ | {"OMP_NUM_THREADS": "1"}
    )
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


def test_unknown_command_fails(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["frobnicate"])
    assert exited.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
