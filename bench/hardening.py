"""Figures behind issue #75's bounds (bench/history/, "Hardening III"):

- `depth`: the longest chain of each constraint shape that llguidance compiles on a thread of a given
  stack, bisected over child processes (a crash is a SIGSEGV of the child, never of this process):
  the per-level stack cost that sizes structured.py's COMPILE_STACK_BYTES and MAX_CONSTRAINT_DEPTH.
- `gateway`: kvpilot-gateway's RSS with 80 bodies of 4 MiB held one byte short (no API key: the
  gateway checks none), on its default limits.

And issue #76's (bench/history/, "Hardening III (second)"), each against a `kvpilot serve` of the
code importable here (run it with PYTHONPATH at an older checkout for the "before"):
- `compiles`: a plain 16-token completion's latency, alone and while two clients send the issue's
  10,000-optional-property schema (300 KB) at once.
- `masks`: the inter-token latency of 4 plain streams, alone and beside 8 requests (sent with them)
  of the issue's 19-byte regex `((a{100}){100}){10}`, or of 8 different regexes of ~8 ms a mask.

Usage: python bench/hardening.py depth [--stack-mib 8] | gateway | compiles | masks
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SHAPES = ("schema", "flat", "lark")


def constraint(shape: str, n: int) -> tuple[str, str]:
    from structured_corpus import ref_chain_schema, rule_chain_grammar

    if shape == "schema":
        return "json", json.dumps(ref_chain_schema(n))
    if shape == "flat":  # $ref to $ref, no objects between
        defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
        return "json", json.dumps({"$defs": {**defs, f"d{n}": {"type": "integer"}}, "$ref": "#/$defs/d0"})
    return "lark", rule_chain_grammar(n)


def compile_once(shape: str, n: int, stack_mib: int) -> None:
    """In a child: compile on a thread of stack_mib MiB (a stack overflow kills this process)."""
    import llguidance

    from kvpilot.server.loading import open_model
    from kvpilot.server.model_files import resolve_model_path

    _, tokenizer = open_model(resolve_model_path("smollm2-135m"))
    kind, text = constraint(shape, n)

    def run() -> None:
        tok = llguidance.LLTokenizer(tokenizer.backend_json())
        grammar = llguidance.LLMatcher.grammar_from_json_schema(text) if kind == "json" else llguidance.LLMatcher.grammar_from_lark(text)
        llguidance.LLMatcher(tok, grammar, log_level=0)

    threading.stack_size(stack_mib << 20)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()


def survives(shape: str, n: int, stack_mib: int) -> bool:
    child = subprocess.run([sys.executable, __file__, "_compile", shape, str(n), str(stack_mib)], capture_output=True, timeout=600)
    return child.returncode == 0


def depth(stack_mib: int) -> None:
    print(f"| shape (stack {stack_mib} MiB) | compiles | crashes | stack per level |")
    print("|---|---|---|---|")
    for shape in SHAPES:
        low, high = 100, 100
        while survives(shape, high, stack_mib):
            low, high = high, high * 2
        while high - low > max(low // 20, 1):
            mid = (low + high) // 2
            low, high = (mid, high) if survives(shape, mid, stack_mib) else (low, mid)
        print(f"| {shape} | {low} | {high} | {(stack_mib << 20) / high / 1024:.1f} KiB |")


def rss_mib(pid: int) -> int:
    return int(next(line for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS")).split()[1]) // 1024


def gateway() -> None:
    import httpx

    from server_harness import free_port

    port = free_port()
    serve = ("from kvpilot.operator.gateway.proxy import GatewayConfig, StaticEndpoints, build_app, uvicorn_settings; import uvicorn; "
             f"c = GatewayConfig(); uvicorn.run(build_app(StaticEndpoints({{}}), c), host='127.0.0.1', port={port}, log_level='warning', "
             "**uvicorn_settings(c))")
    proc = subprocess.Popen([sys.executable, "-c", serve])
    try:
        for _ in range(100):
            try:
                httpx.get(f"http://127.0.0.1:{port}/health")
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        before, socks, size = rss_mib(proc.pid), [], 4 << 20
        for _ in range(80):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % size)
            try:
                s.sendall(b"x" * (size - 1))
            except OSError:
                pass  # answered (429) and closed while still sending
            socks.append(s)
        time.sleep(3)
        print(f"gateway RSS {before} MiB -> {rss_mib(proc.pid)} MiB with 80 x 4 MiB bodies held one byte short")
    finally:
        proc.kill()


def serve(*args: str):
    from server_harness import ServerProcess

    return ServerProcess("--max-num-seqs", "16", "--max-waiting-requests", "64", *args).wait_ready()


def plain_latency(url: str) -> float:
    import httpx

    started = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 16, "ignore_eos": True}, timeout=300)
    r.raise_for_status()
    return time.perf_counter() - started


def compiles() -> None:
    import httpx

    server = serve()
    try:
        schema = {"type": "object", "properties": {f"property_{i}": {"type": "string"} for i in range(10_000)}}
        body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "wide", "schema": schema}}}
        alone = plain_latency(server.url)
        answers = []

        def wide(i: int) -> None:
            started = time.perf_counter()
            r = httpx.post(server.url + "/v1/chat/completions", json={**body, "seed": i}, timeout=300)
            answers.append(f"{r.status_code} in {time.perf_counter() - started:.2f} s")

        threads = [threading.Thread(target=wide, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.3)
        during = plain_latency(server.url)
        for t in threads:
            t.join()
        print(f"16-token completion: {alone:.2f} s alone, {during:.2f} s beside two {len(json.dumps(schema)) >> 10} KB schemas "
              f"(their answers: {', '.join(answers)})")
    finally:
        server.terminate()


def itl_p50(url: str, streams: int = 4) -> float:
    import statistics

    import httpx

    gaps: list[float] = []

    def one() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            last = None
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now

    threads = [threading.Thread(target=one) for _ in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.median(gaps)


def masks() -> None:
    import httpx

    server = serve()
    regexes = {"the issue's regex": lambda i: "((a{100}){100}){10}",
               "8 different regexes of ~8 ms a mask": lambda i: f"((a{{{100 + i}}}){{100}}){{4}}"}
    try:
        alone = itl_p50(server.url)
        print(f"ITL p50 of 4 plain streams (48 tokens) alone: {alone * 1000:.0f} ms")
        for what, regex in regexes.items():
            outcomes: dict[int, int] = {}

            def regex_client(i: int, outcomes: dict = outcomes, regex=regex) -> None:
                while True:  # a 429 (one compile at a time per client: all of these come from one address) is retried
                    r = httpx.post(server.url + "/v1/completions", timeout=300,
                                   json={"prompt": "x", "max_tokens": 48, "structured_outputs": {"regex": regex(i)}})
                    if r.status_code != 429:
                        break
                    time.sleep(0.02)
                outcomes[r.status_code] = outcomes.get(r.status_code, 0) + 1

            clients = [threading.Thread(target=regex_client, args=(i,)) for i in range(8)]
            for t in clients:
                t.start()
            beside = itl_p50(server.url)
            for t in clients:
                t.join()
            print(f"  beside 8 requests of {what}: {beside * 1000:.0f} ms ({beside / alone:.2f}x; their statuses: {outcomes})")
    finally:
        server.terminate()


if __name__ == "__main__":
    if sys.argv[1:2] == ["_compile"]:
        compile_once(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        sys.exit(0)
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["depth", "gateway", "compiles", "masks"])
    ap.add_argument("--stack-mib", type=int, default=8)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    {"depth": lambda: depth(args.stack_mib), "gateway": gateway, "compiles": compiles, "masks": masks}[args.what]()
