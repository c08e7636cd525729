"""Structured outputs' cost: compile times for the test corpus (cold and cached), and decode steps of
`--clients` concurrent requests every one constrained by a mid-size schema against the same requests
unconstrained, compared per step (a grammar ends outputs early, so per request would compare
different lengths). Only steps in which every client's row decodes are counted. Rounds alternate the
two modes; the mask's share of a step (bitmask fill on the host + its application in the sampler) is
reported beside it.

    .venv/bin/python bench/structured.py --clients 16 --steps 48 --rounds 3
    .venv/bin/python bench/structured.py --speculation --clients 4 --steps 128 --rounds 2   (n-gram speculates at <= 4 running)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import machine, refuse_if_busy, table  # noqa: E402
from structured_corpus import SCHEMAS, obj, s  # noqa: E402

SCHEMA = obj({"people": {"type": "array", "maxItems": 40,
                         "items": obj({"name": s(12), "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                       "city": {"enum": ["Paris", "Berlin", "Madrid", "Rome", "Lisbon"]}, "member": {"type": "boolean"}})}})


def compile_times(llm) -> dict[str, float]:
    from kvpilot.server.engine.sampling_params import StructuredOutput
    from kvpilot.server.engine.structured import GrammarCompiler

    tok = llm.get_tokenizer()
    compiler = GrammarCompiler(tok.backend_json(), llm.engine.model_config.vocab_size, tok.eos_token_ids)
    cold, cached = [], []
    for _, schema in SCHEMAS:
        for into in (cold, cached):
            t = time.perf_counter()
            compiler.compile(StructuredOutput("json", schema))
            into.append(time.perf_counter() - t)

    def q(values, p):
        return sorted(values)[min(len(values) - 1, int(p * len(values)))] * 1e3

    return {"cold p50 ms": q(cold, 0.5), "cold p99 ms": q(cold, 0.99), "cached p50 ms": q(cached, 0.5), "cached p99 ms": q(cached, 0.99)}


def decode_steps(llm, clients: int, steps: int, constrained: bool, seed: int) -> tuple[list[float], list[tuple[float, float]]]:
    """(seconds of each step in which all clients decode, (mask fill, mask application) seconds in each of them)."""
    import kvpilot.server.engine.sampler as sampler
    from kvpilot.server import SamplingParams
    from kvpilot.server.engine.sampling_params import StructuredOutput

    engine = llm.engine
    tok = llm.get_tokenizer()
    mask_time = [0.0, 0.0]

    def timed(fn, slot):
        def run(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                mask_time[slot] += time.perf_counter() - t
        return run

    fill, apply = engine.grammars.fill_masks, sampler.apply_allowed_tokens
    engine.grammars.fill_masks, sampler.apply_allowed_tokens = timed(fill, 0), timed(apply, 1)
    try:
        for i in range(clients):
            prompt = tok.encode_chat([{"role": "user", "content": f"List {i + 5} people with their name, age, city and membership, as JSON."}])
            engine.add_request(prompt, SamplingParams(
                max_tokens=steps, temperature=0.8, seed=seed + i, ignore_eos=not constrained,
                structured=StructuredOutput("json", SCHEMA) if constrained else None))
        step_times, mask_times = [], []
        while engine.has_unfinished_requests():
            decoding = len(engine.scheduler.running) == clients and all(
                q.num_tokens - q.num_computed_tokens == 1 for q in engine.scheduler.running) and not engine.scheduler.waiting
            mask_time[:] = [0.0, 0.0]
            t = time.perf_counter()
            engine.step()
            if decoding:
                step_times.append(time.perf_counter() - t)
                mask_times.append(tuple(mask_time))
        return step_times, mask_times
    finally:
        engine.grammars.fill_masks, sampler.apply_allowed_tokens = fill, apply


def speculation_choice(clients: int, steps: int, threads: int, rounds: int) -> list[dict]:
    """Constrained requests with n-gram speculation whose drafts are checked against the matcher (what
    the engine does) against no speculation for them (the alternative: every row here is constrained),
    in output tokens per second over whole requests, rounds alternating."""
    from kvpilot.server import LLM, SamplingParams
    from kvpilot.server.engine.sampling_params import StructuredOutput

    engines = {"n-gram drafts checked by the matcher": LLM(num_threads=threads, show_progress=False, max_num_seqs=clients,
                                                           speculative_method="ngram", num_speculative_tokens=4),
               "no speculation for constrained rows": LLM(num_threads=threads, show_progress=False, max_num_seqs=clients)}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    accepted = {}
    for r in range(rounds):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            llm = engines[name]
            tok = llm.get_tokenizer()
            prompts = [tok.encode_chat([{"role": "user", "content": f"List {i + 5} people with their name, age, city and membership, as JSON."}])
                       for i in range(clients)]
            params = [SamplingParams(max_tokens=steps, temperature=0, structured=StructuredOutput("json", SCHEMA)) for _ in prompts]
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
            if llm.engine.proposer is not None:
                st = llm.engine.proposer.stats
                accepted[name] = st.num_accepted_tokens / max(1, st.num_draft_tokens)
    base = statistics.median(rates["no speculation for constrained rows"])
    return [{"mode": name, "output tok/s p50": f"{statistics.median(v):.1f}", "vs no speculation": f"{statistics.median(v) / base:.3f}",
             "draft acceptance": f"{accepted[name]:.2f}" if name in accepted else "-"} for name, v in rates.items()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--steps", type=int, default=48, help="output tokens per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--speculation", action="store_true", help="instead: the speculative-decoding choice for constrained rows")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    from kvpilot.server import LLM

    if args.speculation:
        print(f"# bench/structured.py --speculation on {machine()}, {args.threads} threads, greedy, {args.clients} clients")
        rows = speculation_choice(args.clients, args.steps, args.threads, args.rounds)
        print(table(rows, list(rows[0])))
        return

    llm = LLM(num_threads=args.threads, show_progress=False, max_num_seqs=args.clients)
    print(f"# bench/structured.py on {machine()}, {args.threads} threads")
    print("compile, the test corpus of", len(SCHEMAS), "schemas:", {k: round(v, 2) for k, v in compile_times(llm).items()})
    decode_steps(llm, args.clients, 8, True, 0)  # warm-up (both paths)
    decode_steps(llm, args.clients, 8, False, 0)
    steps = {True: [], False: []}
    masks = []
    for r in range(args.rounds):
        for constrained in (r % 2 == 0, r % 2 != 0):
            st, mt = decode_steps(llm, args.clients, args.steps, constrained, 100 * r)
            steps[constrained] += st
            if constrained:
                masks += mt
    plain, guided = statistics.median(steps[False]), statistics.median(steps[True])
    rows = [{"mode": "unconstrained", "steps": len(steps[False]), "step p50 ms": f"{plain * 1e3:.2f}", "mask fill p50 ms": "-",
             "mask apply p50 ms": "-", "speed vs unconstrained": "1.000"},
            {"mode": "every row constrained", "steps": len(steps[True]), "step p50 ms": f"{guided * 1e3:.2f}",
             "mask fill p50 ms": f"{statistics.median(m[0] for m in masks) * 1e3:.3f}",
             "mask apply p50 ms": f"{statistics.median(m[1] for m in masks) * 1e3:.3f}", "speed vs unconstrained": f"{plain / guided:.3f}"}]
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
