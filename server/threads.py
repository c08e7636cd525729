"""CPU thread settings that must be in place before torch is imported. torch-free."""

from __future__ import annotations

import os
import sys


def configure_threads(num_threads: int | None) -> int:
    """Pin torch's intra-op threads and make idle OpenMP threads sleep instead of spinning.

    On a small shared machine, spinning OpenMP workers (the default) steal the cores from the HTTP
    event loop and from other processes; a small matvec then runs many times slower. The policy is
    read when the OpenMP runtime loads, i.e. at `import torch`, so this runs before that.
    """
    n = num_threads or os.cpu_count() or 1
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    if "torch" in sys.modules:
        import torch

        torch.set_num_threads(n)
    return n
