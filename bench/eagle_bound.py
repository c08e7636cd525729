"""What bounds an EAGLE-3 head's speed-up: its accuracy on the text served, or the engine?

    .venv/bin/python bench/eagle_bound.py --eagle-head DIR [--quantization gguf] [--rounds 3] [--force]

For a head `kvpilot train-eagle` wrote (its TRAINING.json names the templated prompts it learned from),
three prompt sets of the same kind, greedy, single stream, 160 tokens:
  chat    bench/spec.py's chat prompts (written apart from the training list)
  unseen  templated prompts of the training list's own templates that the head never saw
  seen    prompts the head was trained on (its answers memorised, as far as the head could)
Per set: the head's top-1…8 accuracy over the target's greedy answer, teacher-forced (the target's
hidden states of the whole text, read in one pass: what training measures), the engine's first-draft
acceptance over the same answers (equal to top-1 unless serving feeds the head other inputs than
training did), and tok/s of plain decoding and of eagle3 drafting 1 and 2 tokens (median of rounds,
interleaved). Top-k accuracy bounds what a tree of k candidates at the first position could accept.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import machine, refuse_if_busy, table  # noqa: E402
from spec import CHAT, counters, engines, run  # noqa: E402

TOP = 8
MAX_TOKENS = 160


def prompt_sets(head_dir: str, count: int = 6) -> dict[str, list[str]]:
    """The three sets (see the module's doc), `count` prompts each but chat's four; no copy prompts."""
    from kvpilot.server.eagle_training import COPY_TEMPLATES, prompt_pool, training_prompts

    made = json.loads((Path(head_dir) / "TRAINING.json").read_text())
    seed = int(made["command"].split("--seed ")[1].split()[0])
    every = training_prompts(len(prompt_pool()), seed)  # the same shuffle: its first `prompts` were the training list
    learned = set(every[:made["prompts"]])
    chat_like = [p for p in every if not p.startswith(tuple(t.split("{")[0] for t in COPY_TEMPLATES))]
    rng = random.Random(5)
    return {"chat": CHAT, "unseen": rng.sample([p for p in chat_like if p not in learned], count),
            "seen": rng.sample([p for p in chat_like if p in learned], count)}


def accuracy(engine, prompts: list[str]) -> tuple[list[float], float, int]:
    """(top-1…TOP accuracy of the head teacher-forced, the engine's first-draft acceptance, positions)
    over the target's greedy answers to `prompts` (the engine drafts one token per step)."""
    import torch

    from kvpilot.server.engine.sampling_params import SamplingParams

    runner, head = engine.worker, engine.worker.drafter.head
    hits, total = [0] * TOP, 0
    before = counters(engine)
    for prompt in prompts:
        engine.add_request(engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]),
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
        finished = []
        while engine.has_unfinished_requests():
            finished += [o for o in engine.step() if o.finished]
        out = finished[0]
        ids, start = list(out.prompt_token_ids) + list(out.outputs[0].token_ids), len(out.prompt_token_ids)
        n = len(ids)
        meta = runner.one_prefill(n)
        with torch.inference_mode():
            hidden, aux = runner.model(torch.tensor(ids), torch.arange(n), runner.kv_caches, meta)  # (the head declared this aux output)
            choice = runner.model.compute_logits(hidden).argmax(-1)
            # row p takes the token at p + 1 and drafts the target's choice after it (the engine's rows)
            normed, _ = head(torch.tensor(ids[1:] + [0]), torch.arange(n), head.fc(aux), engine.worker.drafter.kv_cache, meta)
            top = head.logits(normed).topk(TOP, dim=-1).indices
        for p in range(start - 1, n - 2):  # every draft after the answer's first token (the target samples that one)
            total += 1
            found = (top[p] == choice[p + 1]).nonzero()
            for k in range(int(found[0]) if len(found) else TOP, TOP):
                hits[k] += 1
    delta = [a - b for a, b in zip(counters(engine), before)]
    return [h / total for h in hits], delta[3] / max(delta[2], 1), total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--eagle-head", required=True, help="a head kvpilot train-eagle wrote (its TRAINING.json is read)")
    ap.add_argument("--quantization", default="gguf")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    sets = prompt_sets(args.eagle_head)
    with tempfile.TemporaryDirectory() as tmp:
        eng = engines(args.threads, 8, Path(tmp), args.quantization, args.eagle_head, ["plain", "eagle3"], [1, 2])
        rows = []
        for name, prompts in sets.items():
            top, accepted, positions = accuracy(eng["eagle3-k1"], prompts)
            rows.append({"prompts": name, "positions": positions, "engine's first-draft acceptance": f"{accepted:.3f}",
                         "head top-1 … top-8 (teacher-forced)": " ".join(f"{a:.3f}" for a in top)})
        print(table(rows, list(rows[0])))
        for e in eng.values():
            run(e, CHAT[:1], False, 8)  # warm-up
        rates: dict[tuple[str, str], list[float]] = {}
        names = list(eng)
        for r in range(args.rounds):
            for w, prompts in sets.items():
                for name in names[r % len(names):] + names[:r % len(names)]:
                    tokens, dt = run(eng[name], prompts, False, MAX_TOKENS)
                    rates.setdefault((w, name), []).append(tokens / dt)
        rows = []
        for w in sets:
            plain = statistics.median(rates[(w, "plain")])
            rows += [{"prompts": w, "engine": n, "output tok/s": f"{statistics.median(rates[(w, n)]):.1f}",
                      "vs plain": f"{statistics.median(rates[(w, n)]) / plain:.2f}x"} for n in names]
    print(f"machine: {machine()}; threads {args.threads}; quantization {args.quantization}; rounds {args.rounds} (median)")
    print(table(rows, ["prompts", "engine", "output tok/s", "vs plain"]))
    for w, prompts in sets.items():
        print(f"{w}: " + " | ".join(prompts))


if __name__ == "__main__":
    main()
