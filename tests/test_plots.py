"""The docs' images are drawn from committed results by `make plots` (bench/plots.py): redrawn here, each is
byte-for-byte the committed file (fresh, and stable for the same input — under constraints.txt's pins of
matplotlib and Pillow, which lay out and encode it), and every image a page links is one of them, with its
source JSON committed."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("kvpilot_bench_plots", ROOT / "bench" / "plots.py")  # (bench/ is no package)
plots = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plots)

PAGES = [ROOT / "README.md", ROOT / "bench" / "RESULTS.md", *sorted((ROOT / "bench" / "history").glob("*.md")), *sorted((ROOT / "docs").glob("*.md"))]
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+\.png)\)")


@pytest.mark.timeout(120)
def test_every_plot_redraws_to_the_committed_bytes(tmp_path):
    assert plots.PLOTS
    for name, (source, _) in plots.PLOTS.items():
        data = json.loads((plots.RESULTS / source).read_text())
        assert data["command"] and data["machine"] and (data.get("results") or data.get("points")), source  # what ran, where, and what it gave
        drawn = plots.draw(name, tmp_path)
        committed = plots.IMAGES / name
        assert committed.read_bytes() == drawn.read_bytes(), f"{name} is stale: run make plots"
        (tmp_path / "again").mkdir(exist_ok=True)
        assert plots.draw(name, tmp_path / "again").read_bytes() == drawn.read_bytes()


def test_every_linked_image_is_drawn_from_a_committed_result():
    linked = {(page.parent / target).resolve() for page in PAGES for target in IMAGE.findall(page.read_text())}
    readme = {(ROOT / target).resolve() for target in IMAGE.findall((ROOT / "README.md").read_text())}
    # the README shows the engine against its peers and the autoscaler following the load
    assert {(plots.IMAGES / "peers-xeon-no-amx.png").resolve(), (plots.IMAGES / "demo-timeline.png").resolve()} <= readme
    for path in linked:
        assert path.parent == plots.IMAGES.resolve() and path.name in plots.PLOTS, f"{path}: not drawn by bench/plots.py"
        assert path.is_file() and (plots.RESULTS / plots.PLOTS[path.name][0]).is_file()
    assert {p.name for p in plots.IMAGES.glob("*.png")} == set(plots.PLOTS), "an image no plot draws, or a plot not committed"
