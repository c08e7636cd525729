"""CPU thread settings that must be in place before torch is imported. torch-free."""

from __future__ import annotations

import os
import sys

# Idle OpenMP workers sleep (PASSIVE) instead of spinning: on a small shared machine spinning workers
# steal the cores from the HTTP event loop and from other processes. But PASSIVE alone makes a worker
# sleep the moment a parallel region ends and pay a futex wake-up at the start of the next one, and a
# decode step has ~250 of them (projections, attention, RoPE): 20-30% of a step at batch 16. So a
# short bounded spin comes first (GNU OpenMP's unit; 20k pause instructions is well under a
# millisecond): a busy engine's workers stay awake between ops, an idle engine's go to sleep at once.
# The spin only holds while libgomp manages no more threads than CPUs, hence torch on one thread only
# (AsyncEngine.launch). bench/history/ has the measurements; bench/offline.py runs HF under these
# settings too, bench/serve.py gives llama-server its own runtime's defaults.
OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}


def configure_threads(num_threads: int | None) -> int:
    """Pin torch's intra-op threads and set the OpenMP wait policy (OPENMP_ENV).

    The policy is read when the OpenMP runtime loads, i.e. at `import torch`, so this runs before that.
    """
    n = num_threads or os.cpu_count() or 1
    for key, value in OPENMP_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(n)
    return n
