"""Builds (once, into the cache) and loads kvpilot's C++ CPU kernels; `python -m` builds them ahead.

The build is keyed by the sources, torch's version and this CPU's ISA flags (it is compiled with
-march=native), so a warm start only loads the .so. When no compiler is available the engine logs
it and stays on the torch reference path; `require()` (used by tests and `make setup`) fails instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
from functools import lru_cache
from pathlib import Path

log = logging.getLogger("kvpilot.kernels")

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_attention_cpu.cpp", "layers_cpu.cpp", "gguf_linear_cpu.cpp")]
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"]  # -fopenmp: ATen's parallel_for is inline OpenMP (it binds to torch's libgomp at load)


def _cpu_flags() -> str:
    try:
        return next(line for line in open("/proc/cpuinfo") if line.startswith("flags"))
    except (OSError, StopIteration):
        return ""


def build_dir() -> Path:
    import torch

    from kvpilot.server.cache import cache_root

    key = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES) + torch.__version__.encode() + _cpu_flags().encode() + " ".join(CFLAGS).encode())
    return cache_root() / "kernels" / f"cpu-{key.hexdigest()[:16]}"


@lru_cache(maxsize=1)
def require():
    """The compiled module; builds it on first use (about a minute on 2 cores)."""
    from torch.utils import cpp_extension

    path = build_dir()
    path.mkdir(parents=True, exist_ok=True)
    venv_bin = os.path.dirname(sys.executable)  # pip's ninja, when the venv is not activated
    if venv_bin not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    os.environ.setdefault("MAX_JOBS", "2")
    if not list(path.glob("*.so")):
        log.warning("compiling kvpilot's CPU kernels into %s (one-off)", path)
    return cpp_extension.load("kvpilot_cpu_kernels", [str(src) for src in SOURCES], extra_cflags=CFLAGS, build_directory=str(path), verbose=False)


@lru_cache(maxsize=1)
def load():
    """The compiled module, or None (logged once) when it cannot be built here."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        log.warning("no C++ compiler: attention, RoPE and RMSNorm use the torch reference path")
        return None
    try:
        return require()
    except Exception as e:  # a broken toolchain must not take the engine down: the reference path works
        log.warning("CPU kernels failed to build (%s): using the torch reference path", e)
        return None


if __name__ == "__main__":
    print(require().__file__)
