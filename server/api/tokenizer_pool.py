"""The one place tokenization work runs: a few threads and a bounded wait, never the default executor.

Prompts, chat templates, /tokenize and /detokenize all run here. asyncio.to_thread would queue any
number of them on a pool sized for I/O: six multi-megabyte texts then held up every other request's
tokenization for half a minute. Here a request beyond the bound is refused at once with a 429.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvpilot.server.api.async_engine import QueueFullError

T = TypeVar("T")


class TokenizerPool:
    def __init__(self, workers: int, max_pending: int):
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="kvpilot-tokenize")
        self.limit = workers + max_pending  # running + waiting
        self._lock = threading.Lock()
        self.active = 0

    async def run(self, fn: Callable[[], T]) -> T:
        """fn() on a tokenizer thread. A task counts until it has really finished (or was cancelled
        before it started): a client that leaves does not free its slot while its work still runs."""
        with self._lock:
            if self.active >= self.limit:
                raise QueueFullError(f"{self.active} tokenization tasks are running or waiting (limit {self.limit})")
            self.active += 1
        future = self._executor.submit(fn)
        future.add_done_callback(self._finished)
        return await asyncio.wrap_future(future)

    def _finished(self, _future) -> None:
        with self._lock:
            self.active -= 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
