"""Time to first token of a prompt whose 2,000-token prefix is not in the engine's KV cache: recomputed,
or read back from the disk tier (after the engine's cache evicted it, and after an engine restart on the
same directory); same run, interleaved rounds, median.

    .venv/bin/python bench/kv_tiers.py [--force] [--parts ttft,itl,spec] [--rounds 3] [--prefix-tokens 2000] [--load-tokens 4000] [--threads 2]

Each round draws a fresh random prefix (so nothing is cached anywhere) and a 16-token suffix per
request; one output token is generated (its time is the TTFT, tokenization excluded: ids go in).
  recompute: the prefix is new to the engine and to the tier;
  tier after eviction: the prefix was served, then another prompt of the same length evicted it from
    the engine's cache (kv_cache_memory holds about one of them), and it is asked for again;
  tier after restart: the prefix was served by another engine on the same directory, now closed;
  host tier after eviction: as after eviction, on an engine with a host tier (and the disk tier).

Then the inter-token latency of 8 decoding clients (one token each per step) while a 4,000-token
prompt's blocks are read from the disk tier (a fresh engine on a directory holding them), and while
such a prompt is computed and its blocks saved (vs the same prompt on an engine without a tier): the
p99 of the steps from its arrival until it is done, vs the clients decoding alone; for the load also the
steps while its blocks are read and written into the cache (before the step that computes its tail).

Then (spec) a draft model's acceptance on prompts computed vs the same prompts read back from the disk
tier (the drafter's K/V moves with the target's blocks: the KV connector) vs read back with the
drafter's K/V of those blocks zeroed (what not moving it would give), and the drafter's share of a
block's bytes: the bundled model drafts for itself.
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

from common import machine, refuse_if_busy, save_results, table  # noqa: E402


def ttft(llm, ids: list[int]) -> float:
    from kvpilot.server import SamplingParams

    t0 = time.perf_counter()
    llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--load-tokens", type=int, default=4000, help="the prompt loaded or saved while the clients decode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parts", default="ttft,itl,spec", help="which tables: ttft, itl, spec (comma-separated)")
    ap.add_argument("--json", help="write the TTFT table's figures here too (bench/results/: make plots draws them)")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    if args.json and "ttft" not in args.parts.split(","):
        ap.error("--json keeps the ttft part's figures: add ttft to --parts")
    refuse_if_busy(force=args.force)
    rng = random.Random(0)
    new_ids = lambda n: [rng.randrange(100, 49000) for _ in range(n)]  # noqa: E731
    parts = args.parts.split(",")
    if "ttft" in parts:
        ttfts(args, new_ids)
    if "spec" in parts:
        drafted_on_loaded_blocks(args)
    if "itl" in parts:
        itl(args, new_ids)


def ttfts(args, new_ids) -> None:
    from kvpilot.server import LLM

    # about 1.2 prompts of KV (46 KiB per token, float32): a second prompt evicts most of the first
    kv = f"{int(args.prefix_tokens * 1.2 * 46080 / 2**20) + 1}MiB"
    directory = tempfile.mkdtemp(prefix="kvpilot-bench-tier-")
    make = lambda: LLM(num_threads=args.threads, show_progress=False, kv_cache_memory=kv, kv_offload_dir=directory)  # noqa: E731
    llm = make()
    ttft(llm, new_ids(64))  # warm-up
    hosted = LLM(num_threads=args.threads, show_progress=False, kv_cache_memory=kv, kv_offload_dir=tempfile.mkdtemp(prefix="kvpilot-bench-tier-"),
                 kv_host_offload_size=f"{args.prefix_tokens * 3 * 46080 >> 20}MiB")
    ttft(hosted, new_ids(64))
    times: dict[str, list[float]] = {"recompute": [], "tier after eviction": [], "tier after restart": [], "host tier after eviction": []}
    hits_before = 0
    for _ in range(args.rounds):
        prefix = new_ids(args.prefix_tokens)
        times["recompute"].append(ttft(llm, prefix + new_ids(16)))
        ttft(llm, new_ids(args.prefix_tokens + 16))  # evicts the prefix from the engine's cache
        llm.engine.kv_connector.drain()
        times["tier after eviction"].append(ttft(llm, prefix + new_ids(16)))
        prefix = new_ids(args.prefix_tokens)
        ttft(llm, prefix + new_ids(16))
        llm.engine.kv_connector.drain()
        restarted = make()
        times["tier after restart"].append(ttft(restarted, prefix + new_ids(16)))
        hits_before += restarted.engine.kv_connector.disk.stats.hit_blocks
        del restarted
        prefix = new_ids(args.prefix_tokens)
        ttft(hosted, prefix + new_ids(16))
        ttft(hosted, new_ids(args.prefix_tokens + 16))
        hosted.engine.kv_connector.drain()  # as above: the disk writer done with the evicting prompt's blocks
        times["host tier after eviction"].append(ttft(hosted, prefix + new_ids(16)))
    stats = llm.engine.kv_connector.disk.stats
    base = statistics.median(times["recompute"])
    rows = [{"path": name, "TTFT s (median)": f"{statistics.median(v):.3f}", "vs recompute": f"{statistics.median(v) / base:.3f}×"}
            for name, v in times.items()]
    print(f"machine: {machine()}; {args.prefix_tokens}-token prefix + 16; threads {args.threads}; kv_cache_memory {kv}; "
          f"rounds {args.rounds} (median)")
    print(table(rows, ["path", "TTFT s (median)", "vs recompute"]))
    if args.json:
        save_results(args.json, prefix_tokens=args.prefix_tokens, rounds=args.rounds,
                     results=[{"path": name, "ttft_s": statistics.median(v), "runs": v} for name, v in times.items()])
    print(f"first engine: {stats.hit_blocks} blocks read ({stats.loaded_bytes / 2**20:.0f} MiB in {stats.load_seconds:.2f} s), "
          f"{stats.saved_blocks} saved ({stats.saved_bytes / 2**20:.0f} MiB in {stats.save_seconds:.2f} s); restarted engines read "
          f"{hits_before} blocks; the host tier: {hosted.engine.kv_connector.host.stats.hit_blocks} blocks copied back")
    del llm, hosted


def kv_in_flight(seq) -> bool:
    """Whether seq's KV is being read from a tier or written into the cache."""
    return seq is not None and (seq.kv_load is not None or bool(seq.kv_writes))


def decode_steps(llm, clients: list[list[int]], arrival: list[int] | None, at_step: int = 8, tokens: int = 48):
    """Step an engine running `clients` (one token each per step) until they end; `arrival` comes in
    at step at_step (one output token). Returns the step times of the clients' tokens after their warm-up,
    those from the arrival until it was done, and those while its KV was in flight (read from a tier or
    being written into the cache: until the step before the one that computes its tail)."""
    from kvpilot.server import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for ids in clients:
        llm.engine.add_request(ids, params)
    steps, window, in_flight, arrival_seq, pending, step = [], [], [], None, False, 0
    last = time.perf_counter()
    while llm.engine.has_unfinished_requests():
        if arrival is not None and step == at_step:
            arrival_id, pending = llm.engine.add_request(arrival, SamplingParams(temperature=0, max_tokens=1)), True
            arrival_seq = llm.engine.requests[arrival_id].seqs[0]
        loading = kv_in_flight(arrival_seq)
        outs = llm.engine.step()
        now = time.perf_counter()
        if any(arrival_seq is None or o.request_id != arrival_seq.request_id for o in outs):  # a step that gave the clients tokens
            if step >= 2:
                steps.append(now - last)
            if pending:
                window.append(now - last)
            if loading and kv_in_flight(arrival_seq):  # still in flight after this step
                in_flight.append(now - last)
            last = now
        pending = pending and not any(o.request_id == arrival_seq.request_id and o.finished for o in outs)
        step += 1
    return steps, window, in_flight


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else values[0]


def itl(args, new_ids) -> None:
    from kvpilot.server import LLM

    long = args.load_tokens
    kv = f"{int((long + 8 * 120) * 1.3 * 46080 / 2**20)}MiB"
    directory = tempfile.mkdtemp(prefix="kvpilot-bench-tier-itl-")
    engine = lambda **kw: LLM(num_threads=args.threads, show_progress=False, kv_cache_memory=kv, max_num_batched_tokens=512, **kw)  # noqa: E731
    clients = lambda: [new_ids(64) for _ in range(8)]  # noqa: E731
    plain, tiered = engine(), engine(kv_offload_dir=directory)
    cases = {"alone": "8 clients decoding alone", "computed": f"…and a {long}-token prompt computed, no tier",
             "saved": f"…and a {long}-token prompt computed + saved", "hit": f"…and a {long}-token prompt found in the engine's cache",
             "loaded": f"…and a {long}-token prompt loaded from disk", "in flight": "…of which the steps while its KV is read and written"}
    p99s: dict[str, list[float]] = {case: [] for case in cases}
    steps: dict[str, int] = {}
    medians, reads = [], []
    for _ in range(args.rounds):  # interleaved; each figure the median of the rounds' p99s
        windows = {"alone": decode_steps(plain, clients(), None)[0]}
        windows["computed"] = decode_steps(plain, clients(), new_ids(long))[1]
        windows["saved"] = decode_steps(tiered, clients(), new_ids(long))[1]
        saved = new_ids(long)
        tiered.generate([saved], None)  # its blocks on disk, and in this engine's own cache
        tiered.engine.kv_connector.drain()
        windows["hit"] = decode_steps(tiered, clients(), saved + new_ids(8))[1]
        fresh = engine(kv_offload_dir=directory)  # nothing in memory: the prompt's blocks come from disk
        _, windows["loaded"], windows["in flight"] = decode_steps(fresh, clients(), saved + new_ids(8))
        reads.append(fresh.engine.kv_connector.disk.stats)
        del fresh
        medians.append(statistics.median(windows["alone"]))
        for case, window in windows.items():
            p99s[case].append(p99(window))
            steps[case] = len(window)
    ms = {case: statistics.median(v) for case, v in p99s.items()}
    rows = [{"case": cases[case], "steps": steps[case], "ITL p99 ms": f"{ms[case] * 1e3:.1f}", "vs alone": f"{ms[case] / ms['alone']:.2f}×"}
            for case in cases]
    rows[4]["vs alone"] += f" ({ms['loaded'] / ms['hit']:.2f}× the cache hit)"
    read = reads[-1]
    print(f"\nITL of 8 clients (64-token prompts, 48 tokens each; alone: median {statistics.median(medians) * 1e3:.1f} ms), "
          f"step budget 512 tokens, kv_cache_memory {kv}; rounds {args.rounds} (median of their p99s); "
          f"a load read {read.hit_blocks} blocks ({read.loaded_bytes / 2**20:.0f} MiB in {read.load_seconds:.2f} s)")
    print(table(rows, ["case", "steps", "ITL p99 ms", "vs alone"]))



def drafted_on_loaded_blocks(args) -> None:
    """A draft model's acceptance on prompts computed, read back from disk with its K/V (as the KV
    connector moves it), and read back with its K/V of the loaded blocks zeroed (what not moving it
    would leave the drafter: the counterfactual); the bundled model drafts for itself (a draft that
    agrees with the target, so that the drafter's context is what decides)."""
    import torch

    from kvpilot.server import LLM, SamplingParams

    sentences = ["The harbour master logs every ship that enters the port before dawn.",
                 "A lighthouse keeper trims the wick and polishes the lens each evening.",
                 "Glaciers carve valleys slowly, leaving moraines where they melt away.",
                 "Beekeepers smoke the hive gently so the bees stay calm during inspection."]
    prompts = [" ".join(sentences[(i + j) % 4] for j in range(24)) + " Then" for i in range(4)]  # ~350 tokens each
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(num_threads=args.threads, show_progress=False, kv_cache_memory="256MiB", kv_offload_dir=os.path.join(tmp, "tier"),
                  speculative_method="draft", speculative_model="smollm2-135m", num_speculative_tokens=4, speculative_disable_batch_size=0,
                  speculative_min_acceptance=0.0)
        engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        worker = engine.worker
        drafter_regions = worker.cache_regions()[2 * len(worker.kv_caches):]
        write_blocks = worker.write_blocks

        def without_the_drafters(loads):
            loads = list(loads)
            write_blocks(loads)
            ids = torch.tensor([block_id for block_id, _, _ in loads], dtype=torch.long)
            for region in drafter_regions:
                region.index_fill_(0, ids, 0)

        rows, first = [], None
        for case in ("computed", "read back from the disk tier (the drafter's K/V moved with it)",
                     "read back, the drafter's K/V of those blocks zeroed (not moved)"):
            if case.startswith("read back, the drafter"):
                worker.write_blocks = without_the_drafters
            stats = engine.proposer.stats
            drafted, accepted, hits = stats.num_draft_tokens, stats.num_accepted_tokens, engine.kv_connector.disk.stats.hit_blocks
            outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            drafted, accepted = stats.num_draft_tokens - drafted, stats.num_accepted_tokens - accepted
            rows.append({"prompts": case, "blocks from disk": engine.kv_connector.disk.stats.hit_blocks - hits, "draft tokens": drafted,
                         "accepted": accepted, "acceptance": f"{accepted / drafted:.3f}",
                         "greedy output": "-" if first is None else ("the same" if outs == first else "DIFFERENT")})
            first = first or outs
            engine.kv_connector.drain()
            engine.reset_prefix_cache()  # the cache forgets them: the disk tier has them
        draft_bytes = sum(r[0].numel() * r.element_size() for r in drafter_regions)
        block_bytes = worker.block_layout()[1]
        engine.close()
    print(f"machine: {machine()}; threads {args.threads}; 4 prompts of ~350 tokens, 64 greedy tokens each, k = 4")
    print(table(rows, list(rows[0])))
    print(f"the drafter's K/V: {draft_bytes / block_bytes:.1%} of a block's bytes ({draft_bytes} of {block_bytes})")

if __name__ == "__main__":
    main()
