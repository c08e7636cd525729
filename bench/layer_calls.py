"""Single-stream tokens/s with the per-token layers called directly (kernels/direct_call.py) against
the same layers called through nn.Module.__call__ (its hook dispatch), interleaved, each run in a fresh
process of this checkout.

    .venv/bin/python bench/layer_calls.py [--runs 5] [--tokens 256] [--quantization gguf] [--force]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))

from common import machine, refuse_if_busy, table  # noqa: E402


def child(side: str, tokens: int, quantization: str) -> None:
    from kvpilot.server import LLM, SamplingParams

    if side == "module-call":
        from kvpilot.kernels.linear import Linear, RowParallelLinear
        from kvpilot.kernels.quantized import GGUFLinear
        from kvpilot.server.layers.attention import PagedSelfAttention
        from kvpilot.server.layers.mlp import SwiGLU
        from kvpilot.server.layers.rmsnorm import RMSNorm
        from kvpilot.server.models.decoder import DecoderLayer

        for cls in (Linear, RowParallelLinear, GGUFLinear, PagedSelfAttention, SwiGLU, RMSNorm, DecoderLayer):
            del cls.__call__  # back to nn.Module.__call__
    llm = LLM(show_progress=False, num_threads=2, quantization=quantization)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate("Hello there", params)  # warm-up
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        llm.generate("Hello there, tell me a story about a dragon", params)
        best = max(best, tokens / (time.perf_counter() - t))
    print(f"{best:.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5, help="processes per side, alternating")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--quantization", default="gguf")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--child", choices=["direct", "module-call"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.tokens, args.quantization)
    refuse_if_busy(force=args.force)
    rates: dict[str, list[float]] = {"direct": [], "module-call": []}
    for run in range(args.runs):
        for side in (["module-call", "direct"] if run % 2 == 0 else ["direct", "module-call"]):
            out = subprocess.run([sys.executable, __file__, "--child", side, "--tokens", str(args.tokens), "--quantization", args.quantization],
                                 check=True, capture_output=True, text=True).stdout
            rates[side].append(float(out.split()[-1]))
            print(side, rates[side][-1], flush=True)
    print(machine())
    rows = [{"layers called": side, "runs (best of 5 generations each)": " ".join(f"{r:.1f}" for r in values),
             "median tok/s": f"{statistics.median(values):.1f}"} for side, values in rates.items()]
    print(table(rows, list(rows[0])))
    print(f"direct / module-call: {statistics.median(rates['direct']) / statistics.median(rates['module-call']):.3f}x")


if __name__ == "__main__":
    main()
