"""Structured-output constraints compiled before a request is tokenized, on the compile threads of
engine/structured.py rather than the tokenizer pool, a few at a time per client.

On the tokenizer pool, two concurrent 300 KB schemas took both of its threads for 13 s and every
other request's prompt waited behind them. Here the pool only normalizes a constraint into its
cache key (milliseconds a MiB, never on the event loop); a compile waits on its own threads (a cache
hit does not wait at all, and requests for a constraint already compiling wait for that compile),
and one client has at most `per_client` compiles at once, so another client's constraint is
compiled while the first one's still runs. What one compile may cost is bounded by what
structured.py refuses before the library sees it.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future

from kvpilot.server.api.async_engine import QueueFullError
from kvpilot.server.api.tokenizer_pool import TokenizerPool
from kvpilot.server.engine.sampling_params import StructuredOutput
from kvpilot.server.engine.structured import Grammar, GrammarCompiler, deep_stack_threads, keyed


class ConstraintCompiles:
    def __init__(self, grammars: GrammarCompiler, pool: TokenizerPool, per_client: int, max_pending: int):
        self.grammars, self.pool, self.per_client, self.max_pending = grammars, pool, per_client, max_pending
        self._lock = threading.Lock()
        self._by_client: dict[str, int] = {}
        self._compiling: dict[tuple[str, bytes], Future] = {}

    async def grammar(self, spec: StructuredOutput, client: str) -> Grammar:
        """The constraint's grammar (RequestRejected when refused; QueueFullError, a 429, when this
        client has `per_client` compiles running or waiting, or all clients `max_pending`). A compile
        counts until it has really finished: a client that leaves does not free its share early."""
        constraint = await self.pool.run(lambda: keyed(spec))
        found = self.grammars.lookup(constraint)
        if found is not None:
            return found
        created = False
        with self._lock:
            future = self._compiling.get(constraint.key)
            if future is None:
                mine = self._by_client.get(client, 0)
                if mine >= self.per_client:
                    raise QueueFullError(f"this client has {mine} structured-output constraints compiling (at most {self.per_client} at once)")
                if sum(self._by_client.values()) >= self.max_pending:
                    raise QueueFullError(f"{self.max_pending} structured-output constraints are compiling or waiting to")
                future = deep_stack_threads().submit(lambda: self.grammars.compile_new(constraint))
                self._by_client[client] = mine + 1
                self._compiling[constraint.key] = future
                created = True
        if created:  # outside the lock: a compile already done runs its callback here, at once
            future.add_done_callback(lambda _: self._finished(client, constraint.key))
        # shielded: one request that leaves must not cancel the compile others wait for
        return await asyncio.shield(asyncio.wrap_future(future))

    def _finished(self, client: str, key: tuple[str, bytes]) -> None:
        with self._lock:
            del self._compiling[key]
            left = self._by_client[client] - 1
            if left:
                self._by_client[client] = left
            else:
                del self._by_client[client]
