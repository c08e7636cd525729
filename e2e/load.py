"""A bounded load generator: concurrent clients sending completions to the ready pod IPs of an
InferenceService (never a ClusterIP: there is no kube-proxy here). Stops by itself.

The ready pod IPs come from the Pods API, the same facts the EndpointSlice controller uses: here it
cannot publish them, because the API server rejects loopback addresses in EndpointSlices
("may not be in the loopback range") and kwok's pod IPs are loopback addresses."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from e2e.net import require_loopback


def ready_endpoints(api: httpx.Client, server: str, namespace: str, service: str) -> list[str]:
    """http://podIP:port of the Service's ready, non-terminating pods."""
    svc = api.get(f"{server}/api/v1/namespaces/{namespace}/services/{service}")
    svc.raise_for_status()
    spec = svc.json()["spec"]
    selector = ",".join(f"{k}={v}" for k, v in spec["selector"].items())
    port = spec["ports"][0].get("targetPort", spec["ports"][0]["port"])
    r = api.get(f"{server}/api/v1/namespaces/{namespace}/pods", params={"labelSelector": selector})
    r.raise_for_status()
    out = []
    for pod in r.json()["items"]:
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])
        if ready and not pod["metadata"].get("deletionTimestamp") and pod["status"].get("podIP"):
            if isinstance(port, str):  # a named port
                port = next(p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports") or [] if p.get("name") == port)
            out.append(f"http://{require_loopback(pod['status']['podIP'])}:{port}")
    return sorted(out)


@dataclass
class LoadGenerator:
    api: httpx.Client
    server: str
    namespace: str
    service: str
    clients: int = 6
    max_tokens: int = 48
    max_requests: int = 2000
    max_seconds: float = 300
    started: float = 0.0
    sent: Counter = field(default_factory=Counter)      # endpoint -> requests sent
    statuses: Counter = field(default_factory=Counter)  # status code (or error) -> count
    answered: list = field(default_factory=list)        # (monotonic time of the first token, time done, TTFT s) of each streamed 200

    def __post_init__(self):
        self._stop = threading.Event()
        self._endpoints: list[str] = []
        self._rr = itertools.count()
        self._lock = threading.Lock()

    def _refresh(self) -> None:
        while not self._stop.is_set():
            try:
                self._endpoints = ready_endpoints(self.api, self.server, self.namespace, self.service)
            except httpx.HTTPError:
                pass
            self._stop.wait(1.0)

    def _client(self) -> None:
        with httpx.Client(timeout=120) as http:
            while not self._stop.is_set() and time.monotonic() - self.started < self.max_seconds:
                with self._lock:
                    if sum(self.sent.values()) >= self.max_requests:
                        return
                    eps = self._endpoints
                    if not eps:
                        target = None
                    else:
                        target = eps[next(self._rr) % len(eps)]
                        self.sent[target] += 1
                if target is None:
                    time.sleep(0.2)
                    continue
                asked, first = time.monotonic(), None
                try:
                    with http.stream("POST", target + "/v1/completions", json={
                            "prompt": "Write a short story about a lighthouse keeper.", "max_tokens": self.max_tokens, "ignore_eos": True,
                            "temperature": 0.8, "stream": True}) as r:
                        code, done = r.status_code, False
                        for chunk in r.iter_lines():  # (the time to the first streamed token: the timeline's TTFT)
                            if chunk.startswith('data: {"error"'):
                                code = "error event"
                            done = done or chunk == "data: [DONE]"  # (blank lines follow each event)
                            if first is None and chunk.startswith("data: ") and not done:
                                first = time.monotonic() - asked
                        if code == 200 and not done:
                            code = "stream cut"  # an answer without its end counts as a failure, as a 5xx would
                except httpx.HTTPError as e:
                    code = type(e).__name__
                with self._lock:
                    self.statuses[code] += 1
                    if code == 200 and first is not None:
                        self.answered.append((asked + first, time.monotonic(), first))

    def answers(self) -> list:
        """A copy of `answered`, taken under the lock the clients append under."""
        with self._lock:
            return list(self.answered)

    def start(self) -> LoadGenerator:
        self.started = time.monotonic()
        self._threads = [threading.Thread(target=self._refresh, daemon=True)] + \
                        [threading.Thread(target=self._client, daemon=True) for _ in range(self.clients)]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(130)
