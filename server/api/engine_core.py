"""The engine core in its own process (`kvpilot serve --engine-core-process`): the scheduler + model
runner loop, behind two local ZeroMQ sockets, and the typed messages the API process exchanges with it.

The API process (core_client.py) keeps HTTP, tokenization, chat templates, admission and the output
assembler (detokenizing, stop strings: engine/output_assembler.py, the same one the one-process engine
runs); the core runs LLMEngine(assemble=False) and its step loop. Requests go in as AddRequest, the
command the one-process engine thread takes too (the admitted prompt ids, parameters and output limit:
the core does not check them again; it compiles a structured-output constraint into its own grammar
cache, as a compiled grammar does not cross processes), and each step's outputs come back as the
engine's RequestDeltas: per request the step touched, the tokens new since the last (and their
logprobs), and why a sequence ended. A stop string found by the API process comes back as
StopSequence; LoRA adapters are loaded (read on a thread of the core, registered between steps) and
unloaded by LoadAdapter / UnloadAdapter, each answered by an AdapterReply listing the loaded adapters,
which the API process mirrors for `model` checks and /v1/models. Messages are msgpack (msgspec), typed on both sides; nothing is pickled after start-up.

The core ignores SIGTERM and SIGINT (the API process drains, then sends Shutdown), and exits when the
API process is gone. Its start-up failure comes back as CoreFailed; so does a crash of its loop, after
which it exits non-zero (the API process fails open streams and exits, see core_client.py).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any

import msgspec

from kvpilot.server import startup
from kvpilot.server.adapters import AdapterError
from kvpilot.server.config import EngineConfig
from kvpilot.server.engine.limits import Admission
from kvpilot.server.engine.outputs import RequestDelta, RequestMetrics, SeqDelta
from kvpilot.server.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvpilot.server.api.async_engine import Job

log = logging.getLogger("kvpilot.engine_core")
IDLE_POLL_MS = 200  # an idle core's wait for a command; also how often it checks that the API process lives
CORE_BEAT_S = 1.0  # the longest a running core stays silent (see CoreAlive)
COMPILING_POLL_MS = 2  # an idle core's wait while a constraint compiles off the loop (its request is added when done)


# --- API process -> engine (the core, or the one-process engine thread) -----------------------------
class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """An admitted request (RequestLimits.admit, in the API process): the engine takes it unchecked."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_output_tokens: int
    adapter: str | None
    arrival_time: float
    grammar: Any = None         # in one process: params.structured as the API compiled it (across processes: None, the core compiles it)

    @classmethod
    def of(cls, job: Job, with_grammar: bool) -> AddRequest:
        a = job.admission
        return cls(job.request_id, a.prompt_token_ids, a.params, a.max_output_tokens, a.adapter, time.monotonic(),
                   a.grammar if with_grammar else None)

    def admission(self, grammar=None) -> Admission:
        return Admission(self.prompt_token_ids, self.params, self.max_output_tokens, grammar or self.grammar, self.adapter)


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_id: str


class StopSequence(msgspec.Struct, tag="stop", array_like=True):
    request_id: str
    index: int
    stop: str


class Scrape(msgspec.Struct, tag="scrape", array_like=True):
    token: int


class LoadAdapter(msgspec.Struct, tag="load_adapter", array_like=True):
    token: int
    name: str
    path: str
    root: str | None            # --lora-dir: where it must be (an hf:// source is downloaded into it)


class UnloadAdapter(msgspec.Struct, tag="unload_adapter", array_like=True):
    token: int
    name: str


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", array_like=True):
    token: int
    external: bool              # the KV tiers too


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


Command = AddRequest | Abort | StopSequence | Scrape | LoadAdapter | UnloadAdapter | ResetPrefixCache | Shutdown


# --- core -> API process ---------------------------------------------------------------------------
class StepOutputs(msgspec.Struct, tag="outputs", array_like=True):
    requests: list[RequestDelta]  # the engine's (LLMEngine(assemble=False))
    added_units: int            # sequences added since the core started: the API process's pending count is what it sent beyond
    num_waiting: int            # sequences in the scheduler's waiting queue
    step_seconds: float


class AdapterInfo(msgspec.Struct, array_like=True):
    name: str
    source: str
    loaded_at: float


class CoreReady(msgspec.Struct, tag="ready", array_like=True):
    served_model_name: str
    max_model_len: int
    vocab_size: int
    startup_marks: dict[str, float]    # the engine's start-up marks (server/startup.py), taken by the server's process
    lora_enabled: bool
    adapters: list[AdapterInfo]        # loaded at start (--lora-modules)


class AdapterReply(msgspec.Struct, tag="adapter", array_like=True):
    token: int
    error: str | None           # refused (AdapterError's message)
    param: str | None
    not_found: bool             # an unload of a name no adapter has
    rank: int
    adapters: list[AdapterInfo]  # every loaded adapter after it


class CoreFailed(msgspec.Struct, tag="failed", array_like=True):
    message: str


class Scraped(msgspec.Struct, tag="scraped", array_like=True):
    token: int
    text: str                   # the core's metric families, Prometheus text format


class PrefixCacheReset(msgspec.Struct, tag="prefix_cache_reset", array_like=True):
    token: int
    forgotten: int              # blocks


class CoreAlive(msgspec.Struct, tag="alive", array_like=True):
    """Sent when the core has sent nothing else for CORE_BEAT_S (idle, or a step that makes no output,
    such as a long prompt's chunks): the API process tells a running core from a hung one."""


Reply = StepOutputs | CoreReady | CoreFailed | Scraped | AdapterReply | PrefixCacheReset | CoreAlive

encoder = msgspec.msgpack.Encoder()
command_decoder = msgspec.msgpack.Decoder(Command)
reply_decoder = msgspec.msgpack.Decoder(Reply)


def core_main(config: EngineConfig, commands_address: str, replies_address: str, parent_pid: int, log_level: str) -> None:
    """The core process: build the engine, say so, then step while there is work and apply commands
    between steps."""
    import zmq

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the API process drains first, then sends Shutdown
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s", stream=sys.stderr)
    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)  # exiting never waits to deliver to an API process that is gone
    inbox = context.socket(zmq.PULL)
    inbox.connect(commands_address)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)  # a step's outputs never wait on the API process
    outbox.connect(replies_address)

    last_sent = time.monotonic()

    def send(message) -> None:
        nonlocal last_sent
        last_sent = time.monotonic()
        try:  # never blocks (no high-water mark); the only refusal is a socket with no peer: the API process is gone
            outbox.send(encoder.encode(message), zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.error("the API process is gone: the engine core exits")
            os._exit(1)

    def report_failure(message: str, exit_code: int) -> None:
        """The last message: waits (up to 5 s) for the API process to take it, then exits."""
        outbox.setsockopt(zmq.SNDTIMEO, 5000)
        try:
            outbox.send(encoder.encode(CoreFailed(message)))
        except zmq.Again:
            pass
        inbox.close()
        outbox.close(linger=5000)
        context.term()  # returns once the message is delivered (or after the linger): close() alone does not wait
        os._exit(exit_code)

    try:
        from kvpilot.server.engine.llm_engine import LLMEngine

        engine = LLMEngine(config, show_progress=False, assemble=False)
    except BaseException as e:  # noqa: BLE001 - reported to the API process, which raises it as a start-up error
        report_failure(f"{type(e).__name__}: {e}", 1)
    from prometheus_client import CollectorRegistry, generate_latest

    from kvpilot.server.api.metrics import EngineCollector

    registry = CollectorRegistry()
    registry.register(EngineCollector(engine, engine.served_model_name))
    adapters = lambda: [AdapterInfo(a.name, a.source, a.loaded_at) for a in engine.lora.by_name.values()] if engine.lora else []
    send(CoreReady(engine.served_model_name, engine.max_model_len, engine.model_config.vocab_size, startup.marks(), engine.lora is not None,
                   adapters()))
    added_units = 0
    adapter_reads: queue.SimpleQueue = queue.SimpleQueue()  # (LoadAdapter, Adapter | None, AdapterError | None) from reader threads

    # A request with an output constraint has it compiled off the step loop: a compile takes milliseconds
    # to seconds (a 10,000-property schema stalled running streams for 7 s when it ran here), as the
    # one-process server compiles in its tokenizer pool. The loop adds it once compiled.
    compiled: queue.SimpleQueue = queue.SimpleQueue()  # (AddRequest, Admission | None, ValueError | None)
    compiling: dict[str, AddRequest] = {}  # by request id (its sequences count as waiting); one aborted meanwhile ends at once, its compile is dropped

    def compile_constraint(command: AddRequest) -> None:
        try:
            compiled.put((command, command.admission(engine.limits.grammars.compile(command.params.structured)), None))
        except ValueError as e:
            compiled.put((command, None, e))
        except Exception as e:  # noqa: BLE001 - the compiler's own failure: this request's, the core goes on
            log.exception("compiling the constraint of request %s failed", command.request_id)
            compiled.put((command, None, ValueError(f"{type(e).__name__}: {e}")))

    def add(command: AddRequest, admission: Admission | None, error: ValueError | None, extra: list[RequestDelta]) -> None:
        if error is None:
            try:
                engine.add_admitted(admission, command.request_id, command.arrival_time)
                return
            except ValueError as e:
                error = e
        # admitted by the API process (which compiled the same constraint): a refusal here is a bug, this request's
        log.error("request %s refused by the engine core: %s", command.request_id, error)
        extra.append(_ended(command, "error", str(error)))

    def read_adapter(command: LoadAdapter) -> None:
        """Off the step loop, as the one-process server reads adapters: files (or a download) and checks."""
        try:
            adapter_reads.put((command, engine.lora.read(command.name, command.path, command.root), None))
        except AdapterError as e:
            adapter_reads.put((command, None, e))
        except Exception as e:  # noqa: BLE001 - the loader's own failure: this load is refused, the core goes on
            log.exception("reading adapter %r failed", command.name)
            adapter_reads.put((command, None, AdapterError(f"reading the adapter failed ({type(e).__name__}: {e})", "lora_path")))

    try:
        while True:
            busy = engine.needs_step()
            extra: list[RequestDelta] = []
            while not adapter_reads.empty():  # adapters read meanwhile are registered between steps
                command, adapter, error = adapter_reads.get()
                if adapter is not None:
                    try:
                        engine.load_adapter(adapter)
                    except AdapterError as e:
                        error = e
                send(AdapterReply(command.token, str(error) if error else None, error.param if error else None, False,
                                  adapter.rank if adapter else 0, adapters()))
            while not compiled.empty():
                command, admission, error = compiled.get()
                if compiling.pop(command.request_id, None) is not None:
                    add(command, admission, error, extra)
            if inbox.poll(0 if busy else COMPILING_POLL_MS if compiling else IDLE_POLL_MS):
                while True:
                    try:
                        raw = inbox.recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    command = command_decoder.decode(raw.buffer)
                    if isinstance(command, AddRequest):
                        added_units += command.params.n
                        if command.params.structured is not None:  # a daemon: a compile never holds up the core's exit
                            compiling[command.request_id] = command
                            threading.Thread(target=compile_constraint, args=(command,), name="kvpilot-core-compile", daemon=True).start()
                            continue
                        add(command, command.admission(), None, extra)
                    elif isinstance(command, Abort) and command.request_id in compiling:  # its output ends here (the API process forgets it)
                        extra.append(_ended(compiling.pop(command.request_id), "abort"))
                    elif isinstance(command, Abort):
                        out = engine.abort_request(command.request_id)
                        if out is not None:
                            extra.append(out)
                    elif isinstance(command, StopSequence):
                        final = engine.stop_sequence(command.request_id, command.index, command.stop)
                        if final is not None:  # a prefill request's: its kv_transfer_params, which the API process waits for
                            extra.append(final)
                    elif isinstance(command, Scrape):
                        send(Scraped(command.token, generate_latest(registry).decode()))
                    elif isinstance(command, ResetPrefixCache):
                        send(PrefixCacheReset(command.token, engine.reset_prefix_cache(command.external)))
                    elif isinstance(command, LoadAdapter):
                        threading.Thread(target=read_adapter, args=(command,), name="kvpilot-adapter-read", daemon=True).start()
                    elif isinstance(command, UnloadAdapter):
                        try:
                            engine.unload_adapter(command.name)
                            send(AdapterReply(command.token, None, None, False, 0, adapters()))
                        except KeyError:
                            send(AdapterReply(command.token, None, None, True, 0, adapters()))
                    else:
                        engine.close()
                        return
            if os.getppid() != parent_pid:
                log.error("the API process is gone: the engine core exits")
                engine.close()
                return
            started = time.monotonic()
            outputs = engine.step_or_fail_open() if engine.needs_step() else []
            if outputs or extra:
                send(StepOutputs(extra + outputs, added_units,
                                 len(engine.scheduler.waiting) + sum(c.params.n for c in compiling.values()), time.monotonic() - started))
            elif time.monotonic() - last_sent >= CORE_BEAT_S:
                send(CoreAlive())
    except BaseException as e:  # noqa: BLE001 - the core cannot go on: say why, exit non-zero
        log.critical("engine core loop crashed:\n%s", traceback.format_exc())
        report_failure(f"engine core loop crashed ({type(e).__name__}: {e})", 70)


def _ended(command: AddRequest, reason: str, error: str | None = None) -> RequestDelta:
    """The final delta of a request the engine never ran (refused: "error"; aborted while compiling)."""
    seqs = [SeqDelta(i, [], None, reason, None) for i in range(command.params.n)]
    return RequestDelta(command.request_id, seqs, RequestMetrics(command.arrival_time), 0, None, error, None)
