"""Every notebook shows its figures when opened without running: a cell that plots stores an inline PNG.

nbval runs the notebooks headless (``MPLBACKEND=Agg``, set in the root conftest) and checks no pictures, so a
notebook whose saved outputs were made with a non-inline backend shows a reader nothing. These tests read the saved
notebooks as a reader's Jupyter opens them.
"""

import json
import re
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))

#: A call that draws: ``.plot(``, ``plot_*(``, ``.plot_*(``, seaborn's ``*plot(``, ``plt.subplots(``/``figure(``,
#: ``heatmap(``, ``gantt(``. Set-up calls (``sns.set_theme``) draw nothing.
DRAWS = re.compile(r"\.plot\(|\bplot_\w+\(|\.plot_\w+\(|\bsns\.\w*plot\(|\bplt\.(subplots|figure)\(|heatmap\(|gantt\(")


def code_cells(path):
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def stored_images(cell):
    return sum("image/png" in out.get("data", {}) for out in cell.get("outputs", []))


def figure_reprs(cell):
    """Outputs that stand for a figure the backend did not draw inline (``<Figure size 640x480 with 1 Axes>``)."""
    texts = ("".join(out.get("data", {}).get("text/plain", "")) for out in cell.get("outputs", []))
    return [t for t in texts if t.startswith("<Figure size")]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_cell_that_plots_stores_an_image(path):
    cells = code_cells(path)
    blind = [
        (i, "".join(c["source"]).splitlines()[0])
        for i, c in enumerate(cells)
        if (DRAWS.search("".join(c["source"])) or figure_reprs(c)) and not stored_images(c)
    ]
    assert not blind, (
        f"{path.name}: code cells that plot but store no image/png (execute with the inline backend): {blind}"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_cell_stores_a_figure_it_did_not_draw(path):
    reprs = [(i, figure_reprs(c)) for i, c in enumerate(code_cells(path)) if figure_reprs(c) and not stored_images(c)]
    assert not reprs, f"{path.name}: figures stored as text only: {reprs}"


def test_the_rule_sees_a_plot_and_its_image():
    plotting = {"source": ["ax = part.plot();"], "outputs": []}
    drawn = {"source": ["sns.barplot(data=df, x='a', y='b');"], "outputs": [{"data": {"image/png": "iVBOR"}}]}
    setup = {"source": ["sns.set_theme(style='whitegrid')"], "outputs": []}
    assert DRAWS.search("".join(plotting["source"])) and not stored_images(plotting)
    assert DRAWS.search("".join(drawn["source"])) and stored_images(drawn) == 1
    assert not DRAWS.search("".join(setup["source"]))
