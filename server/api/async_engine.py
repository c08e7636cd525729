"""Runs the synchronous engine in its own thread; the asyncio side submits, streams and aborts.

The engine thread owns the LLMEngine: every change to it (add, abort) is a command queued to that
thread, so there is no lock around the model. Outputs go back to each request's asyncio.Queue via
loop.call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from kvpilot.server.engine.llm_engine import LLMEngine
from kvpilot.server.engine.outputs import RequestOutput
from kvpilot.server.engine.sampling_params import SamplingParams

log = logging.getLogger("kvpilot.engine")


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped (HTTP 503)."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    params: SamplingParams


@dataclass
class AsyncEngine:
    engine: LLMEngine
    max_waiting_requests: int = 256
    on_step: Callable[[LLMEngine, list[RequestOutput], float], None] | None = None  # metrics hook, engine thread
    _commands: "queue.SimpleQueue[tuple]" = field(default_factory=queue.SimpleQueue)
    _streams: dict[str, _Stream] = field(default_factory=dict)
    _wake: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _pending: int = 0                      # submitted but not yet seen by the engine thread
    _lock: threading.Lock = field(default_factory=threading.Lock)
    heartbeat: float = field(default_factory=time.monotonic)
    fatal: BaseException | None = None

    def start(self) -> "AsyncEngine":
        self._thread = threading.Thread(target=self._run, name="kvpilot-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.fatal is None

    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._pending

    def num_in_flight(self) -> int:
        return len(self._streams)

    # --- asyncio side -----------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """Submit and stream outputs; closing the iterator early (client gone) aborts the request."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        with self._lock:
            if self.num_waiting() >= self.max_waiting_requests:
                raise QueueFullError(f"{self.num_waiting()} requests are already waiting (limit {self.max_waiting_requests})")
            self._pending += 1
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), params)
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, prompt, params))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    # --- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.heartbeat = time.monotonic()
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                t = time.monotonic()
                outputs = self.engine.step()
                for out in outputs:
                    self._deliver(out.request_id, out)
                if self.on_step:
                    self.on_step(self.engine, outputs, time.monotonic() - t)
        except BaseException as e:  # the engine died: fail every open request, /health turns 503
            log.exception("engine loop crashed")
            self.fatal = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"engine failed: {e}"))

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt, params = cmd
                with self._lock:
                    self._pending -= 1
                if rid not in self._streams:  # the client left before the engine saw it
                    continue
                try:
                    self.engine.add_request(prompt, params, request_id=rid)
                except ValueError as e:
                    self._deliver(rid, e)
            else:
                out = self.engine.abort_request(cmd[1])
                if out is not None and self.on_step:
                    self.on_step(self.engine, [out], 0.0)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
