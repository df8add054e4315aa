import math

import matplotlib
import pytest

from pipeswift_lab import JCT

matplotlib.use("Agg")


def test_total_and_fractions():
    j = JCT(queue_s=100, assembly_s=50, training_s=800, cleanup_s=30, preemption_loss_s=20)
    assert j.total_s == 1000
    assert j.fractions == {
        "queue_s": 0.1,
        "assembly_s": 0.05,
        "training_s": 0.8,
        "cleanup_s": 0.03,
        "preemption_loss_s": 0.02,
    }
    assert list(j.df["term"]) == ["queue_s", "assembly_s", "training_s", "cleanup_s", "preemption_loss_s"]
    assert j.df["seconds"].sum() == 1000
    assert JCT().fractions["training_s"] == 0.0


def test_frozen_and_replace():
    j = JCT(training_s=10)
    with pytest.raises(AttributeError):
        j.training_s = 5
    assert j.replace(queue_s=5).total_s == 15
    assert j.total_s == 10


def test_compare_gives_differences_from_the_first():
    a = JCT(queue_s=7200, training_s=3600, label="wait for 32")
    b = JCT(queue_s=0, training_s=7000, label="start on 16")
    c = JCT(queue_s=0, training_s=9000, label="start on 8")
    table = JCT.compare(a, b, c).set_index("term")
    assert table.loc["queue_s", "start on 16 - wait for 32"] == -7200
    assert table.loc["total_s", "start on 16 - wait for 32"] == -3800
    assert table.loc["total_s", "start on 8 - wait for 32"] == -1800
    assert table.loc["training_s", "start on 8"] == 9000


def test_compare_needs_distinct_labels_and_two_jcts():
    with pytest.raises(ValueError, match="labels must be distinct"):
        JCT.compare(JCT(), JCT())
    with pytest.raises(ValueError, match="at least two"):
        JCT.compare(JCT())
    with pytest.raises(TypeError, match="takes JCT objects"):
        JCT.table(JCT(), 3)


@pytest.mark.parametrize("term", ["queue_s", "assembly_s", "training_s", "cleanup_s", "preemption_loss_s"])
def test_bad_terms_are_refused(term):
    with pytest.raises(ValueError, match=f"{term}=-1.0 is invalid; it must be >= 0"):
        JCT(**{term: -1})
    with pytest.raises(ValueError, match=f"{term}=nan is invalid"):
        JCT(**{term: math.nan})


def test_plot_stacks_one_bar_per_jct():
    a, b = JCT(training_s=3600, label="a"), JCT(queue_s=1800, training_s=1800, label="b")
    ax = a.plot(b, unit="h")
    # five terms x two bars
    assert len(ax.patches) == 10
    widths = sorted(p.get_width() for p in ax.patches if p.get_width() > 0)
    assert widths == pytest.approx([0.5, 0.5, 1.0])
    with pytest.raises(ValueError, match="unit='days'"):
        a.plot(unit="days")


def test_repr_html_and_str():
    j = JCT(training_s=7200, label="run")
    assert "JCT run: 2 h" in j._repr_html_()
    assert "training_s" in str(j)
