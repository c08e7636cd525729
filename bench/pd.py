"""Prefill/decode handoff on loopback: for a 1,000- and a 4,000-token prompt, the time to first token of
the aggregated engine vs prefill on one engine + pull and first token on another (what the handoff
adds), and the pull's cost per block and throughput; same run, interleaved rounds, median.

    .venv/bin/python bench/pd.py [--force] [--rounds 3] [--threads 2] [--tensor-parallel-size 1] [--prompts 1000,4000]
                               [--json bench/results/pd.json]

One rank: the three engines (aggregated, prefill, decode) live in this process and run one after the
other, as pods on one machine would. N ranks (tensor parallelism: one such engine per process): the
prefill engine is a `kvpilot serve` of N ranks (it answers the aggregated requests too, over HTTP), the
decode engine N ranks in this process. The K/V moves rank to rank with NIXL (UCX over TCP on
127.0.0.1; the metadata over the ZeroMQ transfer port). The speed-up disaggregation is for (prefills no
longer stalling other requests' decodes) needs separate machines: not measured here.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import machine, refuse_if_busy, save_results, table  # noqa: E402


def timed(llm, ids, params) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = llm.generate([ids], params)[0]
    return time.perf_counter() - t0, out


class PrefillServer:
    """A `kvpilot serve --kv-role prefill` of N ranks: the prefill engine, and the aggregated one."""

    def __init__(self, ranks: int, threads: int):
        import socket
        import subprocess

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        kvpilot = os.path.join(os.path.dirname(sys.executable), "kvpilot")
        self.proc = subprocess.Popen([kvpilot, "serve", "--port", str(self.port), "--num-threads", str(threads), "--kv-cache-memory", "512MiB",
                                      "--tensor-parallel-size", str(ranks), "--kv-role", "prefill", "--kv-transfer-port", "0"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import httpx

        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError("the prefill server did not start")

    def complete(self, ids: list[int], **extra) -> tuple[float, dict]:
        t0 = time.perf_counter()
        body = self.client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0, **extra}).json()
        return time.perf_counter() - t0, body

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--prompts", default="1000,4000")
    ap.add_argument("--json", help="write the table's figures here too (bench/results/: make plots draws them)")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    from kvpilot.server import LLM, SamplingParams
    from kvpilot.server.engine.sampling_params import KVTransferParams

    ranks = args.tensor_parallel_size
    rng = random.Random(0)
    os.environ.setdefault("KVPILOT_KV_TRANSFER_SECRET", secrets.token_urlsafe(32))  # the pool's (the engines inherit it)
    make = lambda **kw: LLM(num_threads=args.threads, show_progress=False, kv_cache_memory="512MiB", **kw)  # noqa: E731
    first = SamplingParams(temperature=0, max_tokens=1)
    server = plain = prefill = None
    if ranks == 1:
        plain, prefill = make(), make(kv_role="prefill", kv_transfer_port=0)
    else:
        server = PrefillServer(ranks, args.threads)
    decode = make(kv_role="decode", tensor_parallel_size=ranks)
    warm = [rng.randrange(100, 49000) for _ in range(64)]
    for llm in (plain, prefill, decode):
        if llm is not None:
            llm.generate([warm], first)
    if server is not None:
        server.complete(warm)
    rows, figures = [], []
    try:
        for n in map(int, args.prompts.split(",")):
            times: dict[str, list[float]] = {"aggregated": [], "prefill": [], "decode (pull + first token)": []}
            rates, per_block = [], []
            for _ in range(args.rounds):
                ids = [rng.randrange(100, 49000) for _ in range(n)]  # new to every engine: nothing cached
                if server is None:
                    times["aggregated"].append(timed(plain, ids, first)[0])
                    seconds, out = timed(prefill, ids, SamplingParams(temperature=0, max_tokens=1,
                                                                      kv_transfer=KVTransferParams(do_remote_decode=True)))
                    handed = out.kv_transfer_params
                else:
                    times["aggregated"].append(server.complete(ids)[0])
                    server.client.post("/reset_prefix_cache")  # (one engine serves both: the prefill request computes the prompt anew)
                    seconds, body = server.complete(ids, kv_transfer_params={"do_remote_decode": True})
                    handed = body["kv_transfer_params"]
                times["prefill"].append(seconds)
                stats = decode.engine.kv_connector.receiver.stats
                pulled, blocks, pull_seconds = stats.pulled_bytes, stats.pulled_blocks, stats.pull_seconds
                seconds, _ = timed(decode, ids, SamplingParams(temperature=0, max_tokens=1, kv_transfer=KVTransferParams.from_dict(handed)))
                times["decode (pull + first token)"].append(seconds)
                rates.append((stats.pulled_bytes - pulled) / (stats.pull_seconds - pull_seconds) / 1e9)
                per_block.append((stats.pull_seconds - pull_seconds) / (stats.pulled_blocks - blocks) * 1000)
            med = {k: statistics.median(v) for k, v in times.items()}
            added = med["prefill"] + med["decode (pull + first token)"] - med["aggregated"]
            rows.append({"ranks": ranks, "prompt tokens": n, "aggregated TTFT s": f"{med['aggregated']:.3f}", "prefill s": f"{med['prefill']:.3f}",
                         "decode: pull + first token s": f"{med['decode (pull + first token)']:.3f}",
                         "handoff adds s": f"{added:.3f} ({added / med['aggregated']:.0%})",
                         "pull ms/block": f"{statistics.median(per_block):.2f}", "pull GB/s": f"{statistics.median(rates):.2f}"})
            figures.append({"prompt_tokens": n, "aggregated_ttft_s": med["aggregated"], "prefill_s": med["prefill"],
                            "decode_pull_first_token_s": med["decode (pull + first token)"], "handoff_adds_s": added,
                            "pull_ms_per_block": statistics.median(per_block), "pull_gb_per_s": statistics.median(rates)})
    finally:
        if server is not None:
            server.close()
    print(f"machine: {machine()}; threads {args.threads} per rank; {ranks} rank(s); rounds {args.rounds} (median); loopback, NIXL (UCX over TCP)")
    print(table(rows, list(rows[0])))
    if args.json:
        save_results(args.json, ranks=ranks, threads=args.threads, rounds=args.rounds, transport="NIXL, UCX over TCP on 127.0.0.1", results=figures)
    stats = decode.engine.kv_connector.receiver.stats
    print(f"decode engine: {stats.pulled_blocks} blocks pulled ({stats.pulled_bytes / 2**20:.0f} MiB over its ranks), {stats.failed_pulls} pulls short")
    decode.engine.close()


if __name__ == "__main__":
    main()
