"""Test session settings shared by the unit tests and the nbval-executed notebooks.

The environment is set here, before any notebook kernel starts, so kernels inherit it:
no progress bars in stored outputs and a non-interactive matplotlib backend.
"""

import os

os.environ.setdefault("TQDM_DISABLE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")


#: Notebooks whose cells start worker processes (pipeswift_lab.run): marked ``processes`` like the tests that do.
PROCESS_NOTEBOOKS = (
    "00_start_here",
    "03_balanced_vs_uniform",
    "04_schedules_and_microbatches",
    "05_real_pipeline_run",
    "06_jct_planner",
    "07_checkpoints_and_preemption",
    "08_fidelity",
    "09_elastic_and_rebalancing",
    "10_cluster_jct",
    "11_your_own_model",
    "12_your_cluster_runs",
    "13_recompute_and_precision",
    "17_your_own_schedules",
)


def pytest_configure(config):
    """nbval starts a notebook's kernel again when it dies at start, up to three times. jupyter_client picks a
    kernel's five TCP ports on 127.0.0.1 by binding port 0 and letting go, and the kernel binds them a moment later;
    meanwhile the other test workers' runs open ephemeral ports by the hundred (rendezvous stores, gloo's
    connections). A kernel that lost a port to them died at start ("Kernel died before replying to kernel_info",
    notebook 10 in a CI run with a core busy); a new start picks new ports. A notebook that fails for itself fails
    three times and reports the last error."""
    try:
        import nbval.kernel
    except ImportError:  # pragma: no cover - nbval is a test extra
        return
    start_once = nbval.kernel.start_new_kernel

    def start_new_kernel(*args, **kwargs):
        for attempt in range(3):
            try:
                return start_once(*args, **kwargs)
            except RuntimeError:
                if attempt == 2:
                    raise

    nbval.kernel.start_new_kernel = start_new_kernel


def pytest_collection_modifyitems(config, items):
    """Mark the cells of the notebooks that run pipelines ``processes``, so ``-m "not processes"`` skips them too; and
    order the files longest first (``tests/file_seconds.json``), each file's items in their order: xdist's ``loadfile``
    hands files out in collection order (``--no-loadscope-reorder``), so a long file never starts last while the other
    worker idles."""
    import json
    import statistics
    from pathlib import Path

    import pytest

    for item in items:
        if any(name in str(item.fspath) for name in PROCESS_NOTEBOOKS) and str(item.fspath).endswith(".ipynb"):
            item.add_marker(pytest.mark.processes)
    record = Path(__file__).with_name("tests") / "file_seconds.json"
    seconds = json.loads(record.read_text()) if record.exists() else {}
    if not seconds:
        return
    median = statistics.median(seconds.values())
    root = Path(str(config.rootpath))

    def file_seconds(item) -> float:
        try:
            name = Path(str(item.fspath)).relative_to(root).as_posix()
        except ValueError:
            return median
        return seconds.get(name, median)

    order = {id(item): (-file_seconds(item), i) for i, item in enumerate(items)}
    items.sort(key=lambda item: order[id(item)])
