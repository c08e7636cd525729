"""PrometheusSource against a real HTTP server that answers what a broken or hostile Prometheus might:
every such answer is MetricsUnavailable (the autoscaler then holds), never an exception."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvpilot.operator.autoscaler.promql import MetricsUnavailable, PrometheusSource


@pytest.fixture
def prometheus():
    state = {"body": b"", "type": "application/json"}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Type", state["type"])
            self.end_headers()
            self.wfile.write(state["body"])

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield state, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def vector(value, stamp=None):
    return {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {"pod": "p0"}, "value": [time.time(), value]}]}} \
        if stamp is None else {"status": "success", "data": {"resultType": "vector", "result": [{"metric": {"pod": "p0"}, "value": [time.time(), str(stamp)]}]}}


@pytest.mark.parametrize("body,ctype", [
    (b"<html>502 Bad Gateway</html>", "text/html"),
    (json.dumps({"status": "success"}).encode(), "application/json"),
    (json.dumps({"status": "success", "data": {"resultType": "scalar", "result": [0, "1"]}}).encode(), "application/json"),
    (json.dumps(vector("not-a-number")).encode(), "application/json"),
    (json.dumps(vector("NaN")).encode(), "application/json"),
    (json.dumps(vector("+Inf")).encode(), "application/json"),
    (json.dumps(vector("-0.5")).encode(), "application/json"),
    (json.dumps({"status": "success", "data": {"resultType": "vector", "result": [{"value": "x"}]}}).encode(), "application/json"),
    (json.dumps([1, 2]).encode(), "application/json"),
])
def test_garbage_answers_are_metrics_unavailable(prometheus, body, ctype):
    state, url = prometheus
    state.update(body=body, type=ctype)
    with pytest.raises(MetricsUnavailable):
        PrometheusSource(url, timeout=5).pod_samples("kvpilot", "ns", "isvc")


def test_future_dated_samples_are_metrics_unavailable(prometheus):
    state, url = prometheus
    state["body"] = json.dumps(vector(str(time.time() + 3600))).encode()  # every query: value (and timestamp) an hour ahead
    with pytest.raises(MetricsUnavailable, match="future"):
        PrometheusSource(url, timeout=5).pod_samples("kvpilot", "ns", "isvc")
    state["body"] = json.dumps(vector(str(time.time()))).encode()
    (sample,) = PrometheusSource(url, timeout=5).pod_samples("kvpilot", "ns", "isvc")
    assert sample.pod == "p0" and sample.kv_cache_utilization > 0
