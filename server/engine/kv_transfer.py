"""Prefill/decode disaggregation: a prefill engine holds a finished prompt's KV blocks for a decode
engine to pull, and the decode engine loads them like a KV tier read (the KV connector's P/D part,
kv_connector.py). The metadata — which blocks, under which keys, where — crosses this module's
transfer port (ZeroMQ); the K/V itself is read by every decode rank from the prefill rank of the same
index with NIXL (kv_nixl.py), straight into its cache blocks.

Prefill side (KVSender): a request with kv_transfer_params.do_remote_decode runs as usual; when it
ends, its prompt's full blocks are held (a reference each, so nothing evicts or reuses them) under a
transfer id, and its output carries the params to pass on, signed. A ROUTER socket serves a pull of
that id: the held blocks' keys and ids, the tensor-parallel size and each rank's NIXL agent; the hold
is released (by the engine's loop: the block manager is its alone) when the decode engine says its
ranks have read the blocks, or after `timeout` seconds.

Decode side (KVReceiver): a request with do_remote_prefill waits like a sequence whose blocks are on
disk while a puller thread asks the prefill engine for them. A prefill engine of another tensor
parallelism is refused by name. Each pulled block is used only when its
key is the one this engine computes for the prompt's tokens: keys chain from a salt of the engine's
identity (model files, block size, dtypes, ...), so a prefill engine of another model or settings
gives no block that counts, and a block of other tokens cannot slip in. What is not pulled (a prefill
engine gone, a timeout, a mismatch) is computed here: never wrong tokens, never a failed request for
that reason; nor is a read that fails on any rank (every rank then drops the blocks: kv_connector.py).
The prompt's last token is always computed (its logits are needed).

Trust: the engines of one pool share a secret (KVPILOT_KV_TRANSFER_SECRET; the operator makes one
per service). A key check alone cannot tell true K/V from false K/V under the right keys, and the
params name the host to connect to, so whoever may give a decode engine params could make it connect
anywhere and cache what comes back for every tenant. Hence: the prefill engine signs the params it
hands out (HMAC over where and what), and a decode engine refuses params that do not verify (a
client's: a 400) before it connects anywhere. The transfer port speaks ZeroMQ's CURVE with a key
pair derived from the secret: a peer without it never completes the handshake, so it can neither
send a frame (nor fill memory with them) nor learn where the K/V is; a pull (and the word that it was
read) also carries a MAC the prefill engine checks before it answers. The K/V crosses UCX's data path,
which carries no authentication of its own: whoever has an agent's metadata and reaches its port
could read the registered cache, so the metadata is only ever sent over the authenticated port, and
the network policy closes the data port to other pods. A pulled block is trusted as much as a member
of the pool. Without the variable an engine with kv_role both
makes up its own secret (it hands off to itself); prefill and decode engines refuse to start.

Bounds: a frame larger than a pull (or, on the decode side, than an answer) disconnects its peer
(ZeroMQ's MAXMSGSIZE), pulls run side by side on PULL_THREADS threads, and a prefill engine that
cannot be reached within PEER_CONNECT_TIMEOUT_S, or drops the connection, fails its pull at once
(its blocks are computed here) instead of after the whole timeout.

"""

from __future__ import annotations

import base64
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

from kvpilot.server.engine.kv_tiers import BlockLoad
from kvpilot.server.engine.kv_trust import mac, params_verify, sign_params
from kvpilot.server.engine.sampling_params import KVTransferParams
from kvpilot.server.engine.step_message import NixlPeer

log = logging.getLogger("kvpilot.server.kv_transfer")
PEER_CONNECT_TIMEOUT_S = 1.0   # a prefill engine not reached in this time is gone: its blocks are computed here
PULL_THREADS = 8               # pulls in flight at once (one slow or dead peer never holds up the others)
KEY_FRAME_BYTES = 70           # a block key in a request or header: 64 hex digits, quotes and a comma
FRAME_OVERHEAD_BYTES = 4096    # the rest of a request or header, and CURVE's framing
# A rank's NIXL agent in a pull's answer: its metadata (a UCX remote key per registered region: ~80 bytes each over TCP, more
# over RDMA) in base64, and its regions' addresses: a model of 128 layers with a drafter stays well within this.
PEER_ANSWER_BYTES = 1 << 20


def curve_keys(secret: bytes) -> tuple[bytes, bytes]:
    """The pool's CURVE key pair (public, secret; Z85), derived from its shared secret: every engine of
    the pool serves and connects with it. The public key is never sent in the clear (a client must know
    the server's beforehand), so it is as private as the secret."""
    secret_key = zmq.utils.z85.encode(hmac.new(secret, b"kv-transfer-curve", hashlib.sha256).digest())
    return zmq.curve_public(secret_key), secret_key


def pull_mac(secret: bytes, transfer_id: str, keys: list[str]) -> str:
    return mac(secret, b"kv-transfer-pull", transfer_id.encode(), len(keys).to_bytes(8, "little"), *map(str.encode, keys))


def done_mac(secret: bytes, transfer_id: str) -> str:
    return mac(secret, b"kv-transfer-done", transfer_id.encode())


def peer_json(peer: NixlPeer) -> dict:
    return {"agent": peer.agent, "metadata": base64.b64encode(peer.metadata).decode(), "regions": peer.regions}


def peer_from_json(value: dict) -> NixlPeer:
    return NixlPeer(str(value["agent"]), base64.b64decode(value["metadata"]), [[int(a), int(b), int(c)] for a, b, c in value["regions"]])


@dataclass(slots=True)
class RemoteBlocks:
    """Where a pulled load's blocks are read from: the prefill engine's ranks and its block ids (per
    key of the load; -1 for those from elsewhere)."""

    params: KVTransferParams
    peers: list[NixlPeer]
    block_ids: list[int]
    read_by: float                     # (monotonic) admitted after this, the blocks are not read (computed instead)
    hold_ends: float                   # (monotonic) a read not done by then may have read reused blocks: it counts as failed


@dataclass(slots=True)
class TransferStats:
    """Monotonic counters for metrics (blocks, bytes, seconds)."""

    held_transfers: int = 0          # prefill side: holds made
    sent_blocks: int = 0
    sent_bytes: int = 0
    expired_transfers: int = 0       # holds released unpulled after the timeout
    pulled_blocks: int = 0           # decode side
    pulled_bytes: int = 0
    failed_pulls: int = 0            # pulls that gave fewer blocks than asked for, or whose reads failed (computed here instead)
    pull_seconds: float = 0.0        # from asking to the blocks in the cache


@dataclass(slots=True)
class _Hold:
    block_ids: list[int]
    keys: list[bytes]
    deadline: float
    pulled: bool = False


@dataclass(slots=True)
class _Pull:
    params: KVTransferParams
    load: BlockLoad
    started: float = field(default_factory=time.perf_counter)


@dataclass(slots=True)
class _Done:
    params: KVTransferParams


class KVSender:
    def __init__(self, host: str, port: int, engine_id: str, timeout: float, secret: bytes, max_blocks: int, block_bytes: int,
                 peers: Callable[[], list[NixlPeer]]):
        """Serves on host:port, the address decode engines are told (port 0: any free port, self.port
        says which). max_blocks: the most blocks one pull can ask for; block_bytes: a block's K/V over
        every rank (for the counters); peers(): each rank's NIXL agent, rank 0's first."""
        self.engine_id, self.timeout, self.secret, self.block_bytes, self.peers = engine_id, timeout, secret, block_bytes, peers
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
        """Blocks the engine has just taken a reference on for transfer_id, until read or expired."""
        with self._lock:
            self._holds[transfer_id] = _Hold(block_ids, keys, time.monotonic() + self.timeout)
            self.stats.held_transfers += 1

    def releases(self) -> list[list[int]]:
        """Held blocks to give back now (read, or not read past the timeout): the engine's loop
        drops its references on them."""
        now, out = time.monotonic(), []
        with self._lock:
            for transfer_id in [t for t, h in self._holds.items() if h.deadline <= now]:
                held = self._holds.pop(transfer_id)
                out.append(held.block_ids)
                self.stats.expired_transfers += 1
                log.warning("KV transfer %s was not %s in %.0f s: its blocks are released", transfer_id,
                            "read" if held.pulled else "pulled", self.timeout)
        while not self._released.empty():
            out.append(self._released.get())
        return out

    def num_held_blocks(self) -> int:
        with self._lock:
            return sum(len(h.block_ids) for h in self._holds.values())

    def has_releases(self) -> bool:
        """Whether releases() has blocks to give back now: the engine's loop steps for them even when
        it has no request (an idle prefill engine kept pulled blocks held until its next request)."""
        now = time.monotonic()
        with self._lock:
            return not self._released.empty() or any(h.deadline <= now for h in self._holds.values())

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
                log.warning("KV transfer: a request failed (%s: %s)", type(e).__name__, e)
                self._socket.send_multipart([frames[0], json.dumps({"error": f"{type(e).__name__}: {e}"}).encode()])
        self._socket.close()

    def _answer(self, frames: list) -> None:
        identity, *request = frames
        if len(request) != 1:
            raise ValueError(f"a request is one frame, got {len(request)}")
        ask = json.loads(request[0].bytes)
        if not isinstance(ask, dict) or not isinstance(ask.get("mac"), str):
            raise ValueError("a request is a JSON object with a mac")
        transfer_id = str(ask.get("transfer"))
        if ask.get("op") == "done":  # the decode engine's ranks have read the blocks (or given up): the hold ends
            if not hmac.compare_digest(ask["mac"].encode(), done_mac(self.secret, transfer_id).encode()):
                raise PermissionError("the request is not signed with this pool's secret")
            with self._lock:
                held = self._holds.pop(transfer_id, None)
            if held is not None:
                self._released.put(held.block_ids)
            self._socket.send_multipart([identity, json.dumps({"released": held is not None}).encode()])
            return
        keys = ask.get("keys")
        if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
            raise ValueError("a pull has transfer, keys and mac")
        if not hmac.compare_digest(ask["mac"].encode(), pull_mac(self.secret, transfer_id, keys).encode()):
            raise PermissionError("the pull is not signed with this pool's secret")
        with self._lock:
            held = self._holds.get(transfer_id)
            pulled, fresh = held is not None and held.pulled, held is not None and not held.pulled
            if fresh:  # held for the decode ranks' reads from now on, as long again (the decode side reads within it, or not at all)
                held.pulled, held.deadline = True, time.monotonic() + self.timeout
        if not fresh:
            why = "already pulled" if pulled else "pulled, expired or never made"
            self._socket.send_multipart([identity, json.dumps({"error": f"no held transfer {transfer_id!r} to pull ({why})"}).encode()])
            return
        wanted = {bytes.fromhex(k) for k in keys}
        sent = [(k, b) for k, b in zip(held.keys, held.block_ids) if k in wanted]  # not those the decode engine has cached
        peers = self.peers()
        answer = {"engine_id": self.engine_id, "tensor_parallel_size": len(peers), "hold_seconds": self.timeout, "keys": [k.hex() for k, _ in sent],
                  "block_ids": [b for _, b in sent], "peers": [peer_json(p) for p in peers]}
        self._socket.send_multipart([identity, json.dumps(answer).encode()])
        with self._lock:
            self.stats.sent_blocks += len(sent)
            self.stats.sent_bytes += len(sent) * self.block_bytes


class KVReceiver:
    def __init__(self, engine_id: str, block_bytes: int, timeout: float, secret: bytes, tensor_parallel_size: int):
        """block_bytes: a block's K/V over every rank (for the counters)."""
        self.engine_id, self.block_bytes, self.timeout, self.secret = engine_id, block_bytes, timeout, secret
        self.tensor_parallel_size = tensor_parallel_size
        self.curve_public, self.curve_secret = curve_keys(secret)
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[_Pull | _Done | None] = queue.SimpleQueue()
        for i in range(PULL_THREADS):  # daemons: a pull in flight never holds up the process's exit
            threading.Thread(target=self._puller, name=f"kvpilot-kv-receiver-{i}", daemon=True).start()

    def pull(self, params: KVTransferParams, load: BlockLoad) -> BlockLoad:
        """Ask the prefill engine `params` names for the load's blocks past its first load.num_host
        (those from the host tier): the load is done when the answer is in, with one (empty) payload per
        block that came back and verified, in order, and where to read them (load.remote)."""
        load.source = "p2p"
        self._jobs.put(_Pull(params, load))
        return load

    def finish(self, load: BlockLoad, written: bool, seconds: float) -> None:
        """A pulled load's blocks are in the cache on every rank (written), or never will be: the
        prefill engine is told to release them (in the background: a gone one is not waited for)."""
        with self._lock:
            if written:
                n = load.num_taken - load.num_host
                self.stats.pulled_blocks += n
                self.stats.pulled_bytes += n * self.block_bytes
            else:
                self.stats.failed_pulls += 1
            self.stats.pull_seconds += seconds
        self.abandon(load)

    def abandon(self, load: BlockLoad) -> None:
        """A pulled load no longer needed (its sequence ended, was preempted, or took none of it): the
        prefill engine releases the hold now rather than at its timeout (once the answer is in, if the
        pull is in flight)."""
        with self._lock:
            if load.finished:
                return
            load.finished = True
            answered = load.done.is_set()
        if answered:
            self.release(load.remote.params if load.remote is not None else None)

    def release(self, params: KVTransferParams | None) -> None:
        """Tell the prefill engine to release a transfer's hold (a request that needed no pull of it too):
        only one the pool signed (never connect where a client's own params say)."""
        if params is not None and params_verify(self.secret, params):
            self._jobs.put(_Done(params))

    def close(self) -> None:
        for _ in range(PULL_THREADS):
            self._jobs.put(None)

    def _puller(self) -> None:
        while (job := self._jobs.get()) is not None:
            if isinstance(job, _Done):
                try:
                    self._request(job.params, {"op": "done", "transfer": job.params.remote_request_id,
                                               "mac": done_mac(self.secret, job.params.remote_request_id)}, 4096)
                except Exception as e:  # noqa: BLE001 - its hold expires instead
                    log.info("KV transfer %s: telling the prefill engine the blocks were read failed (%s: %s): its hold expires",
                             job.params.remote_request_id, type(e).__name__, e)
            else:
                self._run(job)

    def _run(self, pull: _Pull) -> None:
        load = pull.load
        try:
            self._fetch(pull)
        except Exception as e:  # noqa: BLE001 - a failed pull means computing the blocks here
            log.warning("KV transfer %s from %s:%s failed (%s: %s): computing its blocks here", pull.params.remote_request_id,
                        pull.params.remote_host, pull.params.remote_port, type(e).__name__, e)
            with self._lock:
                self.stats.failed_pulls += 1
        with self._lock:
            self.stats.pull_seconds += time.perf_counter() - pull.started
            load.done.set()
            # abandoned while the answer was on its way, or nothing of it will be read: released here, once
            release = load.finished or not load.payloads[load.num_host:]
            load.finished = load.finished or release
        if release:
            self.release(pull.params)

    def _fetch(self, pull: _Pull) -> None:
        params, load = pull.params, pull.load
        if not params_verify(self.secret, params):  # admission refused these already: never connect where unsigned params say
            raise PermissionError("the kv_transfer_params are not signed by this pool's prefill engines")
        if (params.tp_size or 1) != self.tensor_parallel_size:  # (params of engines before tp_size was signed: one rank)
            raise ValueError(f"the prefill engine runs tensor_parallel_size={params.tp_size or 1} and this decode engine "
                             f"{self.tensor_parallel_size}: a decode engine pulls from a prefill engine of the same tensor parallelism")
        if params.remote_engine_id != self.engine_id:
            raise ValueError(f"the prefill engine's KV identity {params.remote_engine_id!r} is not this engine's {self.engine_id!r} "
                             "(another model or settings)")
        asked = load.keys[load.num_host:]
        keys = [k.hex() for k in asked]
        answer = self._request(params, {"op": "pull", "transfer": params.remote_request_id, "keys": keys,
                                        "mac": pull_mac(self.secret, params.remote_request_id, keys)},
                               FRAME_OVERHEAD_BYTES + (KEY_FRAME_BYTES + 24) * len(keys) + PEER_ANSWER_BYTES * self.tensor_parallel_size)
        if "error" in answer:
            raise ValueError(answer["error"])
        size = answer.get("tensor_parallel_size")
        if size != self.tensor_parallel_size:
            raise ValueError(f"the prefill engine runs tensor_parallel_size={size} and this decode engine {self.tensor_parallel_size}: "
                             "a decode engine pulls from a prefill engine of the same tensor parallelism")
        if answer.get("engine_id") != self.engine_id:
            raise ValueError(f"the prefill engine's KV identity {answer.get('engine_id')!r} is not this engine's {self.engine_id!r} "
                             "(another model or settings)")
        peers = [peer_from_json(p) for p in answer["peers"]]
        if len(peers) != size:
            raise ValueError(f"the prefill engine named {len(peers)} ranks' agents for tensor_parallel_size={size}")
        verified = 0
        for expected, key in zip(keys, answer["keys"]):
            if key != expected:
                break  # another prompt's block: from here on, computed here
            verified += 1
        if verified < len(keys):
            log.warning("KV transfer %s: %d of %d blocks verified (the rest are computed here)", params.remote_request_id, verified, len(keys))
            with self._lock:
                self.stats.failed_pulls += 1
        hold = float(answer.get("hold_seconds", self.timeout))
        load.payloads.extend([None] * verified)
        # read only well within the prefill engine's hold (it restarted when it answered): past it, its blocks may be reused
        now = time.monotonic()
        load.remote = RemoteBlocks(params, peers, [-1] * load.num_host + [int(b) for b in answer["block_ids"][:verified]],
                                   now + 0.8 * hold - 1, now + hold - 1)

    def _request(self, params: KVTransferParams, ask: dict, max_answer: int) -> dict:
        """One request to the prefill engine's transfer port, its JSON answer."""
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_serverkey = sock.curve_publickey = self.curve_public
        sock.curve_secretkey = self.curve_secret
        sock.setsockopt(zmq.MAXMSGSIZE, max_answer)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)
        try:
            sock.connect(f"tcp://{params.remote_host}:{params.remote_port}")
            sock.send(json.dumps(ask).encode())
            frames = self._answer(sock, monitor)
        finally:
            sock.disable_monitor()
            monitor.close()
            sock.close()
        answer = json.loads(frames[0].bytes)
        if not isinstance(answer, dict):
            raise ValueError("the prefill engine's answer is not a JSON object")
        return answer

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
