"""Time to first token of a prompt whose 2,000-token prefix is not in the engine's KV cache: recomputed,
or read back from the disk tier (after the engine's cache evicted it, and after an engine restart on the
same directory); same run, interleaved rounds, median.

    .venv/bin/python bench/kv_tiers.py [--force] [--rounds 3] [--prefix-tokens 2000] [--threads 2]

Each round draws a fresh random prefix (so nothing is cached anywhere) and a 16-token suffix per
request; one output token is generated (its time is the TTFT, tokenization excluded: ids go in).
  recompute: the prefix is new to the engine and to the tier;
  tier after eviction: the prefix was served, then another prompt of the same length evicted it from
    the engine's cache (kv_cache_memory holds about one of them), and it is asked for again;
  tier after restart: the prefix was served by another engine on the same directory, now closed.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import machine, refuse_if_busy, table  # noqa: E402


def ttft(llm, ids: list[int]) -> float:
    from kvpilot.server import SamplingParams

    t0 = time.perf_counter()
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    from kvpilot.server import LLM

    rng = random.Random(0)
    new_ids = lambda n: [rng.randrange(100, 49000) for _ in range(n)]  # noqa: E731
    # about 1.2 prompts of KV (46 KiB per token, float32): a second prompt evicts most of the first
    kv = f"{int(args.prefix_tokens * 1.2 * 46080 / 2**20) + 1}MiB"
    directory = tempfile.mkdtemp(prefix="kvpilot-bench-tier-")
    make = lambda: LLM(num_threads=args.threads, show_progress=False, kv_cache_memory=kv, kv_offload_dir=directory)  # noqa: E731
    llm = make()
    ttft(llm, new_ids(64))  # warm-up
    times: dict[str, list[float]] = {"recompute": [], "tier after eviction": [], "tier after restart": []}
    hits_before = 0
    for _ in range(args.rounds):
        prefix = new_ids(args.prefix_tokens)
        times["recompute"].append(ttft(llm, prefix + new_ids(16)))
        ttft(llm, new_ids(args.prefix_tokens + 16))  # evicts the prefix from the engine's cache
        llm.engine.kv_tiers.drain()
        times["tier after eviction"].append(ttft(llm, prefix + new_ids(16)))
        prefix = new_ids(args.prefix_tokens)
        ttft(llm, prefix + new_ids(16))
        llm.engine.kv_tiers.drain()
        restarted = make()
        times["tier after restart"].append(ttft(restarted, prefix + new_ids(16)))
        hits_before += restarted.engine.kv_tiers.disk.stats.hit_blocks
        del restarted
    stats = llm.engine.kv_tiers.disk.stats
    base = statistics.median(times["recompute"])
    rows = [{"path": name, "TTFT s (median)": f"{statistics.median(v):.3f}", "vs recompute": f"{statistics.median(v) / base:.3f}×"}
            for name, v in times.items()]
    print(f"machine: {machine()}; {args.prefix_tokens}-token prefix + 16; threads {args.threads}; kv_cache_memory {kv}; "
          f"rounds {args.rounds} (median)")
    print(table(rows, ["path", "TTFT s (median)", "vs recompute"]))
    print(f"first engine: {stats.hit_blocks} blocks read ({stats.loaded_bytes / 2**20:.0f} MiB in {stats.load_seconds:.2f} s), "
          f"{stats.saved_blocks} saved ({stats.saved_bytes / 2**20:.0f} MiB in {stats.save_seconds:.2f} s); restarted engines read "
          f"{hits_before} blocks")


if __name__ == "__main__":
    main()
