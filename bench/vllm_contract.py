"""The router contract against vLLM itself: vLLM's CPU build and kvpilot serve the same checkpoint side by
side, get the same requests, and what a router reads from each is compared — the render endpoints'
token ids and fields, the KV events' frames (event kinds, fields, token ids, block size, parents, medium;
the hashes are each engine's own) and /reset_prefix_cache, and the vllm: metric families (kinds and
label names). vLLM is the oracle for shapes; the report lists every difference.

    .venv/bin/python bench/vllm_contract.py [--json OUT]

vLLM's venv and the checkpoint are made on first use (bench/vllm_peer.py). Prints a Markdown report.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import zmq

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import machine  # noqa: E402
from vllm_peer import VLLM_VERSION, hf_checkpoint, vllm_env, vllm_python  # noqa: E402

MODEL = "smollm2-135m"
BLOCK = 32  # vLLM's CPU attention takes multiples of 32
PROMPT = "The history of river trade in northern Europe begins with small boats carrying salt, furs and amber " * 3
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# The names the Gateway API Inference Extension's model-server protocol reads from vLLM.
GIE = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:lora_requests_info", "vllm:cache_config_info")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, name: str, argv: list[str], env: dict, log: Path):
        self.name, self.port, self.events_port = name, free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.bind(f"tcp://127.0.0.1:{self.events_port}")  # the router binds; each engine connects (no wildcard in its endpoint)
        events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{self.events_port}",
                             "topic": f"kv@{name}@{MODEL}"})
        self.log = open(log, "w")
        self.proc = subprocess.Popen([*argv, "--host", "127.0.0.1", "--port", str(self.port), "--kv-events-config", events], env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd="/tmp")

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} exited with {self.proc.returncode} (log: {self.log.name})")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.sub.poll(200)  # a bound SUB passes its subscription on once it polls (libzmq#2267)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise SystemExit(f"{self.name} not ready after {timeout} s (log: {self.log.name})")

    def post(self, path: str, body: dict | None = None) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=300)

    def events(self) -> list[dict]:
        """Every event received so far, as decoded maps (the batch's other fields checked here)."""
        out = []
        while self.sub.poll(1500):
            topic, seq, payload = self.sub.recv_multipart()
            batch = msgspec.msgpack.decode(payload)
            assert isinstance(batch, list) and len(seq) == 8 and topic == f"kv@{self.name}@{MODEL}".encode(), (topic, batch)
            out += [{**e, "_batch_len": len(batch)} for e in batch[1]]
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.sub.close(linger=0)


def shape(value):
    """A JSON value's shape: the types of its leaves, the keys of its maps."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def diff_shapes(ours, theirs, path="") -> list[str]:
    if isinstance(theirs, dict) and isinstance(ours, dict):
        out = [f"`{path}.{k}`: vLLM only" for k in theirs.keys() - ours.keys()] + [f"`{path}.{k}`: kvpilot only" for k in ours.keys() - theirs.keys()]
        for k in theirs.keys() & ours.keys():
            out += diff_shapes(ours[k], theirs[k], f"{path}.{k}")
        return sorted(out)
    if isinstance(theirs, list) and isinstance(ours, list) and theirs and ours:
        return diff_shapes(ours[0], theirs[0], path + "[]")
    if ours != theirs and "NoneType" not in (ours, theirs) and [] not in (ours, theirs):
        return [f"`{path}`: kvpilot {ours}, vLLM {theirs}"]
    return []


def event_view(events: list[dict]) -> list[dict]:
    """What must agree between two engines' events for the same requests: kinds, fields, tokens, sizes,
    whether a parent is given, medium, LoRA (the hashes are each engine's own)."""
    view = []
    for e in events:
        v = {"type": e["type"], "fields": sorted(k for k in e if not k.startswith("_")), "batch_len": e["_batch_len"]}
        if e["type"] == "BlockStored":
            v |= {"blocks": len(e["block_hashes"]), "token_ids": e["token_ids"], "block_size": e["block_size"],
                  "first_block": e["parent_block_hash"] is None, "medium": e["medium"], "lora": (e["lora_id"], e["lora_name"]),
                  "hash_type": type(e["block_hashes"][0]).__name__}
        elif e["type"] == "BlockRemoved":
            v |= {"blocks": len(e["block_hashes"]), "medium": e["medium"]}
        view.append(v)
    return view


def metric_families(url: str) -> dict[str, tuple[str, frozenset[str]]]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if f.name.startswith("vllm:") and not f.name.endswith("_created"):  # kvpilot exports no *_created series (nothing reads them)
            out[f.name] = (f.type, frozenset(k for s in f.samples for k in s.labels if k != "le"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the comparison's data here too")
    args = ap.parse_args()
    python, checkpoint = vllm_python(), hf_checkpoint()
    logs = Path(os.environ.get("TMPDIR", "/tmp"))
    common = [str(checkpoint), "--served-model-name", MODEL, "--max-model-len", "2048", "--block-size", str(BLOCK)]
    vllm = Server("vllm", [str(python), "-m", "vllm.entrypoints.cli.main", "serve", *common, "--dtype", "bfloat16", "--enforce-eager",
                           "--enable-prefix-caching", "--max-num-seqs", "8", "--enable-scale-out"],
                  {**vllm_env(), "VLLM_SERVER_DEV_MODE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}, logs / "vllm-contract-vllm.log")
    kvpilot = Server("kvpilot", [str(Path(sys.executable).parent / "kvpilot"), "serve", "--model", *common, "--dtype", "bfloat16",
                                 "--num-threads", "2", "--max-num-seqs", "8", "--kv-cache-memory", "256MiB"],
                     dict(os.environ), logs / "vllm-contract-kvpilot.log")
    report: dict = {"machine": machine(), "vllm": VLLM_VERSION}
    try:
        kvpilot.wait_ready(300)
        started = time.monotonic()
        vllm.wait_ready(900)
        report["vllm_start_seconds"] = round(time.monotonic() - started)
        servers = (kvpilot, vllm)

        # 1. render: the token ids a router hashes, and the fields around them
        renders = {}
        completion = {"model": MODEL, "prompt": ["The sky is", PROMPT], "max_tokens": 5, "temperature": 0}
        # tool_choice none: vLLM answers tools with tool_choice auto (the default) only with --enable-auto-tool-choice and a parser
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, "tool_choice": "none",
                "max_tokens": 5, "temperature": 0}
        for name, path, body in (("completions", "/v1/completions/render", completion), ("chat with tools", "/v1/chat/completions/render", chat)):
            got = {s.name: s.post(path, body) for s in servers}
            pair = {n: r.json() if r.status_code == 200 else {"status": r.status_code, "body": r.text[:300]} for n, r in got.items()}
            items = {n: (p if isinstance(p, list) else [p]) for n, p in pair.items()}
            renders[name] = {"status": {n: r.status_code for n, r in got.items()}, "errors": {n: p for n, p in pair.items() if "status" in p},
                             "same_token_ids": all(a.get("token_ids") == b.get("token_ids") for a, b in zip(items["kvpilot"], items["vllm"])),
                             "token_ids": {n: [item.get("token_ids") for item in its] for n, its in items.items()},
                             "shape_differences": diff_shapes(shape(items["kvpilot"][0]), shape(items["vllm"][0]))}
        report["render"] = renders

        # 2. KV events: a prompt, the same again (a prefix hit), a reset, the prompt again
        for s in servers:
            s.events()  # what start-up published
        resets = {}
        for s in servers:
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
            for _ in range(2):
                assert s.post("/v1/completions", body).status_code == 200
            reset = s.post("/reset_prefix_cache")
            resets[s.name] = (reset.status_code, reset.text)
            assert s.post("/v1/completions", body).status_code == 200
        raw = {s.name: s.events() for s in servers}
        views = {name: event_view(events) for name, events in raw.items()}
        report["first_stored"] = {name: next((e for e in events if e["type"] == "BlockStored"), None) for name, events in raw.items()}
        same = [a == b for a, b in zip(views["kvpilot"], views["vllm"])]
        report["events"] = {"kvpilot": views["kvpilot"], "vllm": views["vllm"], "same_sequence": len(views["kvpilot"]) == len(views["vllm"])
                            and all(same), "reset": resets}

        # 3. metric families under vLLM's names
        fams = {s.name: metric_families(s.url) for s in servers}
        ours, theirs = fams["kvpilot"], fams["vllm"]
        report["metrics"] = {
            "gie": {name: {"kvpilot": [ours[name][0], sorted(ours[name][1])] if name in ours else "absent",
                           "vllm": [theirs[name][0], sorted(theirs[name][1])] if name in theirs else "absent"} for name in GIE},
            "vllm_only": sorted(theirs.keys() - ours.keys()), "kvpilot_only": sorted(ours.keys() - theirs.keys()),
            "different": {n: {"kvpilot": [ours[n][0], sorted(ours[n][1])], "vllm": [theirs[n][0], sorted(theirs[n][1])]}
                          for n in sorted(ours.keys() & theirs.keys()) if ours[n] != theirs[n]}}
    finally:
        for s in (kvpilot, vllm):
            s.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=list))
    print_report(report)


def print_report(r: dict) -> None:
    print(f"vLLM {r['vllm']} (CPU build, started in {r.get('vllm_start_seconds')} s) vs kvpilot, same checkpoint; {r['machine']}\n")
    print("| render | status (kvpilot, vLLM) | same token ids | field differences |\n|---|---|---|---|")
    for name, x in r["render"].items():
        print(f"| {name} | {x['status']['kvpilot']}, {x['status']['vllm']} | {x['same_token_ids']} | {'; '.join(x['shape_differences']) or 'none'} |")
    e = r["events"]
    print(f"\nKV events: the same sequence (kinds, fields, tokens, sizes, first blocks, medium, LoRA, hash type): {e['same_sequence']}; "
          f"/reset_prefix_cache: {e['reset']}")
    for name in ("kvpilot", "vllm"):
        print(f"- {name}: " + ", ".join(f"{v['type']}({v.get('blocks', '')}{', ' + v['medium'] if 'medium' in v else ''})" for v in e[name]))
    if not e["same_sequence"]:
        for a, b in zip(e["kvpilot"], e["vllm"]):
            if a != b:
                print(f"  first difference: kvpilot {json.dumps(a)[:400]}\n                    vLLM    {json.dumps(b)[:400]}")
                break
    print(f"\nthe first BlockStored of each: {json.dumps(r['first_stored'])[:1500]}")
    m = r["metrics"]
    print("\n| GIE name | kvpilot (kind, labels) | vLLM (kind, labels) |\n|---|---|---|")
    for name, x in m["gie"].items():
        print(f"| `{name}` | {x['kvpilot']} | {x['vllm']} |")
    print(f"\nvllm: families vLLM has and kvpilot not ({len(m['vllm_only'])}): {', '.join(m['vllm_only'])}")
    print(f"\nvllm: families kvpilot has and vLLM not here ({len(m['kvpilot_only'])}): {', '.join(m['kvpilot_only'])}")
    print(f"\nshared families whose kind or labels differ ({len(m['different'])}):")
    for name, x in m["different"].items():
        print(f"- `{name}`: kvpilot {x['kvpilot']}, vLLM {x['vllm']}")


if __name__ == "__main__":
    main()
