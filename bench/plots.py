"""The figures of the docs, drawn from the results the benchmarks wrote (bench/results/*.json) into
docs/images/*.png: `make plots`. Byte-stable: the same JSON gives the same bytes (matplotlib's default
style and its bundled font, no timestamp or version in the PNG; matplotlib and Pillow at constraints.txt's
pins), so a test can redraw them and compare.

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


def peers(data: dict, plt):
    """bench/peers.py (every server under vLLM's load generator): output tokens per second at each level of
    clients, one bar per server, its ratio to vLLM's above it."""
    results = data["results"]
    servers = list(dict.fromkeys(r["server"] for r in results))
    levels = sorted({r["clients"] for r in results})
    by = {(r["server"], r["clients"]): r["tok/s"] for r in results}
    reference = next((s for s in servers if s.startswith("vLLM")), None)
    fig, axes = plt.subplots(1, len(levels), figsize=(8, 3), dpi=100, squeeze=False)
    for ax, clients in zip(axes[0], levels):
        values = [by.get((s, clients), 0.0) for s in servers]
        bars = ax.bar(range(len(servers)), values, color=["#2b6cb0" if s.startswith("kvpilot") else "#a0aec0" for s in servers])
        ax.set_xticks(range(len(servers)), [s.replace(" CPU bf16", "\nCPU bf16") for s in servers], fontsize=8)
        ax.set_title(f"{clients} client{'s' if clients > 1 else ''}", fontsize=10)
        ax.set_ylabel("output tok/s", fontsize=9)
        if by.get((reference, clients)):  # the ratios to vLLM where it ran at this level
            base = by[(reference, clients)]
            for bar, value in zip(bars, values):
                ax.annotate(f"{value / base:.2f}×", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, max(values) * 1.18)
    return fig


def demo_timeline(data: dict, plt):
    """`make demo` (e2e/demo.py): the autoscaler following the load — replicas asked and ready with the load's
    clients; the queue depth and KV-cache use it read; TTFT p95 (by when the first token came) and answers per
    second over the last 10 s."""
    points = data["points"]
    t = [p["t"] for p in points]
    value = lambda key: [float("nan") if p[key] is None else p[key] for p in points]  # noqa: E731 - a gap where nothing was read
    fig, (top, mid, low) = plt.subplots(3, 1, figsize=(8, 6), dpi=100, sharex=True)
    clients = top.twinx()
    clients.fill_between(t, value("clients"), step="post", alpha=0.15, color="#718096")
    clients.set_ylabel("clients (shaded)", fontsize=9)
    top.step(t, value("replicas"), where="post", label="replicas asked")
    top.step(t, value("ready"), where="post", label="ready")
    top.set_ylabel("pods", fontsize=9)
    top.legend(loc="upper left", fontsize=8)
    mid.plot(t, value("queue_depth"), color="#2b6cb0")
    mid.set_ylabel("queue depth\n(mean per pod)", fontsize=9, color="#2b6cb0")
    kv = mid.twinx()
    kv.plot(t, value("kv_cache_utilization"), color="#dd6b20")
    kv.set_ylabel("KV-cache use", fontsize=9, color="#dd6b20")
    low.plot(t, value("ttft_p95_s"), color="#2b6cb0")
    low.set_ylabel("TTFT p95, s", fontsize=9, color="#2b6cb0")
    rate = low.twinx()
    rate.plot(t, value("answers_per_s"), color="#dd6b20")
    rate.set_ylabel("answers / s", fontsize=9, color="#dd6b20")
    low.set_xlabel("seconds", fontsize=9)
    return fig


def kv_tiers_ttft(data: dict, plt):
    """bench/kv_tiers.py --parts ttft: the time to the first token of a prompt whose long prefix is recomputed,
    or read back from the disk tier (after an eviction, after a restart) or the host tier."""
    results = data["results"]
    fig, ax = plt.subplots(figsize=(8, 2.6), dpi=100)
    names = [r["path"].replace("tier after", "disk tier after").replace("host disk tier", "host tier") for r in results][::-1]
    values = [r["ttft_s"] for r in results][::-1]
    base = {r["path"]: r["ttft_s"] for r in results}["recompute"]  # (the run always measures it: the ratios' base)
    bars = ax.barh(range(len(names)), values, color=["#a0aec0" if n == "recompute" else "#2b6cb0" for n in names])
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xlabel(f"TTFT, s (a {data['prefix_tokens']}-token prefix + 16 new tokens; median of {data['rounds']})", fontsize=9)
    for bar, value in zip(bars, values):
        ax.annotate(f" {value:.3f} s ({value / base:.2f}×)", (value, bar.get_y() + bar.get_height() / 2), va="center", fontsize=8)
    ax.set_xlim(0, max(values) * 1.3)
    return fig


def pipeline(data: dict, plt):
    """bench/tp.py --only pp: output tokens per second of one rank and of two pipeline stages at each number of
    streams (the ratio above), and each stage's idle share."""
    rows = data["results"]
    number = lambda text: float(text.rstrip("%"))  # noqa: E731 - the table's cells ("12.9", "57%")
    streams = [str(r["streams"]) for r in rows]
    fig, (rate, idle) = plt.subplots(1, 2, figsize=(8, 3), dpi=100)
    x, width = range(len(rows)), 0.38
    one = [number(r["1 rank tok/s"]) for r in rows]
    two = [number(r["PP=2 tok/s"]) for r in rows]
    rate.bar([i - width / 2 for i in x], one, width, color="#a0aec0", label="1 rank")
    bars = rate.bar([i + width / 2 for i in x], two, width, color="#2b6cb0", label="PP=2")
    for bar, b, r in zip(bars, two, rows):  # (the run's ratio, of the unrounded rates)
        rate.annotate(f"{r['PP=2 / 1 rank']}×", (bar.get_x() + bar.get_width() / 2, b), ha="center", va="bottom", fontsize=8)
    rate.set_xticks(list(x), streams)
    rate.set_xlabel("streams", fontsize=9)
    rate.set_ylabel("output tok/s", fontsize=9)
    rate.set_ylim(0, max(one + two) * 1.18)
    rate.legend(fontsize=8, loc="upper left")
    for k, color in ((0, "#4a5568"), (1, "#63b3ed")):
        idle.bar([i + (k - 0.5) * width for i in x], [number(r[f"stage {k} idle"]) for r in rows], width, color=color, label=f"stage {k}")
    idle.set_xticks(list(x), streams)
    idle.set_xlabel("streams", fontsize=9)
    idle.set_ylabel("idle share, %", fontsize=9)
    idle.set_ylim(0, 100)
    idle.legend(fontsize=8)
    return fig


def quant_quality(data: dict, plt):
    """bench/quant_quality.py: each weight format against fp32 — the mean KL of the next-token distributions
    (log scale; a mean that rounds to zero or below drawn at the floor, labelled ≈0) and how many of the
    greedy continuations are identical."""
    results = data["results"]
    names = [r["mode"] for r in results]
    floor = 1e-10
    fig, (kl, same) = plt.subplots(1, 2, figsize=(8, 2.8), dpi=100)
    values = [max(r["mean KL"], floor) for r in results]
    bars = kl.bar(range(len(names)), values, color="#2b6cb0", log=True)
    for bar, r in zip(bars, results):
        kl.annotate("≈0" if r["mean KL"] < floor else f"{r['mean KL']:.1e}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    kl.set_xticks(range(len(names)), names, fontsize=8)
    kl.set_ylim(floor / 3, max(values) * 30)
    kl.set_ylabel("mean KL(fp32 ‖ format)", fontsize=9)
    bars = same.bar(range(len(names)), [r["identical continuations"] for r in results], color="#dd6b20")
    for bar, r in zip(bars, results):
        same.annotate(f"argmax {r['argmax agreement']:.3f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                      va="bottom", fontsize=7)
    same.set_xticks(range(len(names)), names, fontsize=8)
    same.set_ylim(0, data["prompts"] * 1.2)
    same.set_ylabel(f"identical {data['generated_tokens']}-token\ncontinuations (of {data['prompts']})", fontsize=9)
    return fig


def speculation(data: dict, plt):
    """bench/spec.py: output tokens per second of each speculative engine relative to plain decoding, per
    workload (copying text, ordinary chat, 16 clients at once); the acceptance rate under each bar."""
    rows = [r for r in data["results"] if r["engine"] != "plain"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    engines = list(dict.fromkeys(r["engine"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 3), dpi=100)
    width = 0.8 / len(engines)
    for k, engine in enumerate(engines):
        for i, w in enumerate(workloads):
            row = next((r for r in rows if r["engine"] == engine and r["workload"] == w), None)
            if row is None:
                continue
            ratio = float(row["vs plain"].rstrip("x×"))
            x = i + (k - (len(engines) - 1) / 2) * width
            ax.bar(x, ratio, width, color=f"C{k}", label=engine if i == 0 else None)
            ax.annotate(f"{ratio:.2f}×", (x, ratio), ha="center", va="bottom", fontsize=7)
            if row["acceptance"]:
                ax.annotate(row["acceptance"].split(" of ")[0], (x, 0.05), ha="center", va="bottom", fontsize=7, color="white")
    ax.axhline(1.0, color="#4a5568", linewidth=0.8)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_xlabel("workload (in white: the share of proposed tokens accepted)", fontsize=9)
    ax.set_ylabel("output tok/s vs plain", fontsize=9)
    ax.set_ylim(0, max(float(r["vs plain"].rstrip("x×")) for r in rows) * 1.2)
    ax.legend(fontsize=8, loc="upper right")
    return fig


def prefill_decode(data: dict, plt):
    """bench/pd.py: the time to the first token when one engine computes the prompt, against prefill on one
    engine then the decode engine's pull of the blocks and first token (the handoff's cost is the difference)."""
    rows = data["results"]
    fig, ax = plt.subplots(figsize=(8, 2.6), dpi=100)
    labels, y = [], 0
    for r in rows:
        ax.barh(y + 0.2, r["aggregated_ttft_s"], 0.38, color="#a0aec0")
        ax.barh(y - 0.2, r["prefill_s"], 0.38, color="#2b6cb0")
        ax.barh(y - 0.2, r["decode_pull_first_token_s"], 0.38, left=r["prefill_s"], color="#dd6b20")
        ax.annotate(f" pull {r['pull_gb_per_s']:.2f} GB/s, {r['pull_ms_per_block']:.2f} ms/block", (r["prefill_s"] + r["decode_pull_first_token_s"], y - 0.2),
                    va="center", fontsize=8)
        labels.append(f"{r['prompt_tokens']} tokens")
        y += 1
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.set_xlabel("seconds to the first token: one engine (grey); prefill (blue) + decode's pull and first token (orange)", fontsize=8)
    ax.set_xlim(0, max(r["prefill_s"] + r["decode_pull_first_token_s"] for r in rows) * 1.45)
    return fig


def gateway(data: dict, plt):
    """e2e/test_gateway.py: the engines' prefix-cache hit rate and the time to the first token of the same
    shared-prefix load through kvpilot-gateway (prefix affinity) and round-robin to the same pods."""
    rows = data["results"]
    names = [r["routing"] for r in rows]
    fig, (hits, ttft) = plt.subplots(1, 2, figsize=(8, 2.8), dpi=100)
    bars = hits.bar(range(len(rows)), [r["hit_rate"] for r in rows], color=["#2b6cb0", "#a0aec0"])
    for bar, r in zip(bars, rows):
        hits.annotate(f"{r['hit_rate']:.3f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    hits.set_xticks(range(len(rows)), names, fontsize=8)
    hits.set_ylim(0, 1.1)
    hits.set_ylabel("prefix-cache hit rate", fontsize=9)
    ttft.boxplot([r["ttft_s"] for r in rows], showfliers=False)
    ttft.set_xticks(range(1, len(rows) + 1), [f"{n}\np50 {r['ttft_p50_s'] * 1000:.0f} ms" for n, r in zip(names, rows)], fontsize=8)
    ttft.set_ylabel("TTFT, s", fontsize=9)
    fig.text(0.01, 0.01, f"{data['replicas']} replicas, {data['system_prompts']} system prompts x {data['users']} users", fontsize=7)
    return fig


def cold_start(data: dict, plt):
    """bench/cold_start.py: replicas 0 → 1 to the first token by phase (the operator's status.lastColdStart),
    medians, with the model downloaded in the pod (PerPod) and from the model cache's entry (Shared)."""
    rows = data["results"]
    fig, ax = plt.subplots(figsize=(8, 2.4), dpi=100)
    for y, r in enumerate(rows):
        left = 0.0
        for k, phase in enumerate(data["phases"]):
            ax.barh(y, r[phase], left=left, color=f"C{k}", label=phase if y == 0 else None)
            left += r[phase]
        ax.annotate(f" first token {r['first_token']:.2f} s", (left, y), va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r["mode"] for r in rows], fontsize=8)
    ax.set_xlabel(f"seconds (medians of {data['rounds']} starts)", fontsize=9)
    ax.set_xlim(0, max(sum(r[p] for p in data["phases"]) for r in rows) * 1.35)
    ax.legend(fontsize=7, ncol=len(data["phases"]), loc="upper center", bbox_to_anchor=(0.5, 1.35))
    return fig


def ci_time(data: dict, plt):
    """bench/ci_time.py: the phases of a `bash .ci/run` one after another (the pytest phase as its runs, in
    order) against the 60-minute budget."""
    phases = [p for p in data["results"] if p["name"] != "pytest"]
    phases += [{"name": f"pytest: {r['summary'].split(',')[0]}", "seconds": r["seconds"]} for r in data["pytest_runs"]]
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.32 * len(phases)), dpi=100)
    start = 0.0
    for y, p in enumerate(phases):
        minutes = p["seconds"] / 60
        ax.barh(y, max(minutes, 0.15), left=start, color="#2b6cb0")
        ax.annotate(f" {minutes:.1f} min", (start + max(minutes, 0.15), y), va="center", fontsize=7)
        start += minutes
    ax.axvline(data["budget_minutes"], color="#c53030", linewidth=1.2)
    ax.annotate(f"budget {data['budget_minutes']} min ", (data["budget_minutes"], len(phases) - 1), ha="right", va="center", fontsize=8,
                color="#c53030")
    ax.set_yticks(range(len(phases)), [p["name"] for p in phases], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, data["budget_minutes"] * 1.05)
    ax.set_xlabel(f"minutes; {data['total_seconds'] / 60:.1f} in all, commit {data['commit']}"
                  + (" (tools already built)" if data["tools_cached"] else " (a fresh machine)"), fontsize=8)
    return fig


PLOTS: dict[str, tuple[str, Callable]] = {
    "peers-xeon-no-amx.png": ("peers-xeon-no-amx.json", peers),
    "peers-xeon-amx.png": ("peers-xeon-amx.json", peers),
    "demo-timeline.png": ("demo-timeline.json", demo_timeline),
    "kv-tiers-ttft.png": ("kv-tiers-ttft.json", kv_tiers_ttft),
    "pipeline-xeon-no-amx.png": ("pipeline-xeon-no-amx.json", pipeline),
    "quant-quality.png": ("quant-quality.json", quant_quality),
    "spec.png": ("spec.json", speculation),
    "pd.png": ("pd.json", prefill_decode),
    "gateway.png": ("gateway.json", gateway),
    "cold-start.png": ("cold-start.json", cold_start),
    "ci-time.png": ("ci-time.json", ci_time),
}


def draw(name: str, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    source, fn = PLOTS[name]
    data = json.loads((RESULTS / source).read_text())
    with matplotlib.rc_context(matplotlib.rcParamsDefault):  # no user matplotlibrc: the same bytes everywhere
        fig = fn(data, plt)
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
