"""Report sections that can be built alone (the whole report is built by tests/test_cli.py)."""
import time

import pandas as pd

from pipeswift_lab.report import SECTIONS, build_report, section_cluster


def test_cluster_section_is_in_the_report_and_fast(tmp_path):
    assert section_cluster in SECTIONS
    start = time.perf_counter()
    result = build_report(tmp_path / "rep", sections=[section_cluster], quick=True, progress=False)
    assert time.perf_counter() - start < 30  # a few seconds on a quiet machine; generous for a shared one
    page = result.path.read_text()
    assert "Philly trace" in page and "Jeon et al." in page and "data:image/png;base64," in page
    table = pd.read_csv(tmp_path / "rep" / "cluster_policies.csv")
    assert table["policy"].tolist() == ["static", "elastic", "preemptive"]
    assert (table["finished"] == table["jobs"]).all()
    breakdown = pd.read_csv(tmp_path / "rep" / "cluster_breakdown.csv")
    terms = ["queue_s", "assembly_s", "training_s", "cleanup_s", "preemption_loss_s"]
    assert ((breakdown[terms].sum(axis=1) - breakdown["jct_s"]).abs() < 1e-6 * breakdown["jct_s"]).all()
    assert any(line.startswith("cluster days 42-43 on 256 GPUs: mean JCT static") for line in result.summary)
