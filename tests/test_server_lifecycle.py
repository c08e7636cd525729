"""Server behaviour under overload, with an API key, on SIGTERM, and under schema fuzzing."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from server_harness import SERVER_MODES, ServerProcess, free_port, metrics

both_modes = pytest.mark.parametrize("mode", list(SERVER_MODES))  # the engine in the server's process, and in its own


@both_modes
def test_overload_gets_429_with_retry_after_and_server_survives(tmp_path, mode):
    s = ServerProcess("--max-num-seqs", "4", "--max-waiting-requests", "16", "--kv-cache-memory", "128MiB", *SERVER_MODES[mode],
                      log_path=tmp_path / "log").wait_ready()
    try:
        async def burst():
            limits = httpx.Limits(max_connections=200)
            async with httpx.AsyncClient(timeout=120, limits=limits) as c:
                body = {"prompt": "Write a haiku about load.", "max_tokens": 16, "ignore_eos": True}
                return await asyncio.gather(*(c.post(s.url + "/v1/completions", json=body) for _ in range(200)), return_exceptions=True)

        results = asyncio.run(burst())
        codes = [r.status_code if isinstance(r, httpx.Response) else repr(r) for r in results]
        rejected = [r for r in results if isinstance(r, httpx.Response) and r.status_code == 429]
        assert all(c in (200, 429) for c in codes), sorted(set(map(str, codes)))
        assert rejected and sum(c == 200 for c in codes) >= 16
        assert all(r.headers.get("retry-after") == "1" and r.json()["error"]["code"] == "queue_full" for r in rejected)
        assert httpx.get(s.url + "/health").status_code == 200
        m = metrics(s.url)
        assert m["kvpilot:num_requests_waiting"] == 0 and m["kvpilot:kv_cache_usage_perc"] == 0.0
        assert m["kvpilot:request_success_total{finished_reason=length}"] == sum(c == 200 for c in codes)
        assert m["kvpilot:admission_rejections_total{reason=max_num_queued_reqs}"] == len(rejected)
    finally:
        assert s.terminate() == 0


@both_modes
def test_api_key(tmp_path, mode):
    import json

    import msgspec
    import zmq

    launched = time.time()
    # the router binds, the engine connects to it (no wildcard in its endpoint: vLLM's rule), as llm-d's indexer and vLLM pods do
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    events = f"tcp://127.0.0.1:{free_port()}"
    sub.bind(events)
    s = ServerProcess("--kv-cache-memory", "64MiB", "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "endpoint": events}),
                      *SERVER_MODES[mode], env={"KVPILOT_API_KEY": "sekret-key-123"}, log_path=tmp_path / "log").wait_ready()
    try:
        # The start-up record the operator reads for a pod's cold start (from /metrics, open to it without the key).
        from kvpilot.operator.cold_start import engine_startup

        start, phases = engine_startup(httpx.get(s.url + "/metrics").text)
        assert launched - 1 <= start <= time.time(), (launched, start)
        assert list(phases) == ["import", "load", "warmup", "listen"] and phases["import"] > 0 and phases["load"] > 0, phases
        assert start + sum(phases.values()) <= time.time()
        body = {"prompt": "hi", "max_tokens": 2}
        r = httpx.post(s.url + "/v1/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.post(s.url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.post(s.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sekret-key-123"}).status_code == 200
        assert httpx.get(s.url + "/v1/models").status_code == 401
        for schema_path in ("/openapi.json", "/docs"):  # the API's map is behind the key too
            assert httpx.get(s.url + schema_path).status_code == 401
            assert httpx.get(s.url + schema_path, headers={"Authorization": "Bearer sekret-key-123"}).status_code == 200
        for open_path in ("/health", "/ready", "/metrics"):
            assert httpx.get(s.url + open_path).status_code == 200

        # vLLM's /reset_prefix_cache, behind the key: a repeated prompt hits the prefix cache until it is reset (#70);
        # the engine's KV events (from the core's process in that mode) say so too
        key = {"Authorization": "Bearer sekret-key-123"}
        sub.poll(200)  # a bound SUB sends its subscription to a PUB that connected once it processes commands (libzmq#2267)
        long = {"prompt": "A long prompt about rivers, " * 8, "max_tokens": 1}
        hits = lambda: metrics(s.url)["kvpilot:prefix_cache_hits_total"]  # noqa: E731
        for _ in range(2):
            assert httpx.post(s.url + "/v1/completions", json=long, headers=key).status_code == 200
        assert hits() > 0
        assert httpx.post(s.url + "/reset_prefix_cache").status_code == 401
        r = httpx.post(s.url + "/reset_prefix_cache?reset_running_requests=true", headers=key)
        assert r.status_code == 200 and r.json() == {"success": True}
        before = hits()
        assert httpx.post(s.url + "/v1/completions", json=long, headers=key).status_code == 200
        assert hits() == before
        kinds = []
        while sub.poll(1000):
            topic, seq, payload = sub.recv_multipart()
            kinds += [e["type"] for e in msgspec.msgpack.decode(payload)[1]]
        assert "AllBlocksCleared" in kinds and kinds[-1] == "BlockStored", kinds  # (the first batches may be missed: slow joiner)
    finally:
        sub.close(linger=0)
        s.terminate()
    assert "sekret-key-123" not in s.log()


@both_modes
def test_sigterm_drains_in_flight_then_exits_zero(tmp_path, mode):
    s = ServerProcess("--kv-cache-memory", "64MiB", "--shutdown-grace-seconds", "30", *SERVER_MODES[mode], log_path=tmp_path / "log").wait_ready()
    result: dict = {}

    def long_request():
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Tell a story", "max_tokens": 80, "ignore_eos": True}, timeout=60)
        result["status"], result["body"] = r.status_code, r.json()

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 20
    while metrics(s.url)["kvpilot:num_requests_running"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    s.proc.send_signal(__import__("signal").SIGTERM)
    time.sleep(0.3)
    ready = httpx.get(s.url + "/ready")
    new = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ready.status_code == 503 and new.status_code == 503 and new.json()["error"]["code"] == "draining"
    assert s.proc.wait(40) == 0
    t.join(10)
    assert result["status"] == 200 and result["body"]["usage"]["completion_tokens"] == 80  # finished, not cut


def fuzz_operation(operation, failures: list[str], post_examples: int) -> None:
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=post_examples if operation.method.upper() == "POST" else 5, deadline=None, suppress_health_check=list(HealthCheck))
    def run(case):
        if isinstance(case.body, dict) and operation.path.startswith("/v1/responses"):
            case.body["max_output_tokens"] = 8  # the Responses API's output bound (max_tokens would be an ignored field there)
        elif isinstance(case.body, dict) and operation.path.startswith("/v1/"):
            # keep each case cheap: bounded output, one choice (the limits themselves have their own tests)
            case.body["max_tokens"] = 8
            case.body.pop("max_completion_tokens", None)
            case.body["n"] = 1
        response = case.call(timeout=60)
        if response.status_code >= 500:
            failures.append(f"{operation.method} {operation.path} -> {response.status_code}: {response.text[:300]} body={case.body!r}"[:800])

    operation.as_strategy()  # fails early if the operation cannot be generated
    given(case=operation.as_strategy())(run)()


@both_modes
def test_schema_fuzzing_finds_no_5xx(tmp_path, mode):
    """schemathesis drives the app's own OpenAPI schema (~50 examples per operation, max_tokens capped;
    a third of them in core-process mode, whose HTTP front end is the one-process server's)."""
    import schemathesis

    s = ServerProcess("--kv-cache-memory", "64MiB", "--max-model-len", "512", *SERVER_MODES[mode], log_path=tmp_path / "log").wait_ready()
    try:
        schema = schemathesis.openapi.from_url(s.url + "/openapi.json")
        failures: list[str] = []
        start = time.monotonic()
        for op in schema.get_all_operations():
            operation = op.ok()
            if operation.path in ("/metrics",):
                continue
            fuzz_operation(operation, failures, 40 if mode == "one-process" else 15)
            assert time.monotonic() - start < 180, "fuzzing exceeded its time budget"
        assert not failures, "\n".join(failures[:5])
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.terminate()
