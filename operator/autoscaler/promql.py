"""Per-pod engine metrics from Prometheus's HTTP API, with each engine's metric names.

Series are matched on the labels Prometheus's pod discovery adds (namespace, inferenceservice, role);
the sample timestamps come back too (`timestamp()`), so the decision can tell stale from fresh.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import httpx

from kvpilot.operator.autoscaler.decision import CLOCK_SKEW_SECONDS, PodSample
from kvpilot.operator.builders.engines import ENGINE_METRICS  # (each engine's names; alternatives joined with `or`)


class MetricsUnavailable(RuntimeError):
    pass


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _labels(namespace: str, isvc: str, prefill: bool) -> str:
    """The service's own pods (of a disaggregated service: the decode pool; a series without a role matches role!=) or its prefill pool."""
    return f'namespace="{_escape(namespace)}",inferenceservice="{_escape(isvc)}",role{"=" if prefill else "!="}"prefill"'


def signal_query(engine: str, signal: str, namespace: str, isvc: str, prefill: bool = False) -> str:
    parts = [f"{name}{{{_labels(namespace, isvc, prefill)}}}" for name in ENGINE_METRICS[engine][signal]]
    return "max by (pod) (" + " or ".join(parts) + ")"


def timestamp_query(engine: str, signal: str, namespace: str, isvc: str, prefill: bool = False) -> str:
    parts = [f"timestamp({name}{{{_labels(namespace, isvc, prefill)}}})" for name in ENGINE_METRICS[engine][signal]]
    return "max by (pod) (" + " or ".join(parts) + ")"


@dataclass(frozen=True, slots=True)
class GatewayActivity:
    """What the gateways (kvpilot_gateway_*, summed over gateway replicas) report for one model."""

    requests: float      # requests answered, ever (a counter: any change means traffic)
    active: float        # requests being proxied or held for a replica now
    timestamp: float     # unix seconds of the oldest gateway's newest sample: every replica must be fresh


def gateway_queries(model: str) -> dict[str, str]:
    sel = f'{{model="{_escape(model)}"}}'
    # kvpilot_gateway_held_requests exists for every model a gateway knows (0 when none is held): its presence
    # is what tells "no traffic" from "no gateway reporting".
    return {"present": f"count(kvpilot_gateway_held_requests{sel})",
            "timestamp": f"min(timestamp(kvpilot_gateway_held_requests{sel}))",
            "requests": f"sum(kvpilot_gateway_requests_total{sel})",
            "active": f"sum(kvpilot_gateway_held_requests{sel}) + (sum(kvpilot_gateway_in_flight_requests{sel}) or vector(0))"}


@dataclass
class PrometheusSource:
    url: str
    timeout: float = 5.0

    def _query(self, promql: str) -> dict[str, float]:
        """{pod: value} of an instant vector. Anything else Prometheus might answer (an error page, a
        scalar, a value that is not a number) is MetricsUnavailable, never an exception that stops the loop."""
        try:
            r = httpx.get(self.url.rstrip("/") + "/api/v1/query", params={"query": promql}, timeout=self.timeout)
        except httpx.HTTPError as e:
            raise MetricsUnavailable(f"Prometheus at {self.url} unreachable: {type(e).__name__}") from e
        if r.status_code != 200:
            raise MetricsUnavailable(f"Prometheus answered {r.status_code}: {r.text[:200]}")
        try:
            body = r.json()
        except ValueError:
            raise MetricsUnavailable(f"Prometheus answered something that is not JSON: {r.text[:100]!r}") from None
        if not isinstance(body, dict) or body.get("status") != "success":
            raise MetricsUnavailable(f"Prometheus query failed: {body.get('error', body) if isinstance(body, dict) else body!r}"[:300])
        data = body.get("data")
        if not isinstance(data, dict) or data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
            raise MetricsUnavailable(f"Prometheus answered no instant vector: {str(data)[:200]}")
        out = {}
        for item in data["result"]:
            try:
                pod, value = str(item["metric"].get("pod", "")), float(item["value"][1])
            except (KeyError, TypeError, ValueError, IndexError, AttributeError):
                raise MetricsUnavailable(f"Prometheus answered a malformed sample: {str(item)[:200]}") from None
            if not math.isfinite(value):
                raise MetricsUnavailable(f"pod {pod} reports a non-finite value ({value}) for {promql}")
            out[pod] = value
        return out

    def pod_samples(self, engine: str, namespace: str, isvc: str, prefill: bool = False) -> list[PodSample]:
        """The service's own pods' samples (prefill: its prefill pool's)."""
        kv = self._query(signal_query(engine, "kv", namespace, isvc, prefill))
        queue = self._query(signal_query(engine, "queue", namespace, isvc, prefill))
        kv_ts = self._query(timestamp_query(engine, "kv", namespace, isvc, prefill))
        queue_ts = self._query(timestamp_query(engine, "queue", namespace, isvc, prefill))
        now = time.time()
        for what, values in (("KV-cache utilization", kv), ("queue depth", queue)):
            negative = {p: v for p, v in values.items() if v < 0}
            if negative:
                raise MetricsUnavailable(f"negative {what} reported: {negative}")
        future = {p: t for p, t in (kv_ts | queue_ts).items() if t > now + CLOCK_SKEW_SECONDS}
        if future:
            raise MetricsUnavailable(f"samples stamped in the future (more than {CLOCK_SKEW_SECONDS:g} s ahead): {sorted(future)}")
        out = []
        for pod in sorted(set(kv) | set(queue)):
            ts = min(t for t in (kv_ts.get(pod), queue_ts.get(pod)) if t is not None) if (pod in kv_ts or pod in queue_ts) else 0.0
            out.append(PodSample(pod, kv.get(pod), queue.get(pod), ts))
        return out

    def gateway_activity(self, model: str) -> GatewayActivity | None:
        """None when no gateway reports the model (no gateway deployed, or it never scraped)."""
        q = {k: self._query(v) for k, v in gateway_queries(model).items()}
        if not q["present"]:
            return None
        return GatewayActivity(sum(q["requests"].values()), sum(q["active"].values()), min(q["timestamp"].values()))

    def engines_busy(self, engine: str, namespace: str, isvc: str) -> float:
        """Requests running or waiting in the engines (also those sent to the Service directly, past the gateway)."""
        busy = self._query(signal_query(engine, "running", namespace, isvc))
        waiting = self._query(signal_query(engine, "queue", namespace, isvc))
        return sum(busy.values()) + sum(waiting.values())
