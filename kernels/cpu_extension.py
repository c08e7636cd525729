"""Builds (once) and loads kvpilot's C++ CPU kernels; `python -m` builds them ahead.

Portable by instruction-set level, chosen at run time: the sources are compiled for one of the x86-64
micro-architecture levels (v4: AVX-512, v3: AVX2 + FMA, v2: SSE4.2), each build its own module, and
the engine loads the highest level this CPU supports (`KVPILOT_CPU_ISA` picks a lower one). A build
is keyed by the sources, torch's version and the level — never by the host's CPU flags — so kernels
compiled on one machine (an image build: `--all --into DIR`, found through `KVPILOT_KERNELS_DIR`)
are loaded as they are on any other, and a warm start only imports the .so. gguf_linear additionally
dispatches AVX-512 / AVX2 / scalar inside every build (target attributes), so it is fast on v2 too.

With no prebuilt module and no compiler the engine logs it and stays on the torch reference path;
`require()` (used by tests and `make setup`) fails instead.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
from functools import cache, lru_cache
from pathlib import Path

log = logging.getLogger("kvpilot.kernels")

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_attention_cpu.cpp", "layers_cpu.cpp", "gguf_linear_cpu.cpp", "moe_cpu.cpp", "bf16_linear_cpu.cpp")]
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))  # part of the build key, not compiled alone
# -fopenmp: ATen's parallel_for is inline OpenMP (it binds to torch's libgomp at load)
CFLAGS = ["-O3", "-fopenmp", "-fno-trapping-math"]

# The /proc/cpuinfo flags each level adds to the one below (the x86-64 psABI's levels; abm = LZCNT).
_LEVEL_FLAGS = {
    "x86-64-v2": {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"},
    "x86-64-v3": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"},
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}
X86_LEVELS = list(_LEVEL_FLAGS)  # lowest first
GENERIC = "generic"  # not x86-64: the compiler's default target
PREBUILT_ENV = "KVPILOT_KERNELS_DIR"
LEVEL_ENV = "KVPILOT_CPU_ISA"


def _cpu_flags() -> set[str]:
    try:
        return set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration, IndexError):
        return set()


def supported_levels() -> list[str]:
    """The levels this machine can run, lowest first."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return [GENERIC]
    flags, have, out = _cpu_flags(), set(), []
    for level, needs in _LEVEL_FLAGS.items():
        have |= needs
        if not have <= flags:
            break
        out.append(level)
    return out or ["x86-64"]  # the psABI baseline (SSE2) every x86-64 has


def level() -> str:
    """The level to load: the highest this CPU supports, or KVPILOT_CPU_ISA's (which it must support)."""
    here = supported_levels()
    wanted = os.environ.get(LEVEL_ENV)
    if not wanted:
        return here[-1]
    if wanted not in here:
        raise RuntimeError(f"{LEVEL_ENV}={wanted!r}: this CPU runs {', '.join(here)}")
    return wanted


def _march(lvl: str) -> list[str]:
    return [] if lvl == GENERIC else [f"-march={lvl}", "-mtune=generic"]


def module_name(lvl: str) -> str:
    return "kvpilot_cpu_kernels_" + lvl.replace("-", "_")


def build_key(lvl: str) -> str:
    import torch

    flags = " ".join(CFLAGS + _march(lvl))
    key = hashlib.sha256(b"".join(src.read_bytes() for src in [*SOURCES, *HEADERS]) + torch.__version__.encode() + flags.encode())
    return f"cpu-{lvl}-{key.hexdigest()[:16]}"


def build_dir(lvl: str | None = None) -> Path:
    from kvpilot.kernels.cache import cache_root

    return cache_root() / "kernels" / build_key(lvl or level())


def _built(directory: Path, lvl: str) -> Path | None:
    so = directory / f"{module_name(lvl)}.so"
    return so if so.is_file() else None


def _import(so: Path, lvl: str):
    import torch  # noqa: F401  (the module links against libtorch: load it first)

    spec = importlib.util.spec_from_file_location(module_name(lvl), so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.isa_level = lvl
    return module


def build(lvl: str, directory: Path):
    """Compiles the kernels for `lvl` into `directory` (about a minute on 2 cores) and imports them."""
    from torch.utils import cpp_extension

    directory.mkdir(parents=True, exist_ok=True)
    venv_bin = os.path.dirname(sys.executable)  # pip's ninja, when the venv is not activated
    if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    os.environ.setdefault("MAX_JOBS", "2")
    log.warning("compiling kvpilot's CPU kernels for %s into %s (one-off)", lvl, directory)
    module = cpp_extension.load(module_name(lvl), [str(src) for src in SOURCES], extra_cflags=CFLAGS + _march(lvl),
                                build_directory=str(directory), verbose=False)
    module.isa_level = lvl
    return module


def find_prebuilt(lvl: str) -> Path | None:
    """An already-compiled module for `lvl`: the image's (KVPILOT_KERNELS_DIR), else this cache's."""
    dirs = [Path(os.environ[PREBUILT_ENV]) / build_key(lvl)] if os.environ.get(PREBUILT_ENV) else []
    return next((so for d in dirs + [build_dir(lvl)] if (so := _built(d, lvl))), None)


def require(lvl: str | None = None):
    """The compiled module for `lvl` (default: `level()`), built on first use when none is found."""
    return _require(lvl or level())


@cache
def _require(lvl: str):
    so = find_prebuilt(lvl)
    if so is not None:
        module = _import(so, lvl)
        log.info("CPU kernels: %s, %s", lvl, so)
        return module
    return build(lvl, build_dir(lvl))


@lru_cache(maxsize=1)
def load():
    """The compiled module, or None (logged once) when there is none and it cannot be built here."""
    try:
        lvl = level()
        if find_prebuilt(lvl) is None and shutil.which("c++") is None and shutil.which("g++") is None:
            log.warning("no C++ compiler and no prebuilt kernels: attention, RoPE and RMSNorm use the torch reference path")
            return None
        return require(lvl)
    except Exception as e:  # a broken toolchain must not take the engine down: the reference path works
        log.warning("CPU kernels unavailable (%s): using the torch reference path", e)
        return None


def check(lvl: str | None = None) -> dict:
    """Loads (or builds) the kernels for `lvl` and runs each against its torch reference on random
    inputs: what an image's kernels do on this CPU. Returns the level, the module's file and each
    kernel's largest absolute difference."""
    import torch

    from kvpilot.kernels.paged_attention import FP8_KV, decode_attention_grouped

    module = require(lvl)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 576, generator=gen), torch.randn(576, generator=gen)
    rms_ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    heads, kv_heads, head_dim, block_size, lens = 9, 3, 64, 16, [300, 17, 45]
    k_cache = torch.randn(64, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(64, block_size, kv_heads, head_dim, generator=gen)
    tables = torch.randperm(64, generator=gen)[: 3 * 19].view(3, 19)
    q = torch.randn(3, heads, head_dim, generator=gen)
    attention = (q, k_cache, v_cache, tables, torch.tensor(lens), head_dim ** -0.5)
    fp8 = (q, k_cache.to(FP8_KV), v_cache.to(FP8_KV), *attention[3:])
    q5 = torch.randn(5, heads, head_dim, generator=gen)
    errors = {"rms_norm": (module.rms_norm(x, w, 1e-5) - rms_ref).abs().max().item(),
              "paged_decode_attention": (module.paged_decode_attention(*attention) - decode_attention_grouped(*attention)).abs().max().item(),
              "paged_decode_attention_fp8": (module.paged_decode_attention(*fp8, 0.5, 2.0) - decode_attention_grouped(*fp8, (0.5, 2.0))).abs().max().item(),
              # the last 5 of sequence 0's 300 tokens as new ones, attending causally over the cache
              "paged_prefill_attention": max((module.paged_prefill_attention(q5, k_cache, v_cache, tables[0], 300, head_dim ** -0.5)[i] -
                                              decode_attention_grouped(q5[i:i + 1], k_cache, v_cache, tables[:1], torch.tensor([296 + i]),
                                                                       head_dim ** -0.5)[0]).abs().max().item() for i in range(5))}
    return {"level": module.isa_level, "file": module.__file__, "gguf_linear_isa": module.gguf_linear_isa(), "max_abs_error": errors}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvpilot.kernels.cpu_extension",
                                 description="build the CPU kernels for this CPU's level (default) or for every level")
    ap.add_argument("--all", action="store_true", help="every x86-64 level (an image build: portable to any x86-64 CPU)")
    ap.add_argument("--level", choices=X86_LEVELS + [GENERIC], help="only this level (even one this CPU cannot run)")
    ap.add_argument("--into", type=Path, help="directory to build into (default: the cache); point KVPILOT_KERNELS_DIR at it")
    ap.add_argument("--check", action="store_true", help="load this CPU's level (or KVPILOT_CPU_ISA's) and compare each kernel "
                                                         "with its torch reference; prints JSON, exits 1 on a mismatch")
    args = ap.parse_args(argv)
    if args.check:
        report = check()
        print(json.dumps(report))
        return 0 if max(report["max_abs_error"].values()) < 1e-4 else 1
    levels = [args.level] if args.level else X86_LEVELS if args.all else [level()]
    for lvl in levels:
        target = (args.into / build_key(lvl)) if args.into else build_dir(lvl)
        if not _built(target, lvl):
            if lvl in supported_levels() or args.level:
                build(lvl, target)
            else:  # cpp_extension imports what it built, which this CPU may not run: build in a child, keep the file
                subprocess.run([sys.executable, __file__, "--level", lvl, "--into", str(target.parent)], check=False)
        so = _built(target, lvl)
        if so is None:
            print(f"{lvl}: build failed", file=sys.stderr)
            return 1
        print(f"{lvl}: {so}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
