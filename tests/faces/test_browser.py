"""The explorers in a real browser: notebook 04 in JupyterLab, driven by Playwright on Debian's Chromium.

Headless tests of the widgets pass even when JupyterLab cannot render them (an ipywidgets /
JupyterLab version mismatch shows only "Loading widget..."). This test starts JupyterLab on a
loopback port, opens notebook 04 (without its "Measured" section of real pipeline runs, which nbval
runs already and which would add a minute here), runs all cells, moves the pipeline explorer's P slider
and checks that the metrics line and the chart change. A screenshot is saved under ``artifacts/``
(or ``$PIPESWIFT_ARTIFACTS``). Playwright cannot download its own browsers here, so it drives
the system ``chromium`` (``apt-get install -y chromium``; ``.ci/run`` installs it); the test is
skipped, saying why, only where no browser or no ``playwright`` package is available.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # starts worker processes: `pytest -m "not processes"` skips it

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = "notebooks/04_schedules_and_microbatches.ipynb"

playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="the playwright package is not installed: pip install -e '.[browser]'"
)
pytest.importorskip("jupyterlab", reason="JupyterLab is not installed: pip install -e '.[lab]'")


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("no Chromium executable on PATH (Playwright cannot download its own here): apt-get install -y chromium")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_without_measured_section(source: Path, target: Path) -> None:
    """Copy notebook 04 without the cells from its "## Measured" heading up to the next "## " heading."""
    notebook = json.loads(source.read_text(encoding="utf-8"))
    cells, skipping = [], False
    for cell in notebook["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and text.startswith("## "):
            skipping = text.startswith("## Measured")
        if not skipping:
            cells.append(cell)
    assert len(cells) < len(notebook["cells"]), "notebook 04 has no '## Measured' section any more"
    assert any("pipeline_explorer" in "".join(c["source"]) for c in cells)
    target.write_text(json.dumps({**notebook, "cells": cells}, indent=1), encoding="utf-8")


@pytest.fixture
def jupyterlab(tmp_path):
    """A JupyterLab server on a loopback port serving the repository; yields its base URL and token."""
    # a copy of the notebook: the browser runs and autosaves it, and the repository's copy must not change
    served = tmp_path / "served"
    (served / "notebooks").mkdir(parents=True)
    _write_without_measured_section(ROOT / NOTEBOOK, served / NOTEBOOK)
    port, token = _free_port(), secrets.token_hex(16)
    # the suite sets MPLBACKEND=Agg for itself; a kernel started by a person has the inline backend
    python_path = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {
        **{k: v for k, v in os.environ.items() if k != "MPLBACKEND"},
        "TQDM_DISABLE": "1",
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "PYTHONPATH": os.pathsep.join(python_path),
    }
    command = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}"]
    command += [f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={served}", "--ServerApp.open_browser=False"]
    command += ["--LabApp.news_url=", "--ServerApp.allow_root=True"]
    server = subprocess.Popen(command, env=env, stdout=open(tmp_path / "lab.log", "wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text(errors="replace")[-3000:]
                    ) from None
                time.sleep(0.5)
        yield base, token
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


def _wait_for_an_idle_kernel(base, token, timeout_s=120):
    """Until the server's one session has a kernel that has started and is idle (its REST API)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{base}/api/sessions?token={token}", timeout=5) as response:
            sessions = json.loads(response.read())
        if any(s.get("kernel", {}).get("execution_state") == "idle" for s in sessions):
            return
        time.sleep(0.5)
    raise AssertionError(f"no idle kernel after {timeout_s} s: {sessions}")


def test_notebook_04_explorer_renders_and_responds_in_jupyterlab(jupyterlab):
    chromium = _chromium()
    base, token = jupyterlab
    artifacts = Path(os.environ.get("PIPESWIFT_ARTIFACTS", ROOT / "artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        try:
            page.goto(f"{base}/lab/tree/{NOTEBOOK}?token={token}", timeout=120_000)
            page.locator(".jp-NotebookPanel").first.wait_for(timeout=120_000)
            select = page.locator(".jp-Dialog button", has_text="Select")
            try:  # JupyterLab asks which kernel when the notebook's kernelspec is not the default's name (it is)
                select.first.wait_for(timeout=2_000)
                select.first.click()
            except playwright_api.TimeoutError:
                pass
            _wait_for_an_idle_kernel(base, token)
            page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']").first.wait_for(
                timeout=120_000
            )  # the kernel is up
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()

            metrics = page.locator(".widget-html", has_text="bubble_ratio").first
            # the cell after the explorer sets P=4, Interleaved1F1B through the Python object: the page must follow
            page.wait_for_function(
                "() => [...document.querySelectorAll('.widget-html')]"
                ".some(e => e.innerText.includes('Interleaved1F1B') && e.innerText.includes('P=4'))",
                timeout=300_000,
            )
            idle = (
                "() => { const e = document.querySelector('.jp-Notebook-ExecutionIndicator'); "
                "return e && e.dataset.status === 'idle'; }"
            )
            page.wait_for_function(idle, timeout=300_000)  # every cell has run and the explorer has drawn
            page.wait_for_timeout(1000)
            assert "Loading widget" not in page.content()
            explorer = page.locator(".widget-vbox", has=metrics).last
            chart = explorer.locator(".widget-output img").first
            chart.wait_for(timeout=60_000)
            before_text, before_chart = metrics.inner_text(), chart.get_attribute("src")

            slider = explorer.locator(".widget-hslider", has=page.locator("label", has_text="P (ranks)")).first
            slider.locator("[role=slider]").first.focus()
            page.keyboard.press("ArrowRight")  # P 4 -> 5: re-partitioned and re-simulated
            page.wait_for_function(
                "(old) => [...document.querySelectorAll('.widget-html')]"
                ".some(e => e.innerText.includes('bubble_ratio') && e.innerText !== old "
                "&& e.innerText.includes('P=5'))",
                arg=before_text,
                timeout=120_000,
            )
            page.wait_for_function(
                "(old) => { const i = document.querySelector('.widget-output img'); return i && i.src !== old; }",
                arg=before_chart,
                timeout=60_000,
            )
            page.wait_for_function(idle, timeout=120_000)  # the redraw is done: the screenshot shows the new chart
            page.wait_for_timeout(1000)
            after_text, after_chart = metrics.inner_text(), chart.get_attribute("src")
            assert after_text != before_text and "P=5" in after_text
            assert after_chart and after_chart != before_chart
        finally:
            page.screenshot(path=str(artifacts / "notebook04_explorer.png"), full_page=False)
            browser.close()
