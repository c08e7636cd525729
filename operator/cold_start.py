"""An engine pod's cold start, split into phases, once it turns Ready.

The pod's own timestamps give creation, scheduling and readiness (whole seconds: the API server's
resolution); the kvpilot engine's /metrics gives when its process started and its own phases
(`kvpilot:engine_start_time_seconds`, `kvpilot:engine_startup_phase_seconds`, server/startup.py). In
order: scheduling (created -> scheduled), model (scheduled -> engine process start: image pull, the
init container's download — or nothing with the model cache), import, load, warmup, listen (the
engine's), ready (listening -> the pod Ready: probes). Engines without these metrics (vLLM, SGLang)
get scheduling, model (to the container's start) and ready (the rest).
"""

from __future__ import annotations

from datetime import datetime

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.operator.crd_types import ColdStart, ColdStartPhase

ENGINE_PHASES = ("import", "load", "warmup", "listen")
PHASES = ("scheduling", "model", *ENGINE_PHASES, "ready")


def _time(stamp: str | None) -> float | None:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() if stamp else None


def _condition_time(pod: dict, type_: str) -> float | None:
    c = next((c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == type_ and c.get("status") == "True"), None)
    return _time(c.get("lastTransitionTime")) if c else None


def engine_startup(metrics_text: str) -> tuple[float | None, dict[str, float]]:
    """(process start, {phase: seconds}) from a kvpilot engine's /metrics text."""
    start, phases = None, {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "kvpilot:engine_start_time_seconds":
                start = sample.value
            elif sample.name == "kvpilot:engine_startup_phase_seconds" and sample.labels.get("phase") in ENGINE_PHASES:
                phases[sample.labels["phase"]] = sample.value
    return start, phases


def read_engine_startup(url: str) -> tuple[float | None, dict[str, float]]:
    """The engine's start-up record, or nothing (not a kvpilot engine, unreachable)."""
    try:
        r = httpx.get(url, timeout=3)
        return engine_startup(r.text) if r.status_code == 200 else (None, {})
    except (httpx.HTTPError, ValueError):
        return None, {}


def cold_start(pod: dict, engine_start: float | None, engine_phases: dict[str, float]) -> ColdStart | None:
    """The phases of a Ready pod's start; None while it is not Ready."""
    created, scheduled, ready = _time(pod["metadata"].get("creationTimestamp")), _condition_time(pod, "PodScheduled"), _condition_time(pod, "Ready")
    if created is None or ready is None:
        return None
    scheduled = scheduled if scheduled is not None else created
    seconds: dict[str, float] = {"scheduling": scheduled - created}
    if engine_start is not None:
        seconds["model"] = engine_start - scheduled
        seconds.update((p, engine_phases[p]) for p in ENGINE_PHASES if p in engine_phases)
        seconds["ready"] = ready - engine_start - sum(engine_phases.get(p, 0.0) for p in ENGINE_PHASES)
    else:
        running = next((((cs.get("state") or {}).get("running") or {}).get("startedAt") for cs in (pod.get("status") or {}).get("containerStatuses") or []
                        if cs.get("name") == "engine"), None)
        started = _time(running) if running else scheduled
        seconds["model"], seconds["ready"] = started - scheduled, ready - started
    ready_stamp = next(c["lastTransitionTime"] for c in pod["status"]["conditions"] if c.get("type") == "Ready" and c.get("status") == "True")
    return ColdStart(pod=pod["metadata"]["name"], ready_time=ready_stamp, total_seconds=round(max(0.0, ready - created), 3),
                     phases=[ColdStartPhase(name=p, seconds=round(max(0.0, seconds[p]), 3)) for p in PHASES if p in seconds])
