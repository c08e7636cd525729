"""The chart's Grafana dashboard (charts/kvpilot/dashboards/kvpilot.json), its engine panels for every engine: each such
panel target keeps its query as `engineQuery`, whose `@signal@` placeholders name a signal of ENGINE_METRICS
(operator/builders/engines.py), and its `expr` is that query with each placeholder replaced by the signal's series of every
engine joined with `or` (a vLLM or SGLang pod's series fill the same panel as a kvpilot pod's).

    python -m kvpilot.operator.dashboard [--check]   # writes (or checks) the dashboard's engine queries; `make crds` runs it

Placeholders: `@kv@` (the series), `@rate:ttft:_bucket@` (each series' `_bucket` rate over Grafana's $__rate_interval).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from kvpilot.operator.builders.engines import ENGINE_METRICS

DASHBOARD = Path(__file__).resolve().parents[1] / "charts" / "kvpilot" / "dashboards" / "kvpilot.json"
SELECTOR = 'namespace="$namespace", inferenceservice=~"$inferenceservice"'
PLACEHOLDER = re.compile(r"@(?:(rate):)?([a-z_]+)(?::([a-z_]+))?@")


def series(signal: str, rate: bool = False, suffix: str = "") -> str:
    names = [name for engine in ENGINE_METRICS.values() for name in engine[signal]]
    names = list(dict.fromkeys(names))  # (one name, two signals' alternatives: once)
    one = [f"rate({n}{suffix}{{{SELECTOR}}}[$__rate_interval])" if rate else f"{n}{suffix}{{{SELECTOR}}}" for n in names]
    return "(" + " or ".join(one) + ")"


def expand(query: str) -> str:
    def one(m: re.Match) -> str:
        if m.group(2) not in ENGINE_METRICS["kvpilot"]:
            raise ValueError(f"{m.group(0)}: no signal {m.group(2)!r} in ENGINE_METRICS")
        return series(m.group(2), rate=m.group(1) == "rate", suffix=m.group(3) or "")
    return PLACEHOLDER.sub(one, query)


def render(dashboard: dict) -> dict:
    out = json.loads(json.dumps(dashboard))
    for panel in out["panels"]:
        for target in panel.get("targets", []):
            if "engineQuery" in target:
                target["expr"] = expand(target["engineQuery"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpilot.operator.dashboard")
    ap.add_argument("--check", action="store_true", help="fail when the committed dashboard is stale")
    args = ap.parse_args(argv)
    current = json.loads(DASHBOARD.read_text())
    fresh = render(current)
    if args.check:
        if fresh != current:
            print(f"{DASHBOARD} is stale: run make crds", file=sys.stderr)
            return 1
        return 0
    DASHBOARD.write_text(json.dumps(fresh, indent=1) + "\n")
    print(f"wrote {DASHBOARD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
