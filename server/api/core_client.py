"""The API process's side of the engine core in its own process (engine_core.py): the same interface as
AsyncEngine (submit, stream, release, abort), with the outputs made here.

A receiver thread reads the core's StepOutputs, turns each RequestDelta into its RequestOutput with
the output assembler the one-process engine runs itself (engine/output_assembler.py: detokenizing,
stop strings and the held-back text), and hands a step's outputs to their streams with one wake-up per
event loop. A stop string found here ends that sequence at once for the client and is sent to the core
(StopSequence), which frees its blocks; tokens the core made after it are dropped.

If the core dies, every open stream ends with an error, the cause goes to the log and the container's
termination message, and this process exits non-zero (as for a dead tensor-parallel rank).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import tempfile
import threading
import time

from kvpilot.server import startup
from kvpilot.server.adapters import AdapterError
from kvpilot.server.api.async_engine import AsyncEngine, EngineDeadError
from kvpilot.server.api.engine_core import (
    Abort,
    AdapterInfo,
    AdapterReply,
    AddRequest,
    CoreFailed,
    CoreReady,
    LoadAdapter,
    PrefixCacheReset,
    ResetPrefixCache,
    Scrape,
    Scraped,
    Shutdown,
    StepOutputs,
    StopSequence,
    UnloadAdapter,
    core_main,
    encoder,
    reply_decoder,
)
from kvpilot.server.config import EngineConfig
from kvpilot.server.engine.limits import RequestLimits
from kvpilot.server.engine.output_assembler import OutputAssembler

log = logging.getLogger("kvpilot.engine")
START_TIMEOUT_S = float(os.environ.get("KVPILOT_CORE_START_TIMEOUT_SECONDS", "1800"))  # loading a large model from a slow disk
DEAD_CORE_FLUSH_S = 1.0  # after the core died: time for open streams to write their error event before this process exits


class EngineCoreClient(AsyncEngine):
    """AsyncEngine's interface over the engine core's process. `engine` stays None: the engine's facts
    the server needs (tokenizer, limits, names) are made here from the core's CoreReady."""

    same_process = False
    tokenizer = None
    limits: RequestLimits | None = None
    served_model_name: str = ""

    @classmethod
    def launch_core(cls, config: EngineConfig, max_waiting_requests: int = 256, log_level: str = "info") -> EngineCoreClient:
        """Start the core process and return once its engine is loaded (its load error raised here)."""
        import zmq

        from kvpilot.server.engine.kv_trust import transfer_secret
        from kvpilot.server.engine.structured import GrammarCompiler
        from kvpilot.server.loading import open_model
        from kvpilot.server.model_files import engine_model_path

        self = cls(max_waiting_requests=max_waiting_requests)
        self._dir = tempfile.TemporaryDirectory(prefix="kvpilot-core-")
        self._context = zmq.Context()
        self._commands_socket = self._context.socket(zmq.PUSH)
        self._commands_socket.setsockopt(zmq.SNDHWM, 0)  # no limit: a send never waits on a busy core
        self._commands_socket.bind(f"ipc://{self._dir.name}/commands")
        self._replies = self._context.socket(zmq.PULL)
        self._replies.bind(f"ipc://{self._dir.name}/replies")
        self._send_lock = threading.Lock()
        self._sent_units = self._added_units = self._core_waiting = 0
        self._waiters: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}  # token -> a reply's awaiter
        self._tokens = itertools.count()
        kv_secret = transfer_secret(config.kv_role) if config.kv_role != "none" else None  # before the core starts: it inherits the environment
        self._process = mp.get_context("spawn").Process(
            target=core_main, name="kvpilot-engine-core", daemon=False,
            args=(config, f"ipc://{self._dir.name}/commands", f"ipc://{self._dir.name}/replies", os.getpid(), log_level))
        self._process.start()
        ready = self._await_ready()
        startup.adopt(ready.startup_marks)
        _weights, self.tokenizer = open_model(engine_model_path(config), config.load_format, config.seed)
        grammars = GrammarCompiler(self.tokenizer.backend_json(), ready.vocab_size, self.tokenizer.eos_token_ids)
        self.limits = RequestLimits(ready.max_model_len, ready.vocab_size, grammars, config.kv_role, kv_secret, config.scheduling_policy)
        self.served_model_name = ready.served_model_name
        self._lora_enabled = ready.lora_enabled
        self._adapters: dict[str, AdapterInfo] = {a.name: a for a in ready.adapters}  # the core's, as of its last AdapterReply
        self.outputs = OutputAssembler(self.tokenizer, lambda rid, index, stop: self._send(StopSequence(rid, index, stop)),
                                       lambda rid: self._send(Abort(rid)))
        self._thread = threading.Thread(target=self._receive, name="kvpilot-core-replies", daemon=True)
        self._thread.start()
        return self

    def _await_ready(self) -> CoreReady:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._replies.poll(200):
                reply = reply_decoder.decode(self._replies.recv())
                if isinstance(reply, CoreReady):
                    return reply
                if isinstance(reply, CoreFailed):
                    self._process.join(10)
                    raise ValueError(f"the engine core failed to start: {reply.message}")
            elif not self._process.is_alive() and not self._replies.poll(1000):  # its last words may still be on the way
                raise RuntimeError(f"the engine core process exited while starting (exit code {self._process.exitcode})")
        self._process.kill()
        raise RuntimeError(f"the engine core did not start within {START_TIMEOUT_S:.0f}s")

    # --- AsyncEngine's interface ----------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._process.is_alive() and self.fatal is None

    def num_waiting(self) -> int:
        """The core's waiting sequences as of its last outputs, and those sent since that it had not seen."""
        return self._core_waiting + self._sent_units - self._added_units

    def stop(self, timeout: float = 10) -> None:
        self._stop.set()
        if self._process.is_alive():
            self._send(Shutdown())
            self._process.join(timeout)
            if self._process.is_alive():
                self._process.kill()
        if self._thread:
            self._thread.join(timeout)
        self._context.destroy(linger=0)
        self._dir.cleanup()

    @property
    def lora_enabled(self) -> bool:
        return self._lora_enabled

    def model_names(self) -> list[str]:
        return [self.served_model_name, *self._adapters]

    def adapters(self) -> list[AdapterInfo]:
        return list(self._adapters.values())

    async def load_adapter(self, name: str, path: str, root: str | None) -> int:
        reply: AdapterReply = await self._ask(lambda token: LoadAdapter(token, name, str(path), root), timeout=None)
        if reply.error is not None:
            raise AdapterError(reply.error, reply.param or "lora_path")
        return reply.rank

    async def unload_adapter(self, name: str) -> None:
        reply: AdapterReply = await self._ask(lambda token: UnloadAdapter(token, name), timeout=60)
        if reply.not_found:
            raise KeyError(name)

    def _post(self, command) -> None:
        if isinstance(command, AddRequest):
            self.outputs.add(command.request_id, None, command.prompt_token_ids, command.params)
            with self._lock:
                self._pending -= command.params.n  # the core's count (added_units) covers it from here
                self._sent_units += command.params.n
            self._send(command)
        elif isinstance(command, Abort):
            self._send(command)
        else:
            raise NotImplementedError(f"{type(command).__name__} is not available with the engine core in its own process")

    def _send(self, command) -> None:
        """Never blocks: the queue toward a live core is unbounded, and toward a dead one (no peer: a
        blocking send would wait forever) the command is dropped; the receiver reports the death."""
        import zmq

        with self._send_lock:  # the event loop and the receiver thread both send; a ZeroMQ socket is one thread's at a time
            try:
                self._commands_socket.send(encoder.encode(command), zmq.NOBLOCK, copy=False)
            except zmq.Again:
                log.warning("the engine core is not connected: %s dropped", type(command).__name__)

    async def reset_prefix_cache(self, external: bool) -> int:
        return (await self._ask(lambda token: ResetPrefixCache(token, external), timeout=60)).forgotten

    async def scrape(self) -> str:
        """The core's metric families (Prometheus text), read between its steps."""
        if not self.alive:
            return ""
        return (await self._ask(Scrape, timeout=30)).text

    async def _ask(self, make, timeout: float | None):
        """Send make(token) and await the core's reply carrying that token."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        token = next(self._tokens)
        done = loop.create_future()
        self._waiters[token] = (loop, done)
        self._send(make(token))
        try:
            return await asyncio.wait_for(done, timeout)
        finally:
            self._waiters.pop(token, None)

    # --- receiver thread ------------------------------------------------------------------
    def _receive(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._replies.poll(200):
                    if not self._process.is_alive():
                        if not self._stop.is_set():  # stop() ends the core on purpose
                            self._core_died(f"the engine core process died (exit code {self._process.exitcode})")
                        return
                    continue
                reply = reply_decoder.decode(self._replies.recv())
                self.heartbeat = time.monotonic()  # the core's loop is running: it steps, answers or beats (CoreAlive)
                if isinstance(reply, StepOutputs):
                    self._added_units, self._core_waiting = reply.added_units, reply.num_waiting
                    outputs = [out for out in map(self.outputs.apply, reply.requests) if out is not None]
                    self._deliver_all([(out.request_id, out) for out in outputs])
                    if self.on_step:
                        self.on_step(None, outputs, reply.step_seconds)
                elif isinstance(reply, Scraped | AdapterReply | PrefixCacheReset):
                    if isinstance(reply, AdapterReply):
                        self._adapters = {a.name: a for a in reply.adapters}
                    waiter = self._waiters.get(reply.token)
                    if waiter is not None:
                        waiter[0].call_soon_threadsafe(_resolve, waiter[1], reply)
                elif isinstance(reply, CoreFailed):
                    self._process.join(5)
                    self._core_died(reply.message)
                    return
        except BaseException as e:  # noqa: BLE001 - this thread is the only way outputs arrive: without it nothing can be served
            log.exception("the engine core's receiver failed")
            self._core_died(f"the engine core's receiver failed ({type(e).__name__}: {e})")

    def _core_died(self, cause: str) -> None:
        """Fail every open stream, give them a moment to write their error event, then exit non-zero."""
        from kvpilot.server.engine.parallel import fatal

        self.fatal = EngineDeadError(cause)
        log.critical("%s: failing %d open requests", cause, len(self._streams))
        self._deliver_all([(rid, EngineDeadError(f"engine failed: {cause}")) for rid in list(self._streams)])
        time.sleep(DEAD_CORE_FLUSH_S)
        fatal(cause)


def _resolve(done: asyncio.Future, reply) -> None:
    if not done.done():
        done.set_result(reply)
