"""Speculative decoding: tok/s with and without it, same engine settings, one run, interleaved.

    .venv/bin/python bench/spec.py [--force] [--rounds 3] [--draft-layers 8] [--threads N] [--quantization gguf]
                                   [--eagle-head DIR] [--eagle-tokens 1,2,3] [--engines plain,ngram,eagle3,eagle3-lookup]
                                   [--tensor-parallel-size 3] [--json bench/results/spec.json]

Engines: plain decoding, n-gram prompt lookup, a draft model (the bundled model cut to its first
--draft-layers blocks by `kvpilot make-draft`; a truncated model is a weak draft, so this measures the
machinery and its cost more than what a trained small draft would give), and with --eagle-head an
EAGLE-3 head (e.g. one `kvpilot train-eagle` wrote), alone (eagle3) and after n-gram lookup
(eagle3-lookup: --speculative-lookup, lookups of up to 4 tokens). The default off-switch
applies (speculative_disable_batch_size, speculative_min_acceptance), as a user would run it.

Workloads, greedy (temperature 0), chat-formatted prompts:
  copy    single stream: repeat or edit a given passage, code with repeated identifiers
  chat    single stream: ordinary questions
  16x     16 requests at once (copy + chat prompts), as 16 concurrent clients
Per engine and workload: output tok/s (median over rounds), ratio to plain, the share of decode
steps that verified a proposal, and the acceptance rate (accepted / proposed tokens).

--tensor-parallel-size N > 1: every engine over N ranks (one thread each), built one at a time (one
tensor-parallel engine per process), its rounds run, then closed: the engines are not interleaved. The
draft model is split over the ranks (draft) or whole on rank 0 (draft-whole).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import machine, refuse_if_busy, save_results, table  # noqa: E402

PASSAGE = ("The committee met on Tuesday to review the annual budget. After a long discussion, the members agreed "
           "to increase funding for the public library by ten percent, to repair the bridge on Mill Street before "
           "winter, and to postpone the new parking garage until the traffic study is complete.")
CODE = '''def load_users(path):
    users = []
    with open(path) as handle:
        for line in handle:
            name, email, age = line.strip().split(",")
            users.append({"name": name, "email": email, "age": int(age)})
    return users
'''
COPY = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite this text, replacing 'Tuesday' with 'Friday' and keeping everything else the same:\n\n{PASSAGE}",
    f"Add a docstring to this function and return the whole function:\n\n```python\n{CODE}```",
    f"Rename the variable 'users' to 'people' in this code and show the full result:\n\n```python\n{CODE}```",
]
CHAT = [
    "What are three good habits for staying healthy?",
    "Explain why the sky is blue in a short paragraph.",
    "Give me a short story idea about a lighthouse keeper.",
    "What is the difference between weather and climate?",
]


LOOKUP_TOKENS = 4  # eagle3-lookup: a lookup proposes as many as ngram's (its default k), the head its --eagle-tokens


def engines(threads: int, draft_layers: int, workdir: Path, quantization: str, eagle_head: str | None, wanted: list[str] | None,
            eagle_tokens: list[int], tensor_parallel_size: int = 1) -> dict:
    """name -> a function that builds that engine."""
    from kvpilot.server.config import EngineConfig
    from kvpilot.server.engine.llm_engine import LLMEngine
    from kvpilot.server.gguf_loader import write_truncated
    from kvpilot.server.model_files import resolve_model_path

    draft = write_truncated(resolve_model_path("smollm2-135m"), workdir / f"draft{draft_layers}.gguf", draft_layers)
    base = dict(num_threads=threads, kv_cache_memory="512MiB", quantization=quantization, tensor_parallel_size=tensor_parallel_size)
    configs = {"plain": {}, "ngram": dict(speculative_method="ngram"),
               "draft": dict(speculative_method="draft", speculative_model=str(draft))}
    if tensor_parallel_size > 1:  # draft: split over the ranks (it fits as the target does); draft-whole: whole on rank 0
        configs["draft-whole"] = dict(configs["draft"], speculative_draft_tensor_parallel_size=1)
    families = {}  # eagle3: the head alone; eagle3-lookup: n-gram lookup first, the head for the rest (speculative_lookup)
    if eagle_head:
        for family, lookup in (("eagle3", False), ("eagle3-lookup", True)):
            families[family] = [family if len(eagle_tokens) == 1 else f"{family}-k{k}" for k in eagle_tokens]
            for name, k in zip(families[family], eagle_tokens):
                configs[name] = dict(speculative_method="eagle3", speculative_model=eagle_head, num_speculative_tokens=k, speculative_lookup=lookup,
                                     speculative_lookup_tokens=LOOKUP_TOKENS if lookup else None)
    if wanted:  # a family: every one of its -kN engines
        wanted = [name for w in wanted for name in families.get(w, [w])]
    unknown = set(wanted or ()) - set(configs)
    if unknown:
        raise SystemExit(f"--engines: {', '.join(sorted(unknown))} unknown here (have: {', '.join(configs)}; eagle3 and eagle3-lookup need --eagle-head)")
    return {name: (lambda kw=kw: LLMEngine(EngineConfig(**base, **kw), show_progress=False)) for name, kw in configs.items() if not wanted or name in wanted}


def run(engine, prompts: list[str], concurrent: bool, max_tokens: int) -> tuple[int, float]:
    """(output tokens, seconds): one prompt at a time, or all at once."""
    from kvpilot.server.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    texts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    tokens, t = 0, time.perf_counter()
    for group in ([texts] if concurrent else [[x] for x in texts]):
        for x in group:
            engine.add_request(x, params)
        while engine.has_unfinished_requests():
            tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return tokens, time.perf_counter() - t


def counters(engine) -> tuple[int, ...]:
    """Steps, steps speculating, tokens proposed and accepted, proposals, accepted by position; with lookup
    first, then the looked-up proposals' own count and accepted by position (the rest are the model's)."""
    s = engine.proposer.stats if engine.proposer else None
    if s is None:
        return (0,) * 5
    lookup = (s.lookup.num_drafts, *s.lookup.accepted_per_pos) if s.lookup else ()
    return (s.num_steps, s.num_spec_steps, s.num_draft_tokens, s.num_accepted_tokens, s.num_drafts, *s.accepted_per_pos, *lookup)


def by_position(proposals: int, accepted: list[int]) -> str:
    """The share of proposals whose token i was accepted (i = 0, 1, …)."""
    return " ".join(f"{a / proposals:.2f}" for a in accepted) if proposals else "-"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--draft-layers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--quantization", default="none", help="the model's weights (gguf: the GGUF's own blocks)")
    ap.add_argument("--eagle-head", help="an EAGLE-3 head's directory: adds the eagle3 and eagle3-lookup engines")
    ap.add_argument("--eagle-tokens", default="3", help="tokens the head proposes per step; several (1,2,3): one engine each, eagle3-kN")
    ap.add_argument("--engines", help="comma-separated subset of plain,ngram,draft,draft-whole (tensor parallelism),eagle3,eagle3-lookup (plain always)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks of every engine (one thread each; engines run one after another)")
    ap.add_argument("--json", help="write the table's rows here too (bench/results/: make plots draws them)")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    workloads = {"copy": (COPY, False), "chat": (CHAT, False), "16x": ((COPY + CHAT) * 2, True)}
    tp = args.tensor_parallel_size
    with tempfile.TemporaryDirectory() as tmp:
        wanted = ["plain", *args.engines.split(",")] if args.engines else None
        makers = engines(1 if tp > 1 else args.threads, args.draft_layers, Path(tmp), args.quantization, args.eagle_head, wanted,
                         [int(k) for k in args.eagle_tokens.split(",")], tp)
        rates: dict[tuple[str, str], list[float]] = {}
        spec: dict[tuple[str, str], list[int]] = {}
        names = list(makers)
        proposers, configs = {}, {}

        def measure(name: str, engine, w: str) -> None:
            prompts, concurrent = workloads[w]
            before = counters(engine)
            tokens, dt = run(engine, prompts, concurrent, args.max_tokens)
            rates.setdefault((name, w), []).append(tokens / dt)
            delta = [a - b for a, b in zip(counters(engine), before)]
            spec[(name, w)] = [x + y for x, y in zip(spec.get((name, w), [0] * len(delta)), delta)]

        if tp > 1:  # one engine at a time: all its rounds, then closed
            for name in names:
                engine = makers[name]()
                run(engine, CHAT[:1], False, 8)  # warm-up
                for _ in range(args.rounds):
                    for w in workloads:
                        measure(name, engine, w)
                proposers[name], configs[name] = engine.proposer, engine.config
                engine.close()
        else:
            eng = {name: make() for name, make in makers.items()}
            for e in eng.values():
                run(e, CHAT[:1], False, 8)  # warm-up
            for r in range(args.rounds):
                for w in workloads:
                    for name in names[r % len(names):] + names[:r % len(names)]:  # a rotating order
                        measure(name, eng[name], w)
            proposers = {name: e.proposer for name, e in eng.items()}
            configs = {name: e.config for name, e in eng.items()}
    rows = []
    for w in workloads:
        plain = statistics.median(rates[("plain", w)])
        for name in names:
            tput = statistics.median(rates[(name, w)])
            steps, spec_steps, drafted, accepted, proposals, *per_pos = spec[(name, w)]
            positions = by_position(proposals, per_pos) if proposals else ""
            stats = proposers[name].stats if proposers[name] else None
            if stats is not None and stats.lookup is not None and proposals:  # each source's own: the model's drafts, then the lookups
                k = len(stats.accepted_per_pos)
                per_pos, looked_up, lookup_pos = per_pos[:k], per_pos[k], per_pos[k + 1:]
                drafted_pos = [a - b for a, b in zip(per_pos, lookup_pos)][:configs[name].num_speculative_tokens]
                positions = f"head {by_position(proposals - looked_up, drafted_pos)}; lookup {by_position(looked_up, lookup_pos)}"
            rows.append({"workload": w, "engine": name, "output tok/s": f"{tput:.1f}", "vs plain": f"{tput / plain:.2f}x",
                         "steps speculating": f"{spec_steps / steps:.0%}" if steps else "",
                         "acceptance": f"{accepted / drafted:.0%} of {drafted}" if drafted else "",
                         "accepted by position": positions})
    threads = f"{tp} ranks of 1 thread" if tp > 1 else f"threads {args.threads}"
    print(f"machine: {machine()}; {threads}; quantization {args.quantization}; rounds {args.rounds} (median); max_tokens {args.max_tokens}")
    print(table(rows, ["workload", "engine", "output tok/s", "vs plain", "steps speculating", "acceptance", "accepted by position"]))
    if args.json:
        save_results(args.json, results=rows, quantization=args.quantization, rounds=args.rounds, max_tokens=args.max_tokens,
                     ranks=tp, threads=1 if tp > 1 else args.threads)


if __name__ == "__main__":
    main()
