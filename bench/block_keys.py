"""The prefix cache's bookkeeping cost with SHA-256 block keys vs Python's `hash` of a tuple (the keys
before #43), same run, interleaved rounds.

    .venv/bin/python bench/block_keys.py [--force] [--rounds 5] [--prompt-tokens 4096] [--block-size 16]

Per round and scheme: one sequence of --prompt-tokens tokens has its full blocks registered
(`cache_full_blocks`, as after its prefill), then a second sequence with the same prompt looks them up
(`match_prefix`, as at admission): microseconds per block and milliseconds per prompt, the median over
rounds. The model's own prefill of that prompt is seconds on this machine: the figure to compare with.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import machine, refuse_if_busy, table  # noqa: E402

from kvpilot.server.engine import block_manager  # noqa: E402
from kvpilot.server.engine.sampling_params import SamplingParams  # noqa: E402
from kvpilot.server.engine.sequence import Sequence  # noqa: E402


def python_hash_key(parent, token_ids):
    """The keys before #43: 64 bits, salted per process for strings, a collision found by brute force."""
    return hash((parent, tuple(token_ids), None))


def one_round(tokens: list[int], block_size: int) -> tuple[float, float]:
    """(seconds registering the blocks, seconds looking them up) with the module's current block_hash."""
    n = len(tokens)
    bm = block_manager.BlockManager(n // block_size + 2, block_size)
    first = Sequence(0, "a", 0, tokens, SamplingParams())
    bm.allocate(first, n)
    t0 = time.perf_counter()
    bm.cache_full_blocks(first, n)
    t1 = time.perf_counter()
    hits = bm.match_prefix(Sequence(1, "b", 0, list(tokens), SamplingParams()))
    t2 = time.perf_counter()
    assert len(hits) == (n - 1) // block_size
    return t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    tokens = [(i * 7919) % 49152 for i in range(args.prompt_tokens)]
    sha256_key = block_manager.block_hash
    schemes = {"python hash (before)": python_hash_key, "sha256 (now)": sha256_key}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in schemes}
    for _ in range(args.rounds):
        for name, key in schemes.items():
            block_manager.block_hash = key
            times[name].append(one_round(tokens, args.block_size))
    block_manager.block_hash = sha256_key
    blocks = args.prompt_tokens // args.block_size
    rows = []
    for name, samples in times.items():
        register, lookup = (statistics.median(s[i] for s in samples) for i in (0, 1))
        rows.append({"keys": name, "register µs/block": f"{1e6 * register / blocks:.2f}", "look-up µs/block": f"{1e6 * lookup / blocks:.2f}",
                     f"both, ms per {args.prompt_tokens}-token prompt": f"{1e3 * (register + lookup):.2f}"})
    print(f"machine: {machine()}; block size {args.block_size}; rounds {args.rounds} (median)")
    print(table(rows, ["keys", "register µs/block", "look-up µs/block", f"both, ms per {args.prompt_tokens}-token prompt"]))


if __name__ == "__main__":
    main()
