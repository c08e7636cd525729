"""Where kvpilot keeps big or slow-to-make things between runs (outside the repo): built kernels,
tool binaries, oracle outputs. torch-free."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvpilot"
