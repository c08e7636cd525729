"""KV-cache events in vLLM's wire format, for routers that index which replica holds which prefix
(llm-d's precise prefix-cache scorer, Dynamo's KV router).

What goes out is what vLLM 0.32 publishes (vllm/distributed/kv_events.py, read, not copied): one
msgpack message per batch, `[ts, [event, ...], data_parallel_rank]` (the batch is an array), each event
a map tagged by `type` — `BlockStored` (block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind), `BlockRemoved` (block_hashes,
medium), `AllBlocksCleared` — with fields that have defaults left out when unset (checked against vLLM's
own events for the same requests: bench/vllm_contract.py). A block hash is the low 64 bits of its key, big-endian and
unsigned (vLLM's default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1); a first block's parent is nil. The
medium says where the block is: "GPU" for the engine's KV cache (whatever the device: the name routers
expect for it), "CPU" for the host tier, "STORAGE" for the disk tier.

Over ZeroMQ as vLLM sends it: a PUB socket (`endpoint`; bound when it has a `*`, `::`, or is ipc:// or
inproc://, else connected) sends `[topic, seq (8 bytes, big-endian), payload]`; with a
`replay_endpoint`, a ROUTER socket answers `[b"", start seq]` with every buffered `[seq, payload]` from
that sequence number on, then `[-1 (8 bytes, signed), b""]`. The engine records events as they happen
(the block manager, the tiers: the disk tier's writer thread too) and hands them over after each step;
one thread encodes and sends them, and answers replays, so that no socket is touched by two threads.

kvpilot's block keys are its own (SHA-256 over the parent key and the token ids, rooted in the model's
identity: block_manager.py), not vLLM's; a consumer that keys blocks by the token ids the events carry
(as llm-d's indexer does) is not affected.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import count
from typing import Any

import msgspec

log = logging.getLogger("kvpilot.kv_events")

MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"
MEDIUM_DISK = "STORAGE"
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None  # per block: what its key depends on beyond tokens and parent (vLLM: the LoRA name, …)
    group_idx: int | None = None                            # the KV-cache group (one here: every layer attends to all of its context)
    kv_cache_spec_kind: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


def external_hash(key: bytes) -> int:
    """A block key as events name it: its low 64 bits, big-endian, unsigned (vLLM's integer form)."""
    return int.from_bytes(key[-8:], "big")


class KVEventRecorder:
    """Where the block manager and the tiers say what happened to blocks, in order (a deque: its
    appends and pops are atomic, so the disk tier's writer thread records beside the engine's)."""

    def __init__(self, block_size: int, lora_name: Callable[[int], str | None] = lambda _: None,
                 is_root: Callable[[bytes], bool] = lambda _: False):
        """lora_name: an adapter id's name; is_root: whether a parent key is a chain's root (the cache's
        salt, an adapter's root: no block's key), whose first block has no parent in the events."""
        self.block_size = block_size
        self.lora_name, self.is_root = lora_name, is_root
        self._events: deque[KVCacheEvent] = deque()

    def stored(self, keys: list[bytes], parent: bytes | None, token_ids: list[int], adapter: int = 0, medium: str = MEDIUM_DEVICE) -> None:
        """Consecutive blocks of one chain joined `medium`; parent: the key before the first (None or a root: it is a first block)."""
        first = parent is None or self.is_root(parent)
        lora_name = self.lora_name(adapter) if adapter else None
        self._events.append(BlockStored([external_hash(k) for k in keys], None if first else external_hash(parent),
                                        list(token_ids), self.block_size, adapter or None, medium, lora_name,
                                        [(lora_name,) if lora_name else None] * len(keys), 0, "full_attention"))

    def removed(self, keys: list[bytes], medium: str = MEDIUM_DEVICE) -> None:
        self._events.append(BlockRemoved([external_hash(k) for k in keys], medium))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events = []
        while True:
            try:
                events.append(self._events.popleft())
            except IndexError:
                return events


class ZmqEventPublisher:
    """Publishes the recorder's events as batches over ZeroMQ (the engine calls flush() after each step;
    events recorded between steps, such as the disk tier's, go out within FLUSH_S), keeps the last
    `buffer_steps` batches for replay."""

    FLUSH_S = 0.1

    def __init__(self, recorder: KVEventRecorder, endpoint: str, replay_endpoint: str | None, buffer_steps: int, hwm: int,
                 max_queue_size: int, topic: str, data_parallel_rank: int = 0):
        import zmq

        self.recorder = recorder
        self.rank = data_parallel_rank
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = count()
        self._flushes: queue.Queue[bool] = queue.Queue(maxsize=max_queue_size)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        _bind_or_connect(self._pub, endpoint)
        self._replay = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # the port bound, when the endpoint asked for any
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay is not None else None
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvpilot-kv-events", daemon=True)
        self._thread.start()

    def flush(self) -> None:
        """A step ended: its events go out as one batch (a full queue is not waited on: the next flush takes them)."""
        try:
            self._flushes.put_nowait(True)
        except queue.Full:
            pass

    def close(self) -> None:
        if not self._running:
            return
        self._running = False
        self.flush()
        self._thread.join(timeout=2)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        import zmq

        encoder = msgspec.msgpack.Encoder()
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while self._running:
            try:
                if self._replay is not None and poller.poll(0):
                    self._answer_replay()
                try:
                    self._flushes.get(timeout=self.FLUSH_S if self._replay is None else 0.01)
                except queue.Empty:
                    pass
                self._send(encoder)
            except Exception:  # noqa: BLE001 - a publishing failure loses events, never the engine
                log.exception("KV events: publishing failed")
                time.sleep(self.FLUSH_S)
        self._send(encoder)

    def _send(self, encoder) -> None:
        events = self.recorder.take()
        if not events:
            return
        seq = next(self._seq)
        payload = encoder.encode(EventBatch(time.time(), events, self.rank))
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("KV events: a replay request of %d frames is not [identity, empty, 8-byte sequence number]: ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))


def _bind_or_connect(socket, endpoint: str) -> None:
    """vLLM's rule: a wildcard or a local transport is bound, anything else is a peer to connect to."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)
