"""Shared benchmark helpers: busy-machine guard, per-call benchmarks' arguments, workload, machine peak, per-call timing, result table."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path


def refuse_if_busy(max_load: float = 0.8, force: bool = False) -> None:
    """Numbers from a busy machine are noise: refuse (and say so) unless forced."""
    load1 = os.getloadavg()[0]
    if load1 > max_load and not force:
        sys.exit(f"bench: refusing to run, the 1-minute load average is {load1:.2f} (> {max_load}); "
                 "wait for the machine to be idle or pass --force")


def per_call_args(default_rows: str) -> argparse.Namespace:
    """The per-call kernel benchmarks' command line (--rows, --threads, --force), the busy guard applied
    and torch's thread count set; `rows` comes back as a list of ints."""
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default=default_rows, help="activation rows per call, comma-separated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    torch.set_num_threads(args.threads)
    args.rows = [int(r) for r in args.rows.split(",")]
    return args


def offline_workload(n: int = 64, seed: int = 0, vocab: int = 49152, prompt=(32, 512), output=(32, 256)):
    """nano-vllm's protocol scaled down: random token prompts and output lengths, fixed seed."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(*prompt))] for _ in range(n)]
    outputs = [rng.randint(*output) for _ in range(n)]
    return prompts, outputs


def matmul_peak_gflops(threads: int, size: int = 1024, reps: int = 20) -> float:
    """Best fp32 matmul rate of this machine: the faster of torch's default (MKL) and oneDNN with a
    packed weight (the path the engine uses on CPU), so "of peak" is never flattered by a slow BLAS."""
    import torch

    from kvpilot.kernels.linear import make_linear

    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    packed = make_linear(b.T.contiguous())
    best = 0.0
    for fn in (lambda: a @ b, lambda: packed(a)):
        for _ in range(3):
            fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = max(best, 2 * size**3 * reps / (time.perf_counter() - t) / 1e9)
    return best


def best_us(fn, n: int, rounds: int = 5) -> float:
    """µs per call of fn: the best of `rounds` timings of n back-to-back calls, after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    return best


def machine() -> str:
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor()
    return f"{os.cpu_count()} cores, {cpu}, Python {platform.python_version()}"


def isa() -> str:
    """The CPU's vector instruction sets that decide kvpilot's and its peers' kernels, from /proc/cpuinfo's
    flags: e.g. "AVX-512 (VNNI, BF16, FP16), no AMX"."""
    from kvpilot.kernels.cpu_extension import _cpu_flags  # (the flags the kernels' build level is chosen by)

    flags = _cpu_flags()
    if not flags:
        return "ISA unknown"
    if "avx512f" not in flags:
        return "AVX2 (no AVX-512)" if "avx2" in flags else "no AVX2"
    extras = [name for flag, name in (("avx512_vnni", "VNNI"), ("avx512_bf16", "BF16"), ("avx512_fp16", "FP16")) if flag in flags]
    amx = [name for flag, name in (("amx_bf16", "BF16"), ("amx_int8", "INT8")) if flag in flags]
    return "AVX-512" + (f" ({', '.join(extras)})" if extras else "") + (f", AMX ({', '.join(amx)})" if amx else ", no AMX")


def save_results(path: str | Path, command: str | None = None, **fields) -> None:
    """A run's figures as JSON (what bench/results/ keeps and bench/plots.py draws): the command (this
    script's, by default), when (UTC), the machine with its ISA, and `fields`."""
    command = command or " ".join([".venv/bin/python", os.path.relpath(sys.argv[0], Path(__file__).resolve().parents[1]), *sys.argv[1:]])
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"command": command, "when": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
                                      "machine": f"{machine()}, {isa()}", **fields}, indent=1) + "\n")


def table(rows: list[dict], cols: list[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols}
    line = "| " + " | ".join(c.ljust(widths[c]) for c in cols) + " |"
    sep = "|" + "|".join("-" * (widths[c] + 2) for c in cols) + "|"
    body = ["| " + " | ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) + " |" for r in rows]
    return "\n".join([line, sep, *body])
