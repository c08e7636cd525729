"""Prefill/decode disaggregation: a prefill engine holds a finished prompt's KV blocks for a decode
engine to pull over TCP (ZeroMQ), and the decode engine loads them like a KV tier read.

Prefill side (KVSender): a request with kv_transfer_params.do_remote_decode runs as usual; when it
ends, its prompt's full blocks are held (a reference each, so nothing evicts or reuses them) under a
transfer id, and its output carries the params to pass on. A ROUTER socket serves a pull of that id:
the held blocks' keys and K/V, then the hold is released (by the engine's loop: the block manager is
its alone). A hold nobody pulls is released after `timeout` seconds.

Decode side (KVReceiver): a request with do_remote_prefill waits like a sequence whose blocks are on
disk while a puller thread asks the prefill engine for them. Each pulled block is used only when its
key is the one this engine computes for the prompt's tokens: keys chain from a salt of the engine's
identity (model files, block size, dtypes, ...), so a prefill engine of another model or settings
gives no block that counts, and a block of other tokens cannot slip in. What is not pulled (a prefill
engine gone, a timeout, a mismatch) is computed here: never wrong tokens, never a failed request for
that reason. The prompt's last token is always computed (its logits are needed).

The transport is plain TCP through ZeroMQ, K/V copied through host memory: on GPUs with RDMA, NIXL/UCX
would move blocks device to device instead (what vLLM's NixlConnector does); the protocol here (pull
by transfer id, verify by key) would stay.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from kvpilot.server.engine.block_manager import block_hash
from kvpilot.server.engine.kv_tiers import BlockLoad, Payload
from kvpilot.server.engine.sampling_params import KVTransferParams

log = logging.getLogger("kvpilot.server.kv_transfer")


@dataclass(slots=True)
class TransferStats:
    """Monotonic counters for metrics (blocks, bytes, seconds)."""

    held_transfers: int = 0          # prefill side: holds made
    sent_blocks: int = 0
    sent_bytes: int = 0
    expired_transfers: int = 0       # holds released unpulled after the timeout
    pulled_blocks: int = 0           # decode side
    pulled_bytes: int = 0
    failed_pulls: int = 0            # pulls that gave fewer blocks than asked for (computed here instead)
    pull_seconds: float = 0.0


@dataclass(slots=True)
class _Hold:
    block_ids: list[int]
    keys: list[bytes]
    deadline: float


@dataclass(slots=True)
class _Pull:
    params: KVTransferParams
    load: BlockLoad
    started: float = field(default_factory=time.perf_counter)


class KVSender:
    def __init__(self, host: str, port: int, read_block: Callable[[int], Payload], engine_id: str, timeout: float):
        """Serves on host:port, the address decode engines are told (port 0: any free port, self.port
        says which). read_block: a held block's K/V (the runner's block_bytes, called from the server
        thread: held blocks do not change)."""
        self.read_block, self.engine_id, self.timeout = read_block, engine_id, timeout
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}
        self._released: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.port = self._socket.bind_to_random_port(f"tcp://{host}") if port == 0 else port
        if port:
            self._socket.bind(f"tcp://{host}:{port}")
        self._thread = threading.Thread(target=self._serve, name="kvpilot-kv-sender", daemon=True)
        self._thread.start()

    def hold(self, transfer_id: str, block_ids: list[int], keys: list[bytes]) -> None:
        """Blocks the engine has just taken a reference on for transfer_id, until pulled or expired."""
        with self._lock:
            self._holds[transfer_id] = _Hold(block_ids, keys, time.monotonic() + self.timeout)
            self.stats.held_transfers += 1

    def releases(self) -> list[list[int]]:
        """Held blocks to give back now (pulled, or unpulled past the timeout): the engine's loop
        drops its references on them."""
        now, out = time.monotonic(), []
        with self._lock:
            for transfer_id in [t for t, h in self._holds.items() if h.deadline <= now]:
                out.append(self._holds.pop(transfer_id).block_ids)
                self.stats.expired_transfers += 1
                log.warning("KV transfer %s was not pulled in %.0f s: its blocks are released", transfer_id, self.timeout)
        while not self._released.empty():
            out.append(self._released.get())
        return out

    def num_held_blocks(self) -> int:
        with self._lock:
            return sum(len(h.block_ids) for h in self._holds.values())

    def close(self) -> None:
        """Stop serving (pulls after this get no answer: their blocks are computed by the decode side)."""
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5)

    def _serve(self) -> None:
        while not self._closed.is_set():
            if not self._socket.poll(100):
                continue
            identity, request = self._socket.recv_multipart()
            try:
                ask = json.loads(request)
                transfer_id = str(ask["transfer"])
                with self._lock:
                    held = self._holds.pop(transfer_id, None)
                if held is None:
                    self._socket.send_multipart([identity, json.dumps({"error": f"no held transfer {transfer_id!r} (pulled, "
                                                                                "expired or never made)"}).encode()])
                    continue
                wanted = {bytes.fromhex(k) for k in ask.get("keys", [])}
                sent = [(k, b) for k, b in zip(held.keys, held.block_ids) if k in wanted]  # not those the decode engine has cached
                payloads = [self.read_block(b) for _, b in sent]
                payloads = [p if isinstance(p, bytes) else p.result() for p in payloads]
                self._released.put(held.block_ids)
                header = {"engine_id": self.engine_id, "keys": [k.hex() for k, _ in sent]}
                self._socket.send_multipart([identity, json.dumps(header).encode(), *payloads], copy=False)
                with self._lock:
                    self.stats.sent_blocks += len(payloads)
                    self.stats.sent_bytes += sum(len(p) for p in payloads)
            except Exception as e:  # noqa: BLE001 - a bad pull is answered, the server goes on
                log.warning("KV transfer: a pull failed (%s: %s)", type(e).__name__, e)
                self._socket.send_multipart([identity, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()])
        self._socket.close()


class KVReceiver:
    def __init__(self, engine_id: str, payload_bytes: int, timeout: float):
        self.engine_id, self.payload_bytes, self.timeout = engine_id, payload_bytes, timeout
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._pulls: queue.SimpleQueue[_Pull | None] = queue.SimpleQueue()
        threading.Thread(target=self._puller, name="kvpilot-kv-receiver", daemon=True).start()

    def pull(self, params: KVTransferParams, parent: bytes, chunks: list[tuple[int, ...]], first_index: int) -> BlockLoad:
        """A pull of the blocks chained from `parent` over `chunks` from the prefill engine `params`
        names; its payloads are those that came back and verified, in order (done when it ends)."""
        keys = []
        for chunk in chunks:
            parent_key = keys[-1] if keys else parent
            keys.append(block_hash(parent_key, chunk))
        load = BlockLoad(first_index, parent, keys, [tuple(c) for c in chunks])
        self._pulls.put(_Pull(params, load))
        return load

    def close(self) -> None:
        self._pulls.put(None)

    def _puller(self) -> None:
        while (pull := self._pulls.get()) is not None:
            got = []
            try:
                got = self._fetch(pull)
            except Exception as e:  # noqa: BLE001 - a failed pull means computing the blocks here
                log.warning("KV transfer %s from %s:%s failed (%s: %s): computing its blocks here", pull.params.remote_request_id,
                            pull.params.remote_host, pull.params.remote_port, type(e).__name__, e)
            pull.load.payloads.extend([[p] for p in got])
            with self._lock:
                self.stats.pulled_blocks += len(got)
                self.stats.pulled_bytes += len(got) * self.payload_bytes
                self.stats.failed_pulls += len(got) < len(pull.load.keys)
                self.stats.pull_seconds += time.perf_counter() - pull.started
            pull.load.done.set()

    def _fetch(self, pull: _Pull) -> list[bytes]:
        params = pull.params
        if params.remote_engine_id != self.engine_id:
            raise ValueError(f"the prefill engine's KV identity {params.remote_engine_id!r} is not this engine's {self.engine_id!r} "
                             "(another model or settings)")
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{params.remote_host}:{params.remote_port}")
            sock.send(json.dumps({"transfer": params.remote_request_id, "keys": [k.hex() for k in pull.load.keys]}).encode())
            if not sock.poll(int(self.timeout * 1000)):
                raise TimeoutError(f"no answer in {self.timeout:.0f} s")
            header, *payloads = sock.recv_multipart()
        finally:
            sock.close()
        answer = json.loads(header)
        if "error" in answer:
            raise ValueError(answer["error"])
        sent_keys = [bytes.fromhex(k) for k in answer["keys"]]
        got = []
        for expected, key, payload in zip(pull.load.keys, sent_keys, payloads):
            if key != expected or len(payload) != self.payload_bytes:
                break  # another prompt's (or another layout's) block: from here on, computed here
            got.append(bytes(payload))
        if len(got) < len(pull.load.keys):
            log.warning("KV transfer %s: %d of %d blocks verified (the rest are computed here)", params.remote_request_id, len(got),
                        len(pull.load.keys))
        return got
