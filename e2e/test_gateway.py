"""kvpilot-gateway in front of real engines (part of #18): 4 replicas of SmolLM2 whose KV caches
(30 MiB: 42 blocks of 16 tokens) each hold about 3 of the 8 shared system prompts (~13 blocks each).
8 system prompts × 6 users, sent 4 at a time in a seeded order: once through the gateway (prefix
affinity), once round-robin straight to the same pods (8 other system prompts, so that neither phase
inherits the other's cache); each set has 2 prompts per pod on the gateway's ring (balanced_prompts). The engines' own prefix-cache counters give each phase's hit rate; the
gateway's must be at least twice round-robin's, with TTFT p50 no worse. Then the Responses API through
the gateway: a three-turn conversation by previous_response_id (each turn back on the pod that stored
the one before), and after a replica is removed, its stored responses are a 404 naming them.

KVPILOT_GATEWAY_RESULTS=bench/results/gateway.json: the two phases' figures are written there too (make
plots draws them)."""

from __future__ import annotations

import itertools
import os
import random
import re
import statistics
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from e2e.cluster import TOKEN, _insecure
from e2e.gateway_proc import GatewayProcess
from e2e.isvc import apply_isvc, get_isvc
from e2e.load import ready_endpoints
from e2e.operator_proc import OperatorProcess
from e2e.pod_runner import PodRunner
from e2e.waiting import wait_until
from kvpilot.operator.gateway.routing import HashRing, prefix_key

pytestmark = pytest.mark.cluster
USERS = 6  # per system prompt: 48 requests per phase (10 users gave the same verdict in twice the time: bench/history/2026-11-22.md)
WORDS = ("cache block token prefix engine replica gateway route hash ring load queue batch decode prefill "
         "kernel tensor rank shard metric scale pod node cluster service model weight layer head vocabulary").split()


def system_prompts(seed: int, n: int = 8) -> list[str]:
    rng = random.Random(seed)
    return [f"System prompt {seed}-{i}: you are assistant {i} of the kvpilot fleet. " + " ".join(rng.choice(WORDS) for _ in range(170))
            for i in range(n)]


def balanced_prompts(seed: int, endpoints: list[str]) -> list[str]:
    """8 system prompts that the gateway's ring gives 2 per pod. With only 8 keys, hashing alone is
    lumpy (runs with 8 arbitrary prompts put 4–5 of them on one pod, which then evicts its own; the
    ring's balance over many keys is tests/test_gateway.py's); this measures what affinity does for the
    caches, not how 8 coin flips fall. The round-robin phase gets its 8 the same way."""
    ring = HashRing(e.removeprefix("http://") for e in endpoints)
    chosen, per_pod = [], Counter()
    for prompt in system_prompts(seed, 256):
        owner = next(ring.candidates(prefix_key("/v1/completions", {"prompt": prompt + "\n"})))
        if per_pod[owner] < 2:
            per_pod[owner] += 1
            chosen.append(prompt)
        if len(chosen) == 8:
            return chosen
    raise AssertionError("no balanced set of system prompts among 256")


def hits_and_queries(endpoints: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for e in endpoints:
        text = httpx.get(f"{e}/metrics", timeout=10).text
        hits += float(re.search(r"^kvpilot:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M).group(1))
        queries += float(re.search(r"^kvpilot:prefix_cache_queries_total\{[^}]*\} (\S+)$", text, re.M).group(1))
    return hits, queries


def run_phase(urls, prompts: list[str], seed: int) -> tuple[list[float], dict[str, int]]:
    """8 × USERS requests, 4 at a time; each to the next of `urls` (an iterator). TTFT = time to the first
    streamed token."""
    rng = random.Random(seed)
    work = [(p, f"User {u} asks: what does word {u} mean here?") for p in prompts for u in range(USERS)]
    rng.shuffle(work)
    lock = threading.Lock()
    served: dict[str, int] = {}

    def one(item):
        system, user = item
        with lock:
            url = next(urls)
        t = time.monotonic()
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                          json={"model": "chat", "prompt": system + "\n" + user, "max_tokens": 2, "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200, r.read()
            endpoint = r.headers.get("x-kvpilot-endpoint", url)
            ttft = None
            for line in r.iter_lines():
                if ttft is None and line.startswith("data: {"):
                    ttft = time.monotonic() - t
        with lock:
            served[endpoint] = served.get(endpoint, 0) + 1
        return ttft

    with ThreadPoolExecutor(4) as pool:
        ttfts = list(pool.map(one, work))
    return ttfts, served


def responses_conversation(gw: str, endpoints: list[str]) -> dict[str, str]:
    """The Responses API through the gateway (#71): a three-turn conversation by previous_response_id, each
    turn on the pod that stored the turn before (its input tokens: the whole conversation); then one
    stored response on every pod. Returns endpoint -> a response id stored there."""
    from kvpilot.server.response_ids import id_pod_tag, pod_tag

    by_tag = {pod_tag(httpx.URL(e).host): e.removeprefix("http://") for e in endpoints}  # http://podIP:port -> podIP:port
    previous, tokens = None, 0
    for text in ("My name is Ada. Say hello.", "What is my name?", "Spell it backwards."):
        r = httpx.post(f"{gw}/v1/responses", json={"model": "chat", "input": text, "max_output_tokens": 6, "temperature": 0,
                                                   "previous_response_id": previous}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert r.headers["x-kvpilot-endpoint"] == by_tag[id_pod_tag(body["id"])]  # the id names the pod that answered
        if previous is not None:
            assert r.headers["x-kvpilot-endpoint"] == by_tag[id_pod_tag(previous)]  # and the continuation went back to it
        assert body["usage"]["input_tokens"] > tokens  # the conversation so far is the prompt
        tokens = body["usage"]["input_tokens"] + body["usage"]["output_tokens"]
        previous = body["id"]
    stored: dict[str, str] = {}
    for i in range(64):
        if len(stored) == len(endpoints):
            break
        r = httpx.post(f"{gw}/v1/responses", json={"model": "chat", "instructions": f"You are helper number {i}. " * 12, "input": "hi",
                                                   "max_output_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
        stored.setdefault(by_tag[id_pod_tag(r.json()["id"])], r.json()["id"])
    assert len(stored) == len(endpoints), stored
    return stored


@pytest.mark.timeout(400)
def test_prefix_affinity_beats_round_robin(cluster, namespace, tmp_path):
    cluster.kubectl("apply", "-f", str(Path(__file__).resolve().parents[1] / "crds"))
    runner = PodRunner(cluster.server, tmp_path / "pods").start()
    op = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log")
    gateway = GatewayProcess(cluster.kubeconfig, namespace, tmp_path / "gateway.log")
    try:
        apply_isvc(cluster, namespace, "chat", {"model": {"source": "smollm2-135m"}, "resources": {"cpuOnly": True}, "minReplicas": 4, "maxReplicas": 4,
                                                "engineSettings": {"kvCacheMemory": "30MiB", "maxModelLen": 512, "maxNumSeqs": 4}})
        wait_until(lambda: ((get_isvc(cluster, namespace, "chat") or {}).get("status") or {}).get("readyReplicas") == 4, timeout=240,
                   what="4 engine replicas Ready")
        api = httpx.Client(verify=_insecure(), headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
        endpoints = ready_endpoints(api, cluster.server, namespace, "chat")
        assert len(endpoints) == 4
        gw = gateway.url

        def gateway_sees_all():
            try:
                return httpx.get(f"{gw}/v1/models", timeout=2).json()["data"][0]["id"] == "chat" and \
                    len(set(run_phase(itertools.repeat(gw), [f"probe {i} " * 40 for i in range(2)], 0)[1])) >= 1
            except (httpx.HTTPError, IndexError, AssertionError):
                return False

        wait_until(gateway_sees_all, timeout=60, what="gateway routes to the engines")
        time.sleep(1.5)  # the watches have delivered every replica to the gateway's table
        before = hits_and_queries(endpoints)
        ttft_gw, served_gw = run_phase(itertools.repeat(gw), balanced_prompts(1, endpoints), seed=1)
        middle = hits_and_queries(endpoints)
        ttft_rr, _ = run_phase(itertools.cycle(endpoints), balanced_prompts(2, endpoints), seed=1)
        after = hits_and_queries(endpoints)
        rate_gw = (middle[0] - before[0]) / (middle[1] - before[1])
        rate_rr = (after[0] - middle[0]) / (after[1] - middle[1])
        p50_gw, p50_rr = statistics.median(ttft_gw), statistics.median(ttft_rr)
        print(f"prefix-cache hit rate: gateway {rate_gw:.3f}, round-robin {rate_rr:.3f} ({rate_gw / max(rate_rr, 1e-9):.1f}x); "
              f"TTFT p50 gateway {p50_gw * 1000:.0f} ms, round-robin {p50_rr * 1000:.0f} ms; requests per pod via the gateway: {sorted(served_gw.values())}")
        if os.environ.get("KVPILOT_GATEWAY_RESULTS"):
            from bench.common import save_results

            save_results(os.environ["KVPILOT_GATEWAY_RESULTS"], command="KVPILOT_GATEWAY_RESULTS=bench/results/gateway.json .venv/bin/python "
                         "-m pytest e2e/test_gateway.py -k prefix_affinity -s", replicas=4, system_prompts=8, users=USERS,
                         results=[{"routing": "gateway (prefix affinity)", "hit_rate": rate_gw, "ttft_p50_s": p50_gw,
                                   "ttft_s": sorted(ttft_gw), "requests_per_pod": sorted(served_gw.values())},
                                  {"routing": "round-robin", "hit_rate": rate_rr, "ttft_p50_s": p50_rr, "ttft_s": sorted(ttft_rr)}])
        assert len(served_gw) == 4  # 2 prefixes per replica
        assert rate_gw >= 2 * rate_rr
        assert p50_gw <= p50_rr
        stored = responses_conversation(gw, endpoints)
        # A replica removed mid-run (scale 4 -> 3: the pod is deleted, its engine drains and refuses new
        # work): every request through the gateway is still answered.
        done = threading.Event()
        results = []

        def scale_down_soon():
            time.sleep(1.0)
            apply_isvc(cluster, namespace, "chat", {"model": {"source": "smollm2-135m"}, "resources": {"cpuOnly": True}, "minReplicas": 3,
                                                    "maxReplicas": 3, "engineSettings": {"kvCacheMemory": "30MiB", "maxModelLen": 512, "maxNumSeqs": 4}})
            done.set()

        threading.Thread(target=scale_down_soon, daemon=True).start()
        results = run_phase(itertools.repeat(gw), system_prompts(3), seed=3)[0]
        assert done.is_set() and len(results) == 8 * USERS and all(t is not None for t in results)
        wait_until(lambda: len(ready_endpoints(api, cluster.server, namespace, "chat")) == 3, timeout=60, what="3 replicas left")
        # The responses stored on the pod that went are gone with it: a 404 naming the id; the others are read back.
        left = {e.removeprefix("http://") for e in ready_endpoints(api, cluster.server, namespace, "chat")}
        for endpoint, rid in stored.items():
            r = httpx.get(f"{gw}/v1/responses/{rid}", timeout=30)
            if endpoint in left:
                assert r.status_code == 200 and r.json()["id"] == rid, r.text
            else:
                assert r.status_code == 404 and rid in r.json()["error"]["message"] and r.json()["error"]["code"] == "response_not_found", r.text
    finally:
        gateway.stop()
        op.stop()
        runner.stop()
