"""kvpilot-gateway's routing core: the prefix-hash ring (deterministic, balanced, consistent, bounded
load) and the proxy (loopback upstreams standing in for engine pods): one prefix keeps one pod, SSE
streams through unbuffered, the API key passes, errors are OpenAI-style JSON, a pod that refuses connections or answers 503 (draining) is skipped;
and the public entry point's guards: stalled and piled-up bodies, over-deep JSON, upstream cookies, a client's kv_transfer_params."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kvpilot.operator.gateway.routing import HashRing, choose, prefix_key
from server_harness import asgi_server, assert_bodies_held_at_once_are_bounded, assert_half_sent_headers_are_cut, free_port, read_reply


def test_ring_is_deterministic_balanced_and_consistent():
    pods = [f"10.0.0.{i}:8000" for i in range(4)]
    shuffled = random.Random(1).sample(pods, len(pods))
    keys = [f"system prompt {i}" for i in range(4000)]
    a, b = HashRing(pods), HashRing(shuffled)
    owners = {k: next(a.candidates(k)) for k in keys}
    assert owners == {k: next(b.candidates(k)) for k in keys}  # every gateway replica routes alike
    share = Counter(owners.values())
    assert set(share) == set(pods) and max(share.values()) < 1.6 * min(share.values()), share
    smaller = HashRing(pods[:3])  # a pod leaves: only its keys move
    moved = [k for k in keys if next(smaller.candidates(k)) != owners[k]]
    assert moved and all(owners[k] == pods[3] for k in moved)
    assert sorted(a.candidates("x")) == sorted(pods)  # each pod once


def test_bounded_load_spills_to_the_next_pod_on_the_ring():
    ring = HashRing(["a:1", "b:1", "c:1"])
    key = "You are a helpful assistant."
    first, second, third = ring.candidates(key)
    assert choose(ring, key, {}) == first
    assert choose(ring, key, {first: 3}) == first  # below 4 in flight a pod never spills (one batch for the engine)
    # bound = max(ceil(1.25 × (in flight + this one) / 3 pods), 4)
    assert choose(ring, key, {first: 6, second: 4, third: 4}) == first   # 7 <= ceil(1.25 * 15 / 3) = 7
    assert choose(ring, key, {first: 8, second: 4, third: 4}) == second  # 9 > ceil(1.25 * 17 / 3) = 8
    assert choose(ring, key, {first: 8, second: 8, third: 0}) == third   # 9 > ceil(1.25 * 17 / 3) = 8 for both
    assert choose(HashRing([]), key, {}) is None


def test_prefix_key_of_each_api_shape():
    long = "S" * 300
    assert prefix_key("/v1/completions", {"prompt": long + "user 1"}) == prefix_key("/v1/completions", {"prompt": long + "user 2"})
    assert prefix_key("/v1/completions", {"prompt": ["ab", "cd"]}) == "ab"
    assert prefix_key("/v1/completions", {"prompt": [1, 2, 3]}) == "1,2,3"
    chat = {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert prefix_key("/v1/chat/completions", chat) == "<|system|>Be terse.<|user|>Hi"
    assert prefix_key("/v1/chat/completions", {"messages": "not a list"}) == ""


class Upstream:
    """A loopback stand-in for an engine pod: names itself in every answer (plus `answer`'s fields, and
    a Set-Cookie header when `set_cookie` is given); streams SSE slowly. `seen`: (path, Authorization,
    body) of each request; `headers`: each request's headers."""

    def __init__(self, name: str, status: int = 200, answer: dict | None = None, set_cookie: str | None = None, host: str = "127.0.0.1"):
        seen = self.seen = []
        headers = self.headers = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                seen.append((self.path, self.headers.get("Authorization"), body))
                headers.append(self.headers)
                if status != 200:  # a draining engine: refuses new work before doing any
                    out = json.dumps({"error": {"message": "the server is shutting down"}}).encode()
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                    return
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for event in (json.dumps({"served_by": name, "i": i}) for i in range(3)):
                        data = f"data: {event}\n\n".encode()
                        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                        self.wfile.flush()
                        time.sleep(0.3)
                    done = b"data: [DONE]\n\n"
                    self.wfile.write(f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n")
                    return
                out = json.dumps({"served_by": name, **(answer or {})}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                if set_cookie:
                    self.send_header("Set-Cookie", set_cookie)
                self.end_headers()
                self.wfile.write(out)

            def do_GET(self):  # noqa: N802 - a stored response's GET (or DELETE): answered with who served it
                seen.append((self.command + " " + self.path, self.headers.get("Authorization"), None))
                out = json.dumps({"served_by": name}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_DELETE = do_GET  # noqa: N815

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.endpoint = f"{host}:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def gateway():

    from kvpilot.operator.gateway.proxy import GatewayConfig, StaticEndpoints, build_app

    upstreams = [Upstream(f"pod{i}") for i in range(3)]
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: a pod gone between the watch and the request
    draining = Upstream("draining", status=503)
    table = {"m": [u.endpoint for u in upstreams] + [dead, draining.endpoint], "idle": []}
    app = build_app(StaticEndpoints(table), GatewayConfig(hold_timeout_seconds=1.0, max_held_requests=2))
    with asgi_server(app) as url:
        yield url, upstreams, dead, app.state.gateway


@pytest.mark.timeout(60)
def test_same_prefix_same_pod_and_the_key_passes_through(gateway):
    url, upstreams, dead, gw = gateway
    system = "You are kvpilot's support assistant. Answer in one sentence. " * 6
    served = set()
    for user in range(12):
        r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": system + f"question {user}"}, headers={"Authorization": "Bearer k1"})
        assert r.status_code == 200, r.text
        served.add(r.json()["served_by"])
        assert r.headers["x-kvpilot-endpoint"] != dead
    assert len(served) == 1  # sequential requests: no load to spill, one prefix -> one pod
    by_prompt = {u.endpoint: u.seen for u in upstreams}
    pod = next(e for e, seen in by_prompt.items() if seen)
    assert all(auth == "Bearer k1" for _, auth, _ in by_prompt[pod])
    owners = {httpx.post(url + "/v1/completions", json={"model": "m", "prompt": f"different system prompt {i} " * 20}).json()["served_by"]
              for i in range(24)}
    assert owners == {"pod0", "pod1", "pod2"}  # other prefixes spread over the live pods; the dead and the draining one are skipped
    assert httpx.get(url + "/metrics").text.count('decision="retry"') >= 1


@pytest.mark.timeout(60)
def test_sse_is_streamed_through_without_buffering(gateway):
    url = gateway[0]
    arrivals = []
    t = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json={"model": "m", "prompt": "stream me", "stream": True}, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append((time.monotonic() - t, line[6:]))
    assert [a[1] for a in arrivals][-1] == "[DONE]" and len(arrivals) == 4
    assert arrivals[0][0] < arrivals[2][0] - 0.4  # the first event came before the upstream had sent the third


def test_errors_are_openai_json(gateway):
    url = gateway[0]
    r = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"] == {"message": "the model 'nope' does not exist", "type": "invalid_request_error",
                                                          "param": "model", "code": "model_not_found"}
    r = httpx.post(url + "/v1/completions", json={"model": "idle", "prompt": "x"})  # held 1 s for a pod that never comes
    assert r.status_code == 503 and r.headers["retry-after"] == "5" and "no replica of 'idle' became ready within 1s" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url + "/v1/completions", content=b"x" * (5 << 20))
    assert r.status_code == 413
    models = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    assert {"idle", "m"} <= set(models) and models == sorted(models)


@pytest.mark.timeout(60)
def test_a_request_for_a_model_without_pods_is_held_then_served(gateway):
    """Scale from zero as the gateway sees it: held (and a wake-up asked for) until a pod is ready, then
    forwarded; beyond max_held_requests, 503 at once; the held gauge exists at 0 for every known model."""
    from concurrent.futures import ThreadPoolExecutor

    url, upstreams, _, gw = gateway
    gw.source.table["cold"] = []
    with ThreadPoolExecutor(3) as pool:
        held = [pool.submit(httpx.post, url + "/v1/completions", json={"model": "cold", "prompt": f"hi {i}"}, timeout=30) for i in range(2)]
        time.sleep(0.5)
        t = time.monotonic()
        over = httpx.post(url + "/v1/completions", json={"model": "cold", "prompt": "one too many"}, timeout=30)
        assert time.monotonic() - t < 0.5 and over.status_code == 503 and "2 requests already wait" in over.json()["error"]["message"]
        assert 'kvpilot_gateway_held_requests{model="cold"} 2.0' in httpx.get(url + "/metrics").text
        gw.source.table["cold"] = [upstreams[0].endpoint]  # a pod became Ready
        answers = [f.result() for f in held]
    assert [a.status_code for a in answers] == [200, 200] and {a.json()["served_by"] for a in answers} == {"pod0"}
    assert "cold" in gw.source.woken
    metrics = httpx.get(url + "/metrics").text
    assert 'kvpilot_gateway_held_requests{model="cold"} 0.0' in metrics and 'kvpilot_gateway_held_requests{model="m"} 0.0' in metrics
    assert 'kvpilot_gateway_hold_seconds_count{model="cold"} 2.0' in metrics
    # arrival to the first byte, for the held requests only (each waited at least the 0.5 s before the pod came)
    assert 'kvpilot_gateway_cold_start_first_token_seconds_count{model="cold"} 2.0' in metrics
    assert 'kvpilot_gateway_cold_start_first_token_seconds_bucket{le="0.5",model="cold"} 0.0' in metrics


def test_endpoint_table_from_inference_services_and_pods():
    """The gateway's view of the cluster: served name (or the InferenceService's name) -> the Ready,
    not terminating engine pods of that service in its namespace."""
    from kvpilot.operator.gateway.discovery import ModelRoute, endpoint_table

    def isvc(ns, name, served=None, **spec):
        return {"metadata": {"namespace": ns, "name": name},
                "spec": {"model": {"source": "smollm2-135m", **({"servedName": served} if served else {})}, **spec}}

    def pod(ns, owner, ip, ready=True, deleting=False, group_pod=None):
        meta = {"namespace": ns, "name": f"{owner}-{ip}", "labels": {"serving.kvpilot.dev/inferenceservice": owner,
                                                                     **({"serving.kvpilot.dev/group-pod": group_pod} if group_pod else {})}}
        if deleting:
            meta["deletionTimestamp"] = "2026-11-22T00:00:00Z"
        return {"metadata": meta, "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}

    table = endpoint_table(
        [isvc("a", "chat", served="smollm2"), isvc("a", "idle", minReplicas=0), isvc("b", "chat"), isvc("b", "woken", minReplicas=0, replicas=1)],
        [pod("a", "chat", "127.0.0.2"), pod("a", "chat", "127.0.0.3", ready=False), pod("a", "chat", "127.0.0.4", deleting=True),
         pod("b", "chat", "127.0.0.5", group_pod="leader"), pod("b", "chat", "127.0.0.7", group_pod="worker"), pod("a", "gone", "127.0.0.6")])
    # (a group's worker pod serves no API: only its leader is routed to)
    assert table == {"smollm2": ModelRoute("a", "chat", ["127.0.0.2:8000"]), "idle": ModelRoute("a", "idle", [], at_zero=True),
                     "chat": ModelRoute("b", "chat", ["127.0.0.5:8000"]), "woken": ModelRoute("b", "woken", [], at_zero=False)}


def test_adapters_route_to_the_pods_that_hold_them():
    """An adapter name routes to its service's Ready pods whose adapters annotation lists it (all of them
    while none does); a name served twice goes to the older service, and an adapter never takes a model's name."""
    from kvpilot.operator.gateway.discovery import ModelRoute, endpoint_table

    def isvc(name, created, served=None, adapters=()):
        return {"metadata": {"namespace": "a", "name": name, "creationTimestamp": created},
                "spec": {"model": {"source": "smollm2-135m", **({"servedName": served} if served else {})},
                         "adapters": [{"name": n, "source": f"hf://org/{n}"} for n in adapters]}}

    def pod(owner, ip, held):
        return {"metadata": {"namespace": "a", "name": f"{owner}-{ip}", "labels": {"serving.kvpilot.dev/inferenceservice": owner},
                             "annotations": {"serving.kvpilot.dev/adapters": held}},
                "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}

    table = endpoint_table(
        [isvc("young", "2026-11-25T10:00:00Z", adapters=["sql", "base"]), isvc("base", "2026-11-25T09:00:00Z", adapters=["sql", "chat", "new"])],
        [pod("base", "127.0.0.2", "sql,chat"), pod("base", "127.0.0.3", "sql"), pod("young", "127.0.0.4", "sql,base")])
    assert table == {"base": ModelRoute("a", "base", ["127.0.0.2:8000", "127.0.0.3:8000"]),
                     "young": ModelRoute("a", "young", ["127.0.0.4:8000"]),
                     "sql": ModelRoute("a", "base", ["127.0.0.2:8000", "127.0.0.3:8000"]),
                     "chat": ModelRoute("a", "base", ["127.0.0.2:8000"]),
                     "new": ModelRoute("a", "base", ["127.0.0.2:8000", "127.0.0.3:8000"])}


def test_prefill_pods_of_a_disaggregated_service_are_its_prefill_endpoints():
    """Pods labelled role=prefill are the route's prefill pool; the rest (decode, or unlabelled) serve."""
    from kvpilot.operator.gateway.discovery import ModelRoute, endpoint_table

    def pod(ip, role=None):
        labels = {"serving.kvpilot.dev/inferenceservice": "pd", **({"serving.kvpilot.dev/role": role} if role else {})}
        return {"metadata": {"namespace": "a", "name": f"pd-{ip}", "labels": labels},
                "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}}

    table = endpoint_table([{"metadata": {"namespace": "a", "name": "pd"}, "spec": {"model": {"source": "smollm2-135m"}}}],
                           [pod("127.0.0.2", "prefill"), pod("127.0.0.3", "decode"), pod("127.0.0.4", "prefill")])
    assert table == {"pd": ModelRoute("a", "pd", ["127.0.0.3:8000"], prefill=["127.0.0.2:8000", "127.0.0.4:8000"])}


@contextlib.contextmanager
def served_as_main_serves(app, config):
    """The gateway app under uvicorn with `kvpilot-gateway`'s own server settings (header timeout
    included), on a free loopback port in a thread: its port, until the block ends."""
    import uvicorn

    from kvpilot.operator.gateway.proxy import uvicorn_settings

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning", **uvicorn_settings(config)))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield server.config.port
    finally:
        server.should_exit = True


@pytest.fixture(scope="module")
def guarded():
    """A gateway with small limits: 1 MiB bodies, 2 MiB of bodies arriving at once, 1 s for headers and for a body."""
    from kvpilot.operator.gateway.proxy import GatewayConfig, StaticEndpoints, build_app

    upstream = Upstream("pod")
    config = GatewayConfig(max_body_bytes=1 << 20, max_buffered_request_bytes=2 << 20, request_header_timeout_seconds=1,
                           request_body_timeout_seconds=1)
    with served_as_main_serves(build_app(StaticEndpoints({"m": [upstream.endpoint]}), config), config) as port:
        yield port


def assert_still_serving(port: int):
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": "m", "prompt": "still there?"}, timeout=10)
    assert r.status_code == 200 and r.json()["served_by"] == "pod"


@pytest.mark.timeout(60)
def test_stalled_headers_and_bodies_are_cut(guarded):
    """Headers that never end: the connection is closed after the header timeout; a body that stops
    half-way: 408 after the body timeout (both held connections for ever before)."""
    assert_half_sent_headers_are_cut(guarded)
    with socket.create_connection(("127.0.0.1", guarded), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")
        reply = read_reply(s)
    assert reply.startswith("HTTP/1.1 408") and "request_timeout" in reply, reply
    assert_still_serving(guarded)


@pytest.mark.timeout(60)
def test_bodies_held_at_once_are_bounded(guarded):
    """Bodies still arriving count against max_buffered_request_bytes (2 MiB here) over all connections:
    past it a 429 with Retry-After, the others time out (408); the gateway has no API key to check
    first, so this bound is what keeps anyone's half-sent bodies from growing it without limit."""
    assert_bodies_held_at_once_are_bounded(guarded)
    assert_still_serving(guarded)


def test_json_nested_too_deep_is_a_400():
    """Too deep for json to parse, or parsed but too deep to encode again for the engines (a
    disaggregated model's prefill and decode bodies, in deeper frames): 400, not a text/plain 500."""
    from kvpilot.operator.gateway.proxy import StaticEndpoints, build_app

    decode, prefill = Upstream("decode"), Upstream("prefill", answer={"kv_transfer_params": {"remote_block_ids": [1]}})
    with asgi_server(build_app(StaticEndpoints({"pd": [decode.endpoint]}, prefill={"pd": [prefill.endpoint]}))) as url, httpx.Client() as client:
        r = client.post(url + "/v1/completions", content=b"[" * 200_000, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        codes = Counter()
        for depth in range(900, 1010):  # past the parse limit, through the depths just below it
            nested = b"[" * depth + b"]" * depth
            r = client.post(url + "/v1/completions", content=b'{"model":"pd","prompt":' + nested + b"}", headers={"Content-Type": "application/json"})
            codes[r.status_code] += 1
            assert r.status_code == 200 or (r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"), (depth, r.text)
    assert codes[200] and codes[400]


def test_cookies_are_neither_kept_from_engines_nor_forwarded_from_clients():
    """An engine's Set-Cookie must not ride on later requests (every client's go through one shared
    HTTP client), and a client's Cookie header stays at the gateway."""
    from kvpilot.operator.gateway.proxy import StaticEndpoints, build_app

    upstream = Upstream("pod", set_cookie="session=engine-set; Path=/")
    with asgi_server(build_app(StaticEndpoints({"m": [upstream.endpoint]}))) as url:
        first = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "one"})
        assert first.status_code == 200 and "set-cookie" not in first.headers
        second = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "two"}, headers={"Cookie": "client=mine"})
        assert second.status_code == 200
    assert [h.get("Cookie") for h in upstream.headers] == [None, None]


def test_a_clients_kv_transfer_params_never_reach_an_engine():
    """kv_transfer_params name the pod a decode engine pulls KV blocks from: only the gateway sets them
    (from its own prefill), never a client, whether or not the model is disaggregated."""
    from kvpilot.operator.gateway.proxy import StaticEndpoints, build_app

    handed = {"remote_engine": "the prefill pod's", "remote_block_ids": [1, 2]}
    plain, decode, prefill = Upstream("plain"), Upstream("decode"), Upstream("prefill", answer={"kv_transfer_params": handed})
    source = StaticEndpoints({"solo": [plain.endpoint], "pd": [decode.endpoint]}, prefill={"pd": [prefill.endpoint]})
    forged = {"remote_engine": "10.6.6.6:5555", "remote_block_ids": [0]}
    with asgi_server(build_app(source)) as url:
        for model in ("solo", "pd"):
            r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi", "kv_transfer_params": forged})
            assert r.status_code == 200, r.text
    assert [body for _, _, body in plain.seen] == [{"model": "solo", "prompt": "hi"}]
    assert [body["kv_transfer_params"] for _, _, body in prefill.seen] == [{"do_remote_decode": True}]
    assert [body for _, _, body in decode.seen] == [{"model": "pd", "prompt": "hi", "kv_transfer_params": handed}]


def test_a_buffer_cap_below_one_body_is_refused():
    """Every body between the two sizes would get 429 "retry later" for ever."""
    from kvpilot.operator.gateway.__main__ import main

    with pytest.raises(SystemExit) as refused:
        main(["--max-request-body", "4MiB", "--max-buffered-request-bytes", "1MiB"])
    assert refused.value.code == 2


@pytest.mark.timeout(60)
def test_a_stored_responses_continuations_and_reads_go_to_the_pod_that_stored_it():
    """The Responses API (#71): a response id names the pod that stored it (a hash of its address); a
    request with that previous_response_id, and GET / DELETE of the id, go to that pod whatever the prefix
    says; an id naming no pod of the gateway (gone) is a 404 naming the id; a new response is routed by
    its instructions and input."""
    from kvpilot.operator.gateway.proxy import GatewayConfig, StaticEndpoints, build_app
    from kvpilot.server.response_ids import pod_tag

    pods = [Upstream(f"pod{i}", host=f"127.0.0.{i + 2}") for i in range(3)]  # pods have addresses of their own
    app = build_app(StaticEndpoints({"m": [u.endpoint for u in pods], "idle": []}), GatewayConfig(hold_timeout_seconds=30))
    with asgi_server(app) as url:
        for i, pod in enumerate(pods):
            rid = f"resp_{pod_tag(f'127.0.0.{i + 2}')}_{'ab' * 16}"
            for prompt in ("first topic " * 30, "second topic " * 30):
                r = httpx.post(url + "/v1/responses", json={"model": "m", "input": prompt, "previous_response_id": rid})
                assert r.status_code == 200, r.text
                assert r.json()["served_by"] == f"pod{i}"
            for method in ("GET", "DELETE"):
                r = httpx.request(method, f"{url}/v1/responses/{rid}", headers={"Authorization": "Bearer k"})
                assert r.status_code == 200 and r.json()["served_by"] == f"pod{i}"
                assert pod.seen[-1][:2] == (f"{method} /v1/responses/{rid}", "Bearer k")
        gone = f"resp_{pod_tag('127.0.0.99')}_{'cd' * 16}"
        for r in (httpx.post(url + "/v1/responses", json={"model": "m", "input": "hi", "previous_response_id": gone}),
                  httpx.get(f"{url}/v1/responses/{gone}"), httpx.delete(f"{url}/v1/responses/{gone}")):
            assert r.status_code == 404 and gone in r.json()["error"]["message"] and r.json()["error"]["code"] == "response_not_found"
        started = time.monotonic()  # a continuation for a model scaled to zero: its pod is gone, no pod is woken for it
        r = httpx.post(url + "/v1/responses", json={"model": "idle", "input": "hi", "previous_response_id": gone}, timeout=60)
        assert r.status_code == 404 and time.monotonic() - started < 5 and r.json()["error"]["type"] == "invalid_request_error"
        untagged = "resp_" + "ef" * 16  # names no pod (not a kvpilot engine's): read from nowhere, the key sent nowhere
        seen = sum(len(p.seen) for p in pods)
        for r in (httpx.get(f"{url}/v1/responses/{untagged}", headers={"Authorization": "Bearer k"}),
                  httpx.delete(f"{url}/v1/responses/{untagged}", headers={"Authorization": "Bearer k"})):
            assert r.status_code == 404 and untagged in r.json()["error"]["message"]
        assert sum(len(p.seen) for p in pods) == seen
        owners = {httpx.post(url + "/v1/responses", json={"model": "m", "instructions": f"system {i} " * 40, "input": "hi"}).json()["served_by"]
                  for i in range(24)}
        assert owners == {"pod0", "pod1", "pod2"}
    assert prefix_key("/v1/responses", {"instructions": "Be terse.", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]}) \
        == "<|system|>Be terse.<|user|>Hi"
