"""The phases of a CI run, from its log (`bash .ci/run 2>&1 | tee LOG`: .ci/phase prints each phase's
seconds, pytest its summaries), as JSON for bench/results/ (make plots draws it against the budget).

    .venv/bin/python bench/ci_time.py LOG --commit SHA [--tools-cached] [--json bench/results/ci-time.json]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save_results  # noqa: E402

PHASE = re.compile(r"^=== phase (\S+): (\d+)s, exit (\d+)")
PYTEST = re.compile(r"=+ (.*) in ([\d.]+)s")
TOTAL = re.compile(r"^make test: (\d+)s total")
BUDGET_MINUTES = 60  # the brief's CI budget on a fresh machine


def parse(text: str) -> dict:
    phases, pytest, total = [], [], None
    for line in text.splitlines():
        if m := PHASE.match(line):
            phases.append({"name": m[1], "seconds": int(m[2]), "exit": int(m[3])})
        elif m := PYTEST.search(line):
            pytest.append({"summary": m[1], "seconds": float(m[2])})
        elif m := TOTAL.match(line):
            total = int(m[1])
    if not phases or total is None:
        raise SystemExit("no .ci/phase lines or no 'make test: Ns total' in the log: is it a whole `bash .ci/run`?")
    return {"phases": phases, "pytest_runs": pytest, "total_seconds": total}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("log", type=Path)
    ap.add_argument("--commit", required=True, help="the commit the run tested")
    ap.add_argument("--tools-cached", action="store_true", help="the tools (apiserver, etcd, helm…) were already built: not a fresh machine")
    ap.add_argument("--json", help="write the phases here (bench/results/ci-time.json)")
    args = ap.parse_args()
    run = parse(args.log.read_text())
    for p in run["phases"]:
        print(f"{p['name']:8} {p['seconds']:6d} s  exit {p['exit']}")
    for p in run["pytest_runs"]:
        print(f"  pytest: {p['summary']} in {p['seconds']:.0f} s")
    print(f"total {run['total_seconds']} s ({run['total_seconds'] / 60:.1f} min) of a {BUDGET_MINUTES}-minute budget")
    if args.json:
        save_results(args.json, command=f"bash .ci/run 2>&1 | tee LOG; .venv/bin/python bench/ci_time.py LOG --commit {args.commit}"
                     + (" --tools-cached" if args.tools_cached else ""), commit=args.commit, tools_cached=args.tools_cached,
                     budget_minutes=BUDGET_MINUTES, results=run["phases"], pytest_runs=run["pytest_runs"],
                     total_seconds=run["total_seconds"])


if __name__ == "__main__":
    main()
