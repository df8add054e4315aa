"""Report sections that can be built alone (the whole report is built by tests/faces/test_cli.py)."""

import pandas as pd
import pytest

from pipeswift_lab.faces.report import SECTIONS, build_report
from pipeswift_lab.faces.report.cluster import section_cluster


def test_cluster_section_is_in_the_report(tmp_path):
    assert section_cluster in SECTIONS
    # a few seconds on a quiet machine (a speed is not asserted here: a loaded machine moves it)
    result = build_report(tmp_path / "rep", sections=[section_cluster], quick=True, progress=False)
    page = result.path.read_text()
    assert "Philly trace" in page and "Jeon et al." in page and "data:image/png;base64," in page
    table = pd.read_csv(tmp_path / "rep" / "cluster_policies.csv")
    assert table["policy"].tolist() == ["static", "elastic", "preemptive", "jct"]
    assert table.set_index("policy")["mean_jct_s"].idxmin() == "jct"
    assert (table["finished"] == table["jobs"]).all()
    breakdown = pd.read_csv(tmp_path / "rep" / "cluster_breakdown.csv")
    terms = ["queue_s", "assembly_s", "training_s", "cleanup_s", "preemption_loss_s"]
    assert ((breakdown[terms].sum(axis=1) - breakdown["jct_s"]).abs() < 1e-6 * breakdown["jct_s"]).all()
    assert any(line.startswith("cluster days 42-43 on 256 GPUs: mean JCT static") for line in result.summary)


def test_tables_scroll_hide_empty_columns_and_print_zero(tmp_path):
    from pipeswift_lab.faces.report.builder import _table_html

    table = pd.DataFrame(
        {"P": [1, 2], "bubble_ratio": [-2.220446049250313e-16, 0.25], "peak_bytes": [float("nan")] * 2}
    )
    page = _table_html(table)
    assert page.startswith("<div class='wide'>")  # the page's CSS scrolls .wide sideways
    assert "peak_bytes</th>" not in page and "No values here for peak_bytes (see the CSV)" in page
    assert "e-16" not in page and "<td>0</td>" in page and "<td>0.25</td>" in page


def test_model_sections_read_as_a_reader_would(tmp_path):
    from pipeswift_lab.faces.report.model import section_bubbles, section_jct_example

    result = build_report(tmp_path / "rep", sections=[section_bubbles, section_jct_example], quick=True, progress=False)
    page = result.path.read_text()
    assert "the interleaved schedule (right, v=2)" in page and ".wide {" in page
    example = pd.read_csv(tmp_path / "rep" / "jct_example.csv")
    assert "config" not in example.columns and example.columns[0] == "label"  # the label once, not twice


def test_sections_must_be_section_functions(tmp_path):
    with pytest.raises(TypeError, match=r"sections\[1\] must be a section function.*got str 'cluster'"):
        build_report(tmp_path / "rep", sections=[section_cluster, "cluster"], quick=True, progress=False)
    assert not (tmp_path / "rep").exists()  # refused before anything is written


def test_partition_and_schedule_sections_give_the_busiest_rank_beside_the_slowest_stage():
    from pipeswift_lab import Profile
    from pipeswift_lab.faces.report.base import ReportContext
    from pipeswift_lab.faces.report.model import section_partition, section_timeline

    prof = Profile.synthetic(fwd_ms=[1.0 + i for i in range(8)], bwd_ms=[2.0 + 2 * i for i in range(8)])
    ctx = ReportContext(quick=True, progress=False, cache={"profile": prof})  # a profile instead of measuring one
    assert "ranks of the profiled GPT, v=1 stage each, so the slowest stage is the busiest rank" in (
        section_partition(ctx).intro_html
    )
    rows = section_timeline(ctx).tables["schedules"]
    one, two = rows[rows["v"] == 1], rows[rows["v"] == 2]
    assert len(one) and len(two)
    assert (one["busiest_rank_ms"] == one["slowest_stage_ms"]).all()  # one stage per rank
    assert (two["busiest_rank_ms"] > two["slowest_stage_ms"]).all()  # a rank works through its two stages
