"""The KV cache's element type at a fixed --kv-cache-memory: float32 (auto on CPU), bfloat16 and fp8.
Capacity (blocks, tokens) and a decode-heavy workload that outgrows the smaller caches: 32 prompts of
~150 tokens, 64 tokens out each, max_num_seqs 32, gguf weights; at 80 MiB float32 holds about 7 such
sequences at a time, bfloat16 15 and fp8 31. A cache that cannot hold every sequence preempts
and recomputes; the table gives tokens/s, preemptions and the decode-step time, median of interleaved
rounds, each dtype's ratio to float32 in the same run. Then one decode-attention call (the C++ kernel,
16 sequences of 400 tokens, SmolLM2's 9/3 heads of 64) per cache dtype, median of 50.

The quality of the narrower caches (--quality, instead): over QUALITY_TEXT, the full-vocabulary KL of
each next-token distribution from the float32 and bfloat16 caches to the fp8 one's (one prefill each:
runner.score), and the greedy agreement of 48-token continuations of eight prompts.

    .venv/bin/python bench/kv_cache_dtype.py [--memory 80MiB] [--rounds 3] [--threads 2] [--force]
    .venv/bin/python bench/kv_cache_dtype.py --quality
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from kvpilot.server.threads import OPENMP_ENV  # noqa: E402

os.environ.update({k: os.environ.get(k, v) for k, v in OPENMP_ENV.items()})

from common import machine, refuse_if_busy, table  # noqa: E402

from kvpilot.server import LLM, SamplingParams  # noqa: E402

DTYPES = ("auto", "bfloat16", "fp8")
SUBJECTS = ("volcanoes", "glaciers", "harbours", "orchards", "comets", "bridges", "forests", "markets")


def prompts(n: int) -> list[str]:
    """n different prompts of ~150 tokens (no shared prefix beyond the first word)."""
    return [f"{i}. About {SUBJECTS[i % len(SUBJECTS)]}: " + " ".join(
        f"Fact {j} on {SUBJECTS[(i + j) % len(SUBJECTS)]} number {i * 31 + j}: it is worth noting for reason {j * 7 % 13}." for j in range(7))
        for i in range(n)]


QUALITY_TEXT = """\
Lighthouses were once kept by families who lived at the foot of the tower. Every evening the keeper climbed
the spiral stairs, trimmed the wick, polished the lens and wound the clockwork that turned it; on foggy
nights he sounded a horn every thirty seconds until dawn. The work was lonely and exact. A logbook records
each night: the weather, the ships that passed, the oil that burned. In 1939 the last keeper of the
northern light wrote that a storm had broken three panes of the lantern room, and that he had held the
lamp steady with his own hands until the glazier came by boat two days later. Automation arrived in the
1960s: an electric lamp, a timer, a radio link to the coast. The keepers' cottages became holiday houses,
and the logbooks went to a museum, where a visitor can read, in faded ink, the names of ships long since
broken up, and the quiet remark, written on a clear night in June, that nothing at all had happened.
"""
QUALITY_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.", "List three prime numbers:",
                   "Once upon a time, in a small village,", "The main causes of inflation are", "Translate 'good morning' into Spanish:",
                   "SELECT name FROM users WHERE")


def kl_rows(p_logits, q_logits):
    """KL(p || q) of each row's softmax (float64)."""
    import torch

    p, q = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return (p.exp() * (p - q)).sum(-1)


def quality(threads: int) -> None:
    from kvpilot.server import SamplingParams

    logits, greedy = {}, {}
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    for kv in DTYPES:
        llm = LLM(quantization="gguf", kv_cache_dtype=kv, kv_cache_memory="64MiB", show_progress=False, num_threads=threads,
                  enable_prefix_caching=False)
        ids = llm.engine.tokenizer.encode(QUALITY_TEXT)
        logits[kv] = llm.engine.worker.score(ids)
        greedy[kv] = [o.outputs[0].token_ids for o in llm.generate(list(QUALITY_PROMPTS), params)]
        llm.engine.close()
    rows = []
    for ref in ("auto", "bfloat16"):
        kl = kl_rows(logits[ref], logits["fp8"])
        agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(greedy[ref], greedy["fp8"])]
        same_top = (logits[ref].argmax(-1) == logits["fp8"].argmax(-1)).float().mean().item()
        rows.append({"reference cache": "float32" if ref == "auto" else ref, "positions": len(kl), "mean KL(ref || fp8)": f"{kl.mean():.2e}",
                     "max KL": f"{kl.max():.2e}", "same argmax": f"{same_top:.1%}",
                     "greedy tokens before divergence (of 48)": " ".join(map(str, agree))})
    print(f"machine: {machine()}, gguf weights, QUALITY_TEXT ({len(kl)} tokens) and {len(QUALITY_PROMPTS)} prompts")
    print(table(rows, list(rows[0])))


def attention_call_ms(threads: int) -> dict[str, float]:
    import torch

    from kvpilot.kernels import cpu_extension
    from kvpilot.kernels.paged_attention import FP8_KV

    ext = cpu_extension.require()
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    batch, ctx, block = 16, 400, 16
    blocks = batch * -(-ctx // block)
    k, v = (torch.randn(blocks, block, 3, 64, generator=gen) for _ in range(2))
    tables, lens, q = torch.arange(blocks).view(batch, -1), torch.full((batch,), ctx), torch.randn(batch, 9, 64, generator=gen)
    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("fp8", FP8_KV)):
        kc, vc = k.to(dtype), v.to(dtype)
        times = []
        for _ in range(55):
            start = time.perf_counter()
            ext.paged_decode_attention(q, kc, vc, tables, lens, 0.125)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times[5:]) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--memory", default="80MiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--quality", action="store_true", help="the caches' quality (KL, greedy agreement) instead of their speed")
    args = ap.parse_args()
    if args.quality:
        return quality(args.threads)
    refuse_if_busy(force=args.force)
    work = prompts(32)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    engines = {kv: LLM(quantization="gguf", kv_cache_dtype=kv, kv_cache_memory=args.memory, max_num_seqs=32, show_progress=False,
                       num_threads=args.threads, enable_prefix_caching=False) for kv in DTYPES}
    prompt_tokens = sum(len(engines["auto"].engine.tokenizer.encode(p)) for p in work)
    results: dict[str, list[tuple[float, int]]] = {kv: [] for kv in DTYPES}
    for llm in engines.values():  # warm-up
        llm.generate(work[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    for _ in range(args.rounds):
        for kv, llm in engines.items():
            start = time.perf_counter()
            outs = llm.generate(work, params)
            wall = time.perf_counter() - start
            results[kv].append((sum(len(o.outputs[0].token_ids) for o in outs) / wall, sum(o.metrics.num_preemptions for o in outs)))
    base = statistics.median(r for r, _ in results["auto"])
    rows = []
    for kv, llm in engines.items():
        runner = llm.engine.worker
        rate = statistics.median(r for r, _ in results[kv])
        rows.append({"kv_cache_dtype": f"{kv} ({runner.kv_dtype})".replace("torch.", ""), "blocks": runner.num_blocks,
                     "tokens held": runner.num_blocks * runner.block_size, "tok/s": f"{rate:.1f}", "vs float32": f"{rate / base:.2f}x",
                     "preemptions": "/".join(str(p) for _, p in results[kv])})
    print(f"machine: {machine()}, {args.threads} threads, kv_cache_memory {args.memory}, 32 prompts ({prompt_tokens} tokens) x 64 out, "
          f"max_num_seqs 32, median of {args.rounds} interleaved rounds")
    print(table(rows, ["kv_cache_dtype", "blocks", "tokens held", "tok/s", "vs float32", "preemptions"]))
    calls = attention_call_ms(args.threads)
    print("decode attention, one layer's call (16 x 400 tokens): " + ", ".join(f"{k} {ms:.2f} ms" for k, ms in calls.items()))


if __name__ == "__main__":
    main()
