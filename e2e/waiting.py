"""Polling helper for e2e tests: wait for a condition, and say what was last seen when it never holds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(probe: Callable[[], T], timeout: float = 30, interval: float = 0.25, what: str = "condition") -> T:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = probe()
            if last:
                return last  # type: ignore[return-value]
        except Exception as e:  # noqa: BLE001 - report it if the wait fails
            last = e
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}; last seen: {last!r}")
