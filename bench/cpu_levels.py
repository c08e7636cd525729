"""The C++ CPU kernels per x86-64 level (what an image ships) against a -march=native build of the
same sources (what `make setup` used to compile), in one run, one thread.

    .venv/bin/python bench/cpu_levels.py [--force]

Kernels at decode shapes of the bundled model: paged decode attention (16 sequences, contexts
200–450, 9 query / 3 KV heads, head_dim 64, block 16) and RMSNorm (16 rows of 576). Each figure is
the best of 5 rounds. Levels this CPU cannot run are left out.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from common import best_us, machine, refuse_if_busy, table  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

from kvpilot.kernels import cpu_extension  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    batch, heads, kv_heads, head_dim, block = 16, 9, 3, 64, 16
    lens = torch.randint(200, 450, (batch,), generator=g)
    blocks = int(sum((n + block - 1) // block for n in lens)) + 8
    k_cache, v_cache = (torch.randn(blocks, block, kv_heads, head_dim, generator=g) for _ in range(2))
    tables = torch.randint(0, blocks, (batch, 30), generator=g)
    q = torch.randn(batch, heads, head_dim, generator=g)
    x, w = torch.randn(16, 576, generator=g), torch.randn(576, generator=g)

    modules = {lvl: cpu_extension.require(lvl) for lvl in cpu_extension.supported_levels()}
    with tempfile.TemporaryDirectory() as scratch:
        modules["-march=native"] = cpp_extension.load("kvpilot_cpu_kernels_native", [str(s) for s in cpu_extension.SOURCES],
                                                      extra_cflags=cpu_extension.CFLAGS + ["-march=native"],
                                                      build_directory=str(Path(scratch)), verbose=False)
        rows = []
        for name, m in modules.items():
            rows.append({"build": name,
                         "attention µs": best_us(lambda m=m: m.paged_decode_attention(q, k_cache, v_cache, tables, lens, head_dim ** -0.5), 200),
                         "rms_norm µs": best_us(lambda m=m: m.rms_norm(x, w, 1e-5), 2000)})
    native = rows[-1]
    for r in rows:
        r["attention vs native"] = f"{native['attention µs'] / r['attention µs']:.2f}x"
        r["attention µs"], r["rms_norm µs"] = f"{r['attention µs']:.0f}", f"{r['rms_norm µs']:.2f}"
    print(machine())
    print(table(rows, ["build", "attention µs", "attention vs native", "rms_norm µs"]))


if __name__ == "__main__":
    main()
