"""The grammar-library comparison behind engine/structured.py's choice: llguidance against xgrammar
(vLLM's and SGLang's default) on the bundled model's tokenizer and the test corpus of JSON schemas.
Per library: building its tokenizer, compiling each schema (cold: a fresh compiler; cached: again),
and filling one token bitmask at each position of the same token walks (one walk per schema, drawn
among the allowed tokens with a fixed seed, replayed through both), all on one thread.

xgrammar is not a dependency of kvpilot: install it beside the test extras to run this
(`.venv/bin/pip install xgrammar`).

    .venv/bin/python bench/grammar_libs.py
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import machine, refuse_if_busy, table  # noqa: E402
from structured_corpus import SCHEMAS  # noqa: E402


def q(values: list[float], p: float) -> float:
    return sorted(values)[min(len(values) - 1, int(p * len(values)))]


def walks(lltok, vocab: int, eos: int, steps: int) -> list[list[int]]:
    """One token walk per schema: random allowed tokens (EOS only when nothing else is allowed)."""
    import llguidance
    import llguidance.torch as lt
    import torch

    from kvpilot.server.engine.structured import JSON_LAYOUT

    rng = random.Random(0)
    shifts = torch.arange(32, dtype=torch.int32)
    out = []
    for _, schema in SCHEMAS:
        m = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT))
        mask = lt.allocate_token_bitmask(1, vocab)
        tokens = []
        while not m.is_stopped() and len(tokens) < steps:
            lt.fill_next_token_bitmask(m, mask, 0)
            allowed = torch.nonzero(((mask[0].unsqueeze(-1) >> shifts) & 1).flatten()[:vocab]).flatten().tolist()
            choices = [t for t in allowed if t != eos] or allowed
            token = rng.choice(choices)
            assert m.consume_token(token), m.get_error()
            tokens.append(token)
        out.append(tokens)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=64, help="longest walk per schema")
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    import llguidance
    import llguidance.torch as lt
    import torch

    try:
        import xgrammar as xgr
    except ImportError:
        sys.exit("bench/grammar_libs.py compares with xgrammar, which kvpilot does not depend on: .venv/bin/pip install xgrammar")
    from transformers import PreTrainedTokenizerFast

    from kvpilot.server.engine.structured import JSON_LAYOUT
    from kvpilot.server.loading import open_model
    from kvpilot.server.model_files import resolve_model_path

    torch.set_num_threads(1)
    weights, tok = open_model(resolve_model_path("smollm2-135m"))
    vocab, eos = weights.config.vocab_size, list(tok.eos_token_ids)
    results = {}

    t = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.backend_json(), n_vocab=vocab, eos_token=eos)
    init = time.perf_counter() - t
    token_walks = walks(lltok, vocab, eos[0], args.steps)
    cold, cached, masks = [], [], []
    cache = {}
    for (_, schema), walk in zip(SCHEMAS, token_walks):
        t = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        pristine = llguidance.LLMatcher(lltok, grammar)
        cold.append(time.perf_counter() - t)
        cache[json.dumps(schema, sort_keys=True)] = pristine
        t = time.perf_counter()
        m = cache[json.dumps(schema, sort_keys=True)].deep_copy()
        cached.append(time.perf_counter() - t)
        mask = lt.allocate_token_bitmask(1, vocab)
        for token in walk:
            t = time.perf_counter()
            lt.fill_next_token_bitmask(m, mask, 0)
            masks.append(time.perf_counter() - t)
            m.consume_token(token)
    results["llguidance"] = (init, cold, cached, masks)

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok._tk), vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    init = time.perf_counter() - t
    cold, cached, masks = [], [], []
    for (_, schema), walk in zip(SCHEMAS, token_walks):
        text = json.dumps(schema)
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(text, any_whitespace=False, separators=(", ", ": "))
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(text, any_whitespace=False, separators=(", ", ": "))
        cached.append(time.perf_counter() - t)
        m = xgr.GrammarMatcher(compiled)
        mask = xgr.allocate_token_bitmask(1, vocab)
        for token in walk:
            t = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            masks.append(time.perf_counter() - t)
            if not m.accept_token(token):
                break  # a walk of the other library's JSON layout: stop comparing this schema here
    results["xgrammar"] = (init, cold, cached, masks)

    print(f"# bench/grammar_libs.py on {machine()}, 1 thread, {len(SCHEMAS)} schemas, {sum(map(len, token_walks))} mask positions")
    rows = []
    for name, (init, cold, cached, masks) in results.items():
        rows.append({"library": name, "tokenizer s": f"{init:.2f}", "compile p50 ms": f"{q(cold, .5) * 1e3:.2f}",
                     "compile p99 ms": f"{q(cold, .99) * 1e3:.1f}", "cached p50 ms": f"{q(cached, .5) * 1e3:.3f}",
                     "mask p50 us": f"{statistics.median(masks) * 1e6:.0f}", "mask p99 us": f"{q(masks, .99) * 1e6:.0f}",
                     "mask positions": len(masks)})
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
