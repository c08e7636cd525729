"""Prefill/decode disaggregation: a prefill engine holds a finished prompt's KV blocks for a decode
engine to pull over TCP (ZeroMQ), and the decode engine loads them like a KV tier read.

Prefill side (KVSender): a request with kv_transfer_params.do_remote_decode runs as usual; when it
ends, its prompt's full blocks are held (a reference each, so nothing evicts or reuses them) under a
transfer id, and its output carries the params to pass on, signed. A ROUTER socket serves a pull of
that id: the held blocks' keys and K/V, then the hold is released (by the engine's loop: the block
manager is its alone). A hold nobody pulls is released after `timeout` seconds.

Decode side (KVReceiver): a request with do_remote_prefill waits like a sequence whose blocks are on
disk while a puller thread asks the prefill engine for them. Each pulled block is used only when its
key is the one this engine computes for the prompt's tokens: keys chain from a salt of the engine's
identity (model files, block size, dtypes, ...), so a prefill engine of another model or settings
gives no block that counts, and a block of other tokens cannot slip in. What is not pulled (a prefill
engine gone, a timeout, a mismatch) is computed here: never wrong tokens, never a failed request for
that reason. The prompt's last token is always computed (its logits are needed).

Trust: the engines of one pool share a secret (KVPILOT_KV_TRANSFER_SECRET; the operator makes one
per service). A key check alone cannot tell true K/V from false K/V under the right keys, and the
params name the host to connect to, so whoever may give a decode engine params could make it connect
anywhere and cache what comes back for every tenant. Hence: the prefill engine signs the params it
hands out (HMAC over where and what), and a decode engine refuses params that do not verify (a
client's: a 400) before it connects anywhere. The transfer port speaks ZeroMQ's CURVE with a key
pair derived from the secret: a peer without it never completes the handshake, so it can neither
send a frame (nor fill memory with them) nor read the K/V, which crosses the network encrypted and
authenticated; a pull also carries a MAC the prefill engine checks before it sends a byte. A pulled
block is trusted as much as a member of the pool. Without the variable an engine with kv_role both
makes up its own secret (it hands off to itself); prefill and decode engines refuse to start.

Bounds: a frame larger than a pull (or, on the decode side, than a block) disconnects its peer
(ZeroMQ's MAXMSGSIZE), pulls run side by side on PULL_THREADS threads, and a prefill engine that
cannot be reached within PEER_CONNECT_TIMEOUT_S, or drops the connection, fails its pull at once
(its blocks are computed here) instead of after the whole timeout.

The transport is plain TCP through ZeroMQ, K/V copied through host memory: on GPUs with RDMA, NIXL/UCX
would move blocks device to device instead (what vLLM's NixlConnector does); the protocol here (pull
by transfer id, verify by key) would stay.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.utils.monitor
import zmq.utils.z85

from kvpilot.server.engine.block_manager import block_hash
from kvpilot.server.engine.kv_tiers import BlockLoad, Payload
from kvpilot.server.engine.kv_trust import mac, params_verify, sign_params
from kvpilot.server.engine.sampling_params import KVTransferParams

log = logging.getLogger("kvpilot.server.kv_transfer")
PEER_CONNECT_TIMEOUT_S = 1.0   # a prefill engine not reached in this time is gone: its blocks are computed here
PULL_THREADS = 8               # pulls in flight at once (one slow or dead peer never holds up the others)
KEY_FRAME_BYTES = 70           # a block key in a request or header: 64 hex digits, quotes and a comma
FRAME_OVERHEAD_BYTES = 4096    # the rest of a request or header, and CURVE's framing


def curve_keys(secret: bytes) -> tuple[bytes, bytes]:
    """The pool's CURVE key pair (public, secret; Z85), derived from its shared secret: every engine of
    the pool serves and connects with it. The public key is never sent in the clear (a client must know
    the server's beforehand), so it is as private as the secret."""
    secret_key = zmq.utils.z85.encode(hmac.new(secret, b"kv-transfer-curve", hashlib.sha256).digest())
    return zmq.curve_public(secret_key), secret_key


def pull_mac(secret: bytes, transfer_id: str, keys: list[str]) -> str:
    return mac(secret, b"kv-transfer-pull", transfer_id.encode(), len(keys).to_bytes(8, "little"), *map(str.encode, keys))


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
    def __init__(self, host: str, port: int, read_block: Callable[[int], Payload], engine_id: str, timeout: float, secret: bytes,
                 max_blocks: int):
        """Serves on host:port, the address decode engines are told (port 0: any free port, self.port
        says which). read_block: a held block's K/V (the worker's block_bytes, called from the server
        thread: held blocks do not change). max_blocks: the most blocks one pull can ask for."""
        self.read_block, self.engine_id, self.timeout, self.secret = read_block, engine_id, timeout, secret
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._holds: dict[str, _Hold] = {}
        self._released: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.curve_publickey, self._socket.curve_secretkey = curve_keys(secret)
        self._socket.curve_server = True
        self._socket.setsockopt(zmq.MAXMSGSIZE, FRAME_OVERHEAD_BYTES + KEY_FRAME_BYTES * max_blocks)  # larger: not a pull
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

    def has_releases(self) -> bool:
        """Whether releases() has blocks to give back now: the engine's loop steps for them even when
        it has no request (an idle prefill engine kept pulled blocks held until its next request)."""
        with self._lock:  # holds are made in deadline order (one timeout): the first expires first
            first = next(iter(self._holds.values()), None)
            return not self._released.empty() or (first is not None and first.deadline <= time.monotonic())

    def sign(self, params: dict) -> dict:
        return {**params, "signature": sign_params(self.secret, params)}

    def close(self) -> None:
        """Stop serving (pulls after this get no answer: their blocks are computed by the decode side)."""
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(5)

    def _serve(self) -> None:
        while not self._closed.is_set():
            if not self._socket.poll(100):
                continue
            frames = self._socket.recv_multipart(copy=False)
            try:
                self._answer(frames)
            except Exception as e:  # noqa: BLE001 - whatever a peer sends, the server goes on
                log.warning("KV transfer: a pull failed (%s: %s)", type(e).__name__, e)
                self._socket.send_multipart([frames[0], json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()])
        self._socket.close()

    def _answer(self, frames: list) -> None:
        identity, *request = frames
        if len(request) != 1:
            raise ValueError(f"a pull is one frame, got {len(request)}")
        ask = json.loads(request[0].bytes)
        if not isinstance(ask, dict):
            raise ValueError("a pull is a JSON object")
        transfer_id, keys = str(ask.get("transfer")), ask.get("keys")
        if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys) and isinstance(ask.get("mac"), str)):
            raise ValueError("a pull has transfer, keys and mac")
        if not hmac.compare_digest(ask["mac"].encode(), pull_mac(self.secret, transfer_id, keys).encode()):
            raise PermissionError("the pull is not signed with this pool's secret")
        with self._lock:
            held = self._holds.pop(transfer_id, None)
        if held is None:
            self._socket.send_multipart([identity, json.dumps({"error": f"no held transfer {transfer_id!r} (pulled, expired or never made)"}).encode()])
            return
        try:
            wanted = {bytes.fromhex(k) for k in keys}
            sent = [(k, b) for k, b in zip(held.keys, held.block_ids) if k in wanted]  # not those the decode engine has cached
            payloads = [self.read_block(b) for _, b in sent]
            payloads = [p if isinstance(p, bytes) else p.result() for p in payloads]
        finally:
            self._released.put(held.block_ids)
        header = {"engine_id": self.engine_id, "keys": [k.hex() for k, _ in sent]}
        self._socket.send_multipart([identity, json.dumps(header).encode(), *payloads], copy=False)
        with self._lock:
            self.stats.sent_blocks += len(payloads)
            self.stats.sent_bytes += sum(len(p) for p in payloads)


class KVReceiver:
    def __init__(self, engine_id: str, payload_bytes: int, timeout: float, secret: bytes):
        self.engine_id, self.payload_bytes, self.timeout, self.secret = engine_id, payload_bytes, timeout, secret
        self.curve_public, self.curve_secret = curve_keys(secret)
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._pulls: queue.SimpleQueue[_Pull | None] = queue.SimpleQueue()
        for i in range(PULL_THREADS):  # daemons: a pull in flight never holds up the process's exit
            threading.Thread(target=self._puller, name=f"kvpilot-kv-receiver-{i}", daemon=True).start()

    def pull(self, params: KVTransferParams, parent: bytes, chunks: list[tuple[int, ...]], first_index: int) -> BlockLoad:
        """A pull of the blocks chained from `parent` over `chunks` from the prefill engine `params`
        names; its payloads are those that came back and verified, in order (done when it ends)."""
        keys = []
        for chunk in chunks:
            parent_key = keys[-1] if keys else parent
            keys.append(block_hash(parent_key, chunk))
        load = BlockLoad(first_index, parent, keys, [tuple(c) for c in chunks], source="p2p")
        self._pulls.put(_Pull(params, load))
        return load

    def close(self) -> None:
        for _ in range(PULL_THREADS):
            self._pulls.put(None)

    def _puller(self) -> None:
        while (pull := self._pulls.get()) is not None:
            self._run(pull)

    def _run(self, pull: _Pull) -> None:
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
        if not params_verify(self.secret, params):  # admission refused these already: never connect where unsigned params say
            raise PermissionError("the kv_transfer_params are not signed by this pool's prefill engines")
        if params.remote_engine_id != self.engine_id:
            raise ValueError(f"the prefill engine's KV identity {params.remote_engine_id!r} is not this engine's {self.engine_id!r} "
                             "(another model or settings)")
        keys = [k.hex() for k in pull.load.keys]
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_serverkey = sock.curve_publickey = self.curve_public
        sock.curve_secretkey = self.curve_secret
        # (an encrypted frame is a little larger than what it carries: CURVE's box and nonce)
        sock.setsockopt(zmq.MAXMSGSIZE, FRAME_OVERHEAD_BYTES + max(self.payload_bytes, KEY_FRAME_BYTES * len(keys)))
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        try:
            sock.connect(f"tcp://{params.remote_host}:{params.remote_port}")
            sock.send(json.dumps({"transfer": params.remote_request_id, "keys": keys, "mac": pull_mac(self.secret, params.remote_request_id, keys)}).encode())
            frames = self._answer(sock, monitor)
        finally:
            sock.disable_monitor()
            monitor.close()
            sock.close()
        header, *payloads = frames
        answer = json.loads(header.bytes)
        if "error" in answer:
            raise ValueError(answer["error"])
        sent_keys = answer["keys"]
        got = []
        for expected, key, payload in zip(pull.load.keys, sent_keys, payloads):
            if key != expected.hex() or len(payload) != self.payload_bytes:
                break  # another prompt's (or another layout's) block: from here on, computed here
            got.append(payload.bytes)
        if len(got) < len(pull.load.keys):
            log.warning("KV transfer %s: %d of %d blocks verified (the rest are computed here)", params.remote_request_id, len(got),
                        len(pull.load.keys))
        return got

    def _answer(self, sock, monitor) -> list:
        """The answer's frames: the peer must be reached within PEER_CONNECT_TIMEOUT_S and answer within
        the timeout, and a dropped connection ends the wait at once."""
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        start, connected = time.monotonic(), False
        while True:
            limit = self.timeout if connected else PEER_CONNECT_TIMEOUT_S
            left = start + limit - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer in {self.timeout:.0f} s" if connected else
                                   f"the prefill engine was not reached in {PEER_CONNECT_TIMEOUT_S:.0f} s")
            ready = dict(poller.poll(left * 1000))
            if sock in ready:
                return sock.recv_multipart(copy=False)
            if monitor in ready:
                event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    connected = True
                elif event in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED):
                    raise ConnectionError("the prefill engine dropped the connection")
