"""Quality of each weight format against fp32 on the bundled model: mean KL(fp32 ‖ mode) of the
next-token distributions over a fixed text, how often the two argmax tokens agree there, and greedy
generation agreement (64 tokens from each of the HF-oracle prompts: identical continuations, and the
mean position of the first difference).

    .venv/bin/python bench/quant_quality.py [--modes gguf,int8,int4] [--groups 32,64,128] [--json bench/results/quant-quality.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from oracle import ORACLE_PROMPTS  # noqa: E402  (the fixed prompts of the HF-equivalence tests)

TEXT = "\n\n".join(ORACLE_PROMPTS)


def measure(llm, reference_logits: torch.Tensor | None, reference_tokens: list[list[int]] | None) -> tuple[torch.Tensor, list[list[int]], dict]:
    from kvpilot.server import SamplingParams

    runner = llm.engine.worker
    ids = llm.get_tokenizer().encode(TEXT)
    logits = runner.score(ids)
    outs = llm.generate(ORACLE_PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    tokens = [o.outputs[0].token_ids for o in outs]
    if reference_logits is None:
        return logits, tokens, {}
    p = torch.log_softmax(reference_logits, -1)
    q = torch.log_softmax(logits, -1)
    kl = (p.exp() * (p - q)).sum(-1)
    first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(reference_tokens, tokens)]
    return logits, tokens, {"mean KL": kl.mean().item(), "max KL": kl.max().item(),
                            "argmax agreement": (logits.argmax(-1) == reference_logits.argmax(-1)).float().mean().item(),
                            "identical continuations": sum(d == 64 for d in first_diff), "mean first difference": sum(first_diff) / len(first_diff),
                            "weights MiB": runner.model.weight_bytes() / 2**20, "positions": len(ids)}


def main() -> None:
    from kvpilot.server import LLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="gguf,int8,int4")
    ap.add_argument("--groups", default="32,64,128", help="int4 group sizes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the table's figures here too (bench/results/: make plots draws them)")
    args = ap.parse_args()
    common = dict(num_threads=args.threads, show_progress=False, kv_cache_memory="64MiB")
    ref_logits, ref_tokens, _ = measure(LLM(**common), None, None)
    runs = []
    for mode in args.modes.split(","):
        for group in ([int(g) for g in args.groups.split(",")] if mode == "int4" else [None]):
            extra = {"quantization_group_size": group} if group else {}
            _, _, stats = measure(LLM(quantization=mode, **common, **extra), ref_logits, ref_tokens)
            runs.append((f"{mode}" + (f" g{group}" if group else ""), stats))
    print(f"text: the {len(ORACLE_PROMPTS)} oracle prompts joined, {runs[0][1]['positions']} positions; generation: 64 greedy tokens per prompt")
    print("| mode | weights MiB | mean KL vs fp32 | max KL | argmax agreement | identical continuations (of 10) | mean first difference |")
    print("|---|---|---|---|---|---|---|")
    for name, s in runs:
        print(f"| {name} | {s['weights MiB']:.0f} | {s['mean KL']:.2e} | {s['max KL']:.2e} | {s['argmax agreement']:.3f} | "
              f"{s['identical continuations']} | {s['mean first difference']:.1f} |")
    if args.json:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from common import save_results

        save_results(args.json, prompts=len(ORACLE_PROMPTS), positions=runs[0][1]["positions"], generated_tokens=64,
                     results=[{"mode": name, **s} for name, s in runs])


if __name__ == "__main__":
    main()
