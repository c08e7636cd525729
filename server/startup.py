"""When this process started and how far its start-up got: the engine's side of a cold start.

Marks are wall-clock times (so that the operator can line them up with the pod's own timestamps),
set once each, in order: the engine's construction began (`engine_init`: imports done), weights
loaded and the KV cache allocated (`loaded`), decode graphs captured and the grammar compiler ready
(`warm`), the HTTP server listening (`listening`). /metrics exports the phases between them
(docs/observability.md); the operator reads them when the pod turns Ready (docs/model-cache.md).
"""

from __future__ import annotations

import functools
import os
import time

MARKS = ("engine_init", "loaded", "warm", "listening")
PHASES = {"import": ("process_start", "engine_init"), "load": ("engine_init", "loaded"), "warmup": ("loaded", "warm"),
          "listen": ("warm", "listening")}
_marks: dict[str, float] = {}


@functools.cache  # read once: every /metrics scrape asks
def process_start_time() -> float:
    """This process's start (epoch seconds) from /proc; the time of the first call elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            ticks_after_boot = float(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks_after_boot / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def mark(name: str) -> None:
    """Record `name` now, the first time only (a process may build engines again: tests do)."""
    if name not in MARKS:
        raise ValueError(f"unknown start-up mark {name!r}")
    _marks.setdefault(name, time.time())


def marks() -> dict[str, float]:
    return dict(_marks)


def adopt(marks_elsewhere: dict[str, float]) -> None:
    """Take the engine's marks from the engine core's process (the server's process started first:
    its start is where the phases begin)."""
    for name, at in marks_elsewhere.items():
        if name in MARKS:
            _marks.setdefault(name, at)


def phases() -> dict[str, float]:
    """Seconds per phase reached so far."""
    times = {"process_start": process_start_time(), **_marks}
    return {phase: max(0.0, times[end] - times[start]) for phase, (start, end) in PHASES.items() if start in times and end in times}
