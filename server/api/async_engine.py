"""Runs the synchronous engine in its own thread; the asyncio side submits, streams and aborts.

The engine thread owns the LLMEngine: it builds it (see AsyncEngine.launch for why) and every change
to it is a command queued to that thread, so there is no lock around the model: AddRequest and Abort,
the messages the engine core in its own process takes too (engine_core.py), and Call (a change to
engine state between steps). The engine assembles its outputs itself (engine/output_assembler.py, the
assembler the API process runs on the core's deltas); they go back to each request's asyncio.Queue via
loop.call_soon_threadsafe, one wake-up per step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvpilot.server.adapters import AdapterError
from kvpilot.server.api.engine_core import Abort, AddRequest
from kvpilot.server.engine.limits import CONSTRAINT_FAILURE, Admission, RequestRejected
from kvpilot.server.engine.llm_engine import LLMEngine
from kvpilot.server.engine.outputs import RequestOutput

log = logging.getLogger("kvpilot.engine")
IDLE_BEAT_S = 0.5  # an idle engine loop wakes this often (and so shows it is alive)


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full (HTTP 429)."""


class RequestTooLargeError(ValueError):
    """A request needs more sequences than the whole waiting queue holds (HTTP 400: retrying cannot help)."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped (HTTP 503)."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request (HTTP 500); the engine itself goes on."""


class ConstraintFailedError(RequestRejected):
    """The grammar library failed this request's output constraint mid-generation (HTTP 400 naming its
    field when nothing was sent yet, an error event in a stream): the constraint's fault, not the server's."""

    code = "constraint_failed"


class ServerShutdownError(RuntimeError):
    """The server stopped before the request finished (its shutdown grace ran out)."""


@dataclass(frozen=True, slots=True)
class Job:
    """One engine request of an API request: its id and its admission (RequestLimits.admit)."""

    request_id: str
    admission: Admission


@dataclass(frozen=True, slots=True)
class _Call:
    """Run fn(engine) on the engine thread between steps; settle `done` (on `loop`) with its result."""

    fn: Callable[[LLMEngine], Any]
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    constraint_param: str | None = None   # the request field its output constraint came in


@dataclass
class AsyncEngine:
    same_process: ClassVar[bool] = True    # the engine takes the API's objects as they are (its compiled grammars)
    engine: LLMEngine | None = None        # set by launch(), in the engine thread
    max_waiting_requests: int = 256
    on_step: Callable[[LLMEngine, list[RequestOutput], float], None] | None = None  # metrics hook, engine thread
    _commands: queue.SimpleQueue[AddRequest | Abort | _Call] = field(default_factory=queue.SimpleQueue)
    _streams: dict[str, _Stream] = field(default_factory=dict)
    _wake: threading.Event = field(default_factory=threading.Event)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _pending: int = 0                      # submitted but not yet seen by the engine thread
    _lock: threading.Lock = field(default_factory=threading.Lock)
    heartbeat: float = field(default_factory=time.monotonic)  # the engine loop's last sign of progress
    _busy_since: float = 0.0                 # when requests were last submitted to an engine with none open
    fatal: BaseException | None = None

    @classmethod
    def launch(cls, build_engine: Callable[[], LLMEngine], max_waiting_requests: int = 256) -> AsyncEngine:
        """Start the engine thread, build the engine in it and return once it is loaded (load errors
        are raised here).

        The engine is built in the thread that steps it, and torch runs on no other thread: GNU
        OpenMP keeps a worker team per thread that opens parallel regions, and once it manages more
        threads than there are CPUs its workers stop spinning between regions (libgomp's "throttled"
        spin count: zero under OMP_WAIT_POLICY=PASSIVE). A model loaded on the main thread and
        stepped on this one left four OpenMP threads on two cores, and each of the ~250 parallel
        regions of a step paid a sleep and a wake-up: 100k context switches for 32 requests, serving
        at 170-190 output tok/s where the same engine steps at 270-290 (bench/history/)."""
        self = cls(max_waiting_requests=max_waiting_requests)
        loaded = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            try:
                self.engine = build_engine()
            except BaseException as e:
                failure.append(e)
                return
            finally:
                loaded.set()
            self._run()

        self._thread = threading.Thread(target=main, name="kvpilot-engine", daemon=True)
        self._thread.start()
        loaded.wait()
        if failure:
            raise failure[0]
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

    def stalled_seconds(self) -> float:
        """How long the engine loop has shown no progress while requests are open on it; 0 when none
        is (an idle loop is not a hung one, and its silence before they came does not count). The loop
        beats at least every IDLE_BEAT_S."""
        if not self._streams and not self._pending:
            return 0.0
        return max(0.0, time.monotonic() - max(self.heartbeat, self._busy_since))

    def num_in_flight(self) -> int:
        return len(self._streams)

    # --- asyncio side -----------------------------------------------------------------------
    def submit(self, jobs: list[Job]) -> None:
        """Queue a request's jobs all or none, before any response byte is sent; each of a job's n
        sequences counts against max_waiting_requests.
        Call from the event loop; then read each job with stream() (or release() them)."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        units = sum(job.admission.params.n for job in jobs)
        if units > self.max_waiting_requests:
            raise RequestTooLargeError(f"this request needs {units} sequences (prompts x n) but at most {self.max_waiting_requests} "
                                       f"can wait (the server's max_waiting_requests)")
        with self._lock:
            if self.num_waiting() + units > self.max_waiting_requests:
                raise QueueFullError(f"{self.num_waiting()} sequences are already waiting and this request adds {units} "
                                     f"(limit {self.max_waiting_requests})")
            if not self._streams and not self._pending:
                self._busy_since = time.monotonic()
            self._pending += units
        loop = asyncio.get_running_loop()
        for job in jobs:
            structured = job.admission.params.structured
            self._streams[job.request_id] = _Stream(loop, asyncio.Queue(), structured.param if structured else None)
            self._post(AddRequest.of(job, with_grammar=self.same_process))

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of a submitted job; closing the iterator early (client gone) aborts it."""
        stream = self._streams[request_id]
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:
                    finished = True
                    if stream.constraint_param and item.error.startswith(CONSTRAINT_FAILURE):
                        raise ConstraintFailedError(f"{stream.constraint_param}: {item.error}", stream.constraint_param)
                    raise RequestFailedError(item.error)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def release(self, request_ids: list[str]) -> None:
        """Abort the jobs among these that are still open (e.g. a response that never started)."""
        for rid in request_ids:
            if self._streams.pop(rid, None) is not None:
                self.abort(rid)

    def close_all(self, error: BaseException) -> None:
        """End every open stream with this error (the server is stopping); the engine aborts them."""
        for _rid, stream in list(self._streams.items()):
            stream.queue.put_nowait(error)

    def abort(self, request_id: str) -> None:
        self._post(Abort(request_id))

    def _post(self, command) -> None:
        """A command for the engine thread, taken between steps."""
        self._commands.put(command)
        self._wake.set()

    # --- LoRA adapters (the same calls with the engine core in its own process: core_client.py) ----
    @property
    def lora_enabled(self) -> bool:
        return self.engine.lora is not None

    def model_names(self) -> list[str]:
        """The served model's name, then the adapters' (what a request's `model` may name)."""
        return self.engine.model_names()

    def adapters(self) -> list:
        """The loaded adapters (name, source, loaded_at), for /v1/models."""
        return list(self.engine.lora.by_name.values()) if self.engine.lora else []

    async def load_adapter(self, name: str, path: str, root: str | None) -> int:
        """Read and check an adapter off the step loop, register it on it; its rank (AdapterError: refused)."""
        try:
            adapter = await asyncio.to_thread(self.engine.lora.read, name, path, root)
        except AdapterError:
            raise
        except Exception as e:  # noqa: BLE001 - the loader's own failure: this load is refused (as the engine core's is), the engine goes on
            log.exception("reading adapter %r failed", name)
            raise AdapterError(f"reading the adapter failed ({type(e).__name__}: {e})", "lora_path") from None
        await self.call(lambda engine: engine.load_adapter(adapter))
        return adapter.rank

    async def unload_adapter(self, name: str) -> None:
        """KeyError: no adapter by that name."""
        await self.call(lambda engine: engine.unload_adapter(name))

    async def reset_prefix_cache(self, external: bool) -> int:
        """The engine's prefix cache (and with external its KV tiers) forgotten between steps; how many blocks."""
        return await self.call(lambda engine: engine.reset_prefix_cache(external))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps (a change to engine state, e.g. registering
        an adapter); its result, or its exception raised here."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._post(_Call(fn, loop, done))
        return await done

    # --- engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.heartbeat = time.monotonic()
                self._drain_commands()
                if not self.engine.needs_step():
                    self._wake.wait(IDLE_BEAT_S)
                    self._wake.clear()
                    continue
                t = time.monotonic()
                outputs = self.engine.step_or_fail_open()
                self._deliver_all([(out.request_id, out) for out in outputs])
                if self.on_step:
                    self.on_step(self.engine, outputs, time.monotonic() - t)
        except BaseException as e:  # the engine cannot go on: fail every open request, /health turns 503
            log.exception("engine loop crashed")
            self.fatal = e
            self._deliver_all([(rid, EngineDeadError(f"engine failed: {e}")) for rid in list(self._streams)])

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, AddRequest):
                with self._lock:
                    self._pending -= cmd.params.n
                if cmd.request_id not in self._streams:  # the client left before the engine saw it
                    continue
                try:
                    self.engine.add_admitted(cmd.admission(), cmd.request_id, cmd.arrival_time)
                except ValueError as e:
                    self._deliver(cmd.request_id, e)
            elif isinstance(cmd, _Call):
                try:
                    result, error = cmd.fn(self.engine), None
                except Exception as e:  # noqa: BLE001 - the caller's to handle
                    result, error = None, e
                cmd.loop.call_soon_threadsafe(_settle, cmd.done, result, error)
            else:
                out = self.engine.abort_request(cmd.request_id)
                if out is not None and self.on_step:
                    self.on_step(self.engine, [out], 0.0)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """Hand a step's outputs to their streams with one wake-up per event loop, not one per request:
        each wake-up is a write to the loop's self-pipe and a turn of the GIL between the two threads."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput | BaseException]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_put_all, batch)


def _settle(done: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if done.done():  # the caller went away
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for q, item in batch:
        q.put_nowait(item)
