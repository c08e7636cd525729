"""Prefill/decode handoff on loopback: for a 1,000- and a 4,000-token prompt, the time to first token of
the aggregated engine vs prefill on one engine + pull and first token on another (what the handoff
adds), and the pull's throughput; same run, interleaved rounds, median.

    .venv/bin/python bench/pd.py [--force] [--rounds 3] [--threads 2]

Both engines live in this process and run one after the other (the prefill engine's step, then the
decode engine's), as two pods on one machine would; the K/V goes through ZeroMQ over 127.0.0.1. The
speed-up disaggregation is for (prefills no longer stalling other requests' decodes) needs separate
machines: not measured here.
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

from common import machine, refuse_if_busy, table  # noqa: E402


def timed(llm, ids, params) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = llm.generate([ids], params)[0]
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    from kvpilot.server import LLM, SamplingParams
    from kvpilot.server.engine.sampling_params import KVTransferParams

    rng = random.Random(0)
    os.environ.setdefault("KVPILOT_KV_TRANSFER_SECRET", secrets.token_urlsafe(32))  # the pool's (both engines are in this process)
    make = lambda **kw: LLM(num_threads=args.threads, show_progress=False, kv_cache_memory="512MiB", **kw)  # noqa: E731
    plain, prefill, decode = make(), make(kv_role="prefill", kv_transfer_port=0), make(kv_role="decode")
    first = SamplingParams(temperature=0, max_tokens=1)
    for llm in (plain, prefill, decode):
        llm.generate([[rng.randrange(100, 49000) for _ in range(64)]], first)  # warm-up
    rows = []
    for n in (1000, 4000):
        times: dict[str, list[float]] = {"aggregated": [], "prefill": [], "decode (pull + first token)": []}
        rates = []
        for _ in range(args.rounds):
            ids = [rng.randrange(100, 49000) for _ in range(n)]  # new to every engine: nothing cached
            times["aggregated"].append(timed(plain, ids, first)[0])
            seconds, out = timed(prefill, ids, SamplingParams(temperature=0, max_tokens=1, kv_transfer=KVTransferParams(do_remote_decode=True)))
            times["prefill"].append(seconds)
            stats = decode.engine.kv_connector.receiver.stats
            pulled, pull_seconds = stats.pulled_bytes, stats.pull_seconds
            seconds, _ = timed(decode, ids, SamplingParams(temperature=0, max_tokens=1,
                                                           kv_transfer=KVTransferParams.from_dict(out.kv_transfer_params)))
            times["decode (pull + first token)"].append(seconds)
            rates.append((stats.pulled_bytes - pulled) / (stats.pull_seconds - pull_seconds) / 1e9)
        med = {k: statistics.median(v) for k, v in times.items()}
        added = med["prefill"] + med["decode (pull + first token)"] - med["aggregated"]
        rows.append({"prompt tokens": n, "aggregated TTFT s": f"{med['aggregated']:.3f}", "prefill s": f"{med['prefill']:.3f}",
                     "decode: pull + first token s": f"{med['decode (pull + first token)']:.3f}",
                     "handoff adds s": f"{added:.3f} ({added / med['aggregated']:.0%})", "pull GB/s": f"{statistics.median(rates):.2f}"})
    print(f"machine: {machine()}; threads {args.threads}; rounds {args.rounds} (median); loopback, ZeroMQ")
    print(table(rows, list(rows[0])))
    stats = decode.engine.kv_connector.receiver.stats
    print(f"decode engine: {stats.pulled_blocks} blocks pulled ({stats.pulled_bytes / 2**20:.0f} MiB), {stats.failed_pulls} pulls short")


if __name__ == "__main__":
    main()
