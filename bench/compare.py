"""This checkout's engine against an earlier commit's, interleaved, on this machine (speed-regression check).

    .venv/bin/python bench/compare.py --baseline REV [--candidate REV] [--rounds 2] [--repeats 3] [--quantization gguf] [--clients 16] [--force]

The baseline is exported from git into the cache and imported as `kvpilot` through a PYTHONPATH
overlay (each run prints which tree it loaded); so is --candidate, when given (a commit measured while
the working tree changes), instead of this checkout. Offline: each side runs its own bench/offline.py
(--skip-hf) in a fresh process, alternating sides and starting sides in turn, `--rounds` times.
Both sides run with --quantization (default none: fp32 weights).
Serving: both servers run side by side; at --clients (16) clients each repetition sends the same fresh prompts
to both, in a rotating order (bench/serve.py's client). Reported: each side's figures (offline: the
median over rounds; serving: all repetitions' tokens over their wall time) and new/old.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import machine, refuse_if_busy, table  # noqa: E402
from serve import combine, level, wait_ready, workload  # noqa: E402

from kvpilot.kernels.cache import cache_root  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def export_baseline(rev: str) -> tuple[str, Path, Path]:
    """(commit, its tree, a PYTHONPATH entry whose kvpilot/ namespace holds that tree's folders)."""
    commit = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    tree = cache_root() / "bench" / f"baseline-{commit[:12]}"
    if not (tree / "server").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    overlay = tree.parent / f"overlay-{commit[:12]}"
    (overlay / "kvpilot").mkdir(parents=True, exist_ok=True)
    for folder in ("server", "kernels", "operator"):
        link = overlay / "kvpilot" / folder
        if not link.exists():
            link.symlink_to(tree / folder)
    return commit, tree, overlay


def offline_once(script: Path, env: dict, quantization: str) -> tuple[float, float]:
    out = subprocess.run([sys.executable, str(script), "--skip-hf", "--force", "--quantization", quantization],
                         capture_output=True, text=True, env=env, check=True).stdout
    row = next(line for line in out.splitlines() if line.startswith("| kvpilot"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    return float(cells[1]), float(re.match(r"[\d.]+", cells[5]).group())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", required=True, help="git revision to compare against")
    ap.add_argument("--candidate", help="git revision to measure (default: this checkout as it is)")
    ap.add_argument("--rounds", type=int, default=3, help="offline runs per side")
    ap.add_argument("--repeats", type=int, default=3, help="serving repetitions")
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients while serving")
    ap.add_argument("--quantization", default="none", choices=["none", "gguf", "int8", "int4"], help="weights of both sides")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    commit, tree, overlay = export_baseline(args.baseline)
    old_env = {**os.environ, "PYTHONPATH": str(overlay)}
    new_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    new_root, new_label = ROOT, "this checkout"
    if args.candidate:
        candidate, new_root, candidate_overlay = export_baseline(args.candidate)
        new_env, new_label = {**os.environ, "PYTHONPATH": str(candidate_overlay)}, f"candidate {candidate[:9]}"
    for name, env in (("baseline", old_env), (new_label, new_env)):
        where = subprocess.run([sys.executable, "-c", "import kvpilot.server.engine.llm_engine as m; print(m.__file__)"],
                               capture_output=True, text=True, env=env, check=True).stdout.strip()
        print(f"{name}: kvpilot from {where}", file=sys.stderr)
    sides = {"old": (tree / "bench" / "offline.py", old_env), "new": (new_root / "bench" / "offline.py", new_env)}
    offline: dict[str, list[tuple[float, float]]] = {"old": [], "new": []}
    for r in range(args.rounds):
        for side in (["old", "new"] if r % 2 == 0 else ["new", "old"]):
            offline[side].append(offline_once(*sides[side], args.quantization))
            print(f"offline round {r} {side}: {offline[side][-1]}", file=sys.stderr, flush=True)

    kv = ["serve", "--host", "127.0.0.1", "--num-threads", "2", "--max-num-seqs", "16", "--max-waiting-requests", "1000",
          "--quantization", args.quantization]
    servers = {"old": ([sys.executable, "-m", "kvpilot.server.cli", *kv, "--port", "18190"], "http://127.0.0.1:18190", old_env),
               "new": ([sys.executable, "-m", "kvpilot.server.cli", *kv, "--port", "18191"], "http://127.0.0.1:18191", new_env)}
    procs, runs = {}, {"old": [], "new": []}
    try:
        for side, (cmd, url, env) in servers.items():
            procs[side] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
            wait_ready(url, "/ready", procs[side])
            asyncio.run(level(url, "smollm2-135m", workload(2, 99), 2))  # warm-up
        for rep in range(args.repeats):
            reqs = workload(max(4, 2 * args.clients), seed=1000 * args.clients + rep)
            for side in (["old", "new"] if rep % 2 == 0 else ["new", "old"]):
                runs[side].append(asyncio.run(level(servers[side][1], "smollm2-135m", reqs, args.clients)))
                print(f"serve rep {rep} {side}: {runs[side][-1]['tok/s']:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(30)
    serve = {side: combine(r) for side, r in runs.items()}
    # Medians: on a shared VM a single run can lose half its speed to a neighbour (seen: 121 then 70
    # tok/s for the same code within minutes); the median of rounds is what one side typically does.
    middle = statistics.median
    serve_col = f"serve {args.clients} clients tok/s"
    rows = []
    for side, label in (("old", f"baseline {commit[:9]}"), ("new", new_label)):
        rows.append({"engine": label, "offline tok/s": f"{middle([t for t, _ in offline[side]]):.1f}",
                     "single-stream tok/s": f"{middle([s for _, s in offline[side]]):.1f}",
                     serve_col: f"{serve[side]['tok/s']:.1f}", "errors": serve[side]["errors"]})
    rows.append({"engine": "new / old", "offline tok/s": f"{middle([t for t, _ in offline['new']]) / middle([t for t, _ in offline['old']]):.3f}x",
                 "single-stream tok/s": f"{middle([s for _, s in offline['new']]) / middle([s for _, s in offline['old']]):.3f}x",
                 serve_col: f"{serve['new']['tok/s'] / serve['old']['tok/s']:.3f}x"})
    print(f"machine: {machine()}")
    for side in ("old", "new"):
        print(f"offline runs, {side}: tok/s {[f'{t:.1f}' for t, _ in offline[side]]}, single stream {[f'{x:.1f}' for _, x in offline[side]]}")
    print(table(rows, ["engine", "offline tok/s", "single-stream tok/s", serve_col, "errors"]))


if __name__ == "__main__":
    main()
