"""The figures of the docs, drawn from the results the benchmarks wrote (bench/results/*.json) into
docs/images/*.png: `make plots`. Byte-stable: the same JSON gives the same bytes (matplotlib's default
style and its bundled font, no timestamp or version in the PNG), so a test can redraw them and compare.

    .venv/bin/python bench/plots.py [--out docs/images]

Each plot names the JSON it is drawn from (PLOTS: image -> (source, drawing function)).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
IMAGES = ROOT / "docs" / "images"


def peers(data: dict, ax_pair) -> None:
    """bench/peers.py (every server under vLLM's load generator): output tokens per second at each level of clients, one bar per server, its ratio to vLLM's above it."""
    results = data["results"]
    servers = list(dict.fromkeys(r["server"] for r in results))
    levels = sorted({r["clients"] for r in results})
    by = {(r["server"], r["clients"]): r["tok/s"] for r in results}
    reference = next((s for s in servers if s.startswith("vLLM")), None)
    for ax, clients in zip(ax_pair, levels):
        values = [by.get((s, clients), 0.0) for s in servers]
        bars = ax.bar(range(len(servers)), values, color=["#2b6cb0" if s.startswith("kvpilot") else "#a0aec0" for s in servers])
        ax.set_xticks(range(len(servers)), [s.replace(" CPU bf16", "\nCPU bf16") for s in servers], fontsize=8)
        ax.set_title(f"{clients} client{'s' if clients > 1 else ''}", fontsize=10)
        ax.set_ylabel("output tok/s", fontsize=9)
        if reference is not None:
            base = by[(reference, clients)]
            for bar, value in zip(bars, values):
                ax.annotate(f"{value / base:.2f}×", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, max(values) * 1.18)


PLOTS: dict[str, tuple[str, Callable]] = {
    "peers-xeon-no-amx.png": ("peers-xeon-no-amx.json", peers),
}


def draw(name: str, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    source, fn = PLOTS[name]
    data = json.loads((RESULTS / source).read_text())
    with matplotlib.rc_context(matplotlib.rcParamsDefault):  # no user matplotlibrc: the same bytes everywhere
        fig, axes = plt.subplots(1, 2, figsize=(8, 3), dpi=100)
        fn(data, axes)
        fig.suptitle(", ".join(part for part in data["machine"].split(", ") if not part.startswith("Python")), fontsize=9)
        fig.tight_layout()
        path = out / name
        fig.savefig(path, format="png", metadata={"Software": None})
        plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=IMAGES)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in PLOTS:
        print(draw(name, args.out))


if __name__ == "__main__":
    main()
