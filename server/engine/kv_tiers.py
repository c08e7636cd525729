"""The disk tier of the KV cache: full blocks' K/V in files named by their SHA-256 block key, under a
directory that several engines (replicas on one shared volume, or one engine across restarts) may use.

A block computed here is saved after the step that completed it (the engine copies it off the cache,
a writer thread writes the file: tmp file + rename, so readers never see half a file). A waiting
sequence whose prompt continues past the in-memory prefix cache with blocks on disk has them read and
verified by a reader thread while other sequences' steps go on; the scheduler passes over it until the
read is done, then admits it with those blocks counted as computed, and the runner writes them into the
fresh cache blocks before the step's forward pass.

A file is trusted only when everything in it matches what the reader asked for: the magic, its key,
parent key and token ids (and the key recomputed from those two), the K/V layout (dtype and shape) and
the SHA-256 of its payload. A torn, truncated, corrupted, foreign (another model's keys differ: the
engine's salt is the chain's root) or mismatched file is a miss — its block is computed — never wrong
tokens. The directory is bounded by size: least recently used files (by modification time, touched on
each hit) go first.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvpilot.server.engine.block_manager import block_hash

log = logging.getLogger("kvpilot.server.kv_tiers")
MAGIC = b"KVPILOT-KV-BLOCK-1\n"
SUFFIX = ".kvblock"
MAX_HEADER = 1 << 20


@dataclass(slots=True)
class TierStats:
    """Monotonic counters (blocks, bytes, seconds) for metrics."""

    hit_blocks: int = 0
    miss_blocks: int = 0               # files looked for and absent, or present and refused (below)
    refused_files: int = 0             # torn, corrupted, foreign or mismatched files
    loaded_bytes: int = 0
    saved_blocks: int = 0
    saved_bytes: int = 0
    dropped_saves: int = 0             # the writer was too far behind: a block was not saved
    evicted_files: int = 0
    load_seconds: float = 0.0
    save_seconds: float = 0.0


@dataclass(slots=True)
class BlockLoad:
    """A waiting sequence's read from the disk tier: blocks first_index, first_index + 1, ... of its
    prompt, as far as the files were found and verified (payloads in chain order)."""

    first_index: int
    parent: bytes                      # the key before the first block's
    keys: list[bytes]
    chunks: list[tuple[int, ...]]      # each block's token ids
    payloads: list[bytes] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)


class DiskTier:
    def __init__(self, directory: str | Path, max_bytes: int, layout: tuple[str, tuple[int, ...]], payload_bytes: int,
                 max_pending_bytes: int = 256 << 20):
        """layout: the K/V's dtype name and shape of one block as the runner gives it; payload_bytes:
        its size. Saves beyond max_pending_bytes in the writer's queue are dropped (counted)."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.layout, self.payload_bytes = max_bytes, [layout[0], list(layout[1])], payload_bytes
        self.max_pending_bytes = max_pending_bytes
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> size, least recently used first
        self._pending_bytes = 0
        self._queued: set[bytes] = set()
        self._scan()
        self._saves: queue.Queue = queue.Queue()
        self._loads: queue.Queue = queue.Queue()
        threading.Thread(target=self._writer, name="kvpilot-kv-tier-writer", daemon=True).start()
        threading.Thread(target=self._reader, name="kvpilot-kv-tier-reader", daemon=True).start()

    # --- files ----------------------------------------------------------------------------
    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.dir / name[:2] / (name + SUFFIX)

    def has(self, key: bytes) -> bool:
        return key in self._queued or self.path(key).is_file()

    def _scan(self) -> None:
        """The directory's files, oldest first (what other engines wrote too)."""
        found = []
        for sub in self.dir.iterdir() if self.dir.is_dir() else ():
            if sub.is_dir() and len(sub.name) == 2:
                for f in sub.iterdir():
                    if f.name.endswith(SUFFIX):
                        try:
                            st = f.stat()
                        except OSError:
                            continue
                        found.append((st.st_mtime, f.name, st.st_size))
        with self._lock:
            self._index = OrderedDict((name, size) for _, name, size in sorted(found))

    def encode(self, key: bytes, parent: bytes, token_ids: tuple[int, ...], payload: bytes) -> bytes:
        header = json.dumps({"key": key.hex(), "parent": parent.hex(), "tokens": list(token_ids), "layout": self.layout,
                             "sha256": hashlib.sha256(payload).hexdigest()}, separators=(",", ":")).encode()
        return MAGIC + struct.pack("<I", len(header)) + header + payload

    def decode(self, data: bytes, key: bytes, parent: bytes, token_ids: tuple[int, ...]) -> bytes | None:
        """The payload of a file's bytes if it is the block asked for, intact; else None (why: logged)."""
        def refuse(why: str) -> None:
            log.warning("disk tier: %s refused (%s): computing the block instead", self.path(key).name, why)
            with self._lock:
                self.stats.refused_files += 1

        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
            return refuse("not a kvpilot KV block file")
        (size,) = struct.unpack_from("<I", data, len(MAGIC))
        start = len(MAGIC) + 4
        if size > MAX_HEADER or len(data) < start + size:
            return refuse("truncated header")
        try:
            header = json.loads(data[start:start + size])
            recorded = (bytes.fromhex(header["key"]), bytes.fromhex(header["parent"]), tuple(header["tokens"]))
        except (ValueError, KeyError, TypeError):
            return refuse("unreadable header")
        if recorded != (key, parent, tuple(token_ids)):
            return refuse("another block's key, parent or tokens")
        if block_hash(parent, token_ids) != key:
            return refuse("its key is not its parent's and tokens' hash")
        if header.get("layout") != self.layout:
            return refuse(f"K/V layout {header.get('layout')}, this engine's is {self.layout}")
        payload = data[start + size:]
        if len(payload) != self.payload_bytes:
            return refuse(f"{len(payload)} payload bytes, {self.payload_bytes} expected (truncated?)")
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            return refuse("payload checksum mismatch (corrupted)")
        return payload

    # --- loads ----------------------------------------------------------------------------
    def lookup(self, parent: bytes, chunks: list[tuple[int, ...]], first_index: int) -> BlockLoad | None:
        """A read of the blocks whose files exist, chained from `parent` over `chunks` (the prompt's full
        blocks past the in-memory hits), queued for the reader; None when the first is not on disk."""
        keys, first_parent = [], parent
        for chunk in chunks:
            key = block_hash(parent, chunk)
            if not self.path(key).is_file():
                break
            keys.append(key)
            parent = key
        if not keys:
            if chunks:
                with self._lock:
                    self.stats.miss_blocks += 1
            return None
        load = BlockLoad(first_index, first_parent, keys, [tuple(c) for c in chunks[:len(keys)]])
        self._loads.put(load)
        return load

    def _reader(self) -> None:
        while True:
            load = self._loads.get()
            started = time.perf_counter()
            parent = load.parent
            try:
                for key, chunk in zip(load.keys, load.chunks):
                    try:
                        data = self.path(key).read_bytes()
                    except OSError:
                        data = b""
                    payload = self.decode(data, key, parent, chunk) if data else None
                    if payload is None:
                        if data:
                            self._discard(key)  # the block is computed and saved again
                        with self._lock:
                            self.stats.miss_blocks += 1
                        break
                    load.payloads.append(payload)
                    self._touch(key, len(data))
                    parent = key
                with self._lock:
                    self.stats.hit_blocks += len(load.payloads)
                    self.stats.loaded_bytes += sum(map(len, load.payloads))
                    self.stats.load_seconds += time.perf_counter() - started
            except Exception:  # noqa: BLE001 - a read that fails is a miss; the reader goes on
                log.exception("disk tier: reading blocks failed")
            finally:
                load.done.set()

    def _discard(self, key: bytes) -> None:
        path = self.path(key)
        with self._lock:
            self._index.pop(path.name, None)
        try:
            path.unlink()
        except FileNotFoundError:
            pass

    def _touch(self, key: bytes, size: int) -> None:
        name = self.path(key).name
        try:
            os.utime(self.path(key))
        except OSError:
            pass
        with self._lock:
            self._index[name] = size
            self._index.move_to_end(name)

    # --- saves ----------------------------------------------------------------------------
    def save(self, key: bytes, parent: bytes, token_ids: tuple[int, ...], read_payload: Callable[[], bytes]) -> None:
        """Queue a computed block for the writer (a block already on disk or queued is skipped);
        read_payload copies its K/V off the cache now, before the block can be reused."""
        if self.has(key):
            return
        with self._lock:
            if self._pending_bytes + self.payload_bytes > self.max_pending_bytes:
                self.stats.dropped_saves += 1
                return
            self._pending_bytes += self.payload_bytes
            self._queued.add(key)
        self._saves.put((key, parent, token_ids, read_payload()))

    def _writer(self) -> None:
        while True:
            key, parent, token_ids, payload = self._saves.get()
            started = time.perf_counter()
            try:
                data = self.encode(key, parent, token_ids, payload)
                target = self.path(key)
                target.parent.mkdir(exist_ok=True)
                tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
                with open(tmp, "wb") as f:
                    f.write(data)
                os.replace(tmp, target)  # atomic: a reader sees the old state or the whole file
                with self._lock:
                    self._index[target.name] = len(data)
                    self._index.move_to_end(target.name)
                    self.stats.saved_blocks += 1
                    self.stats.saved_bytes += len(data)
                    self.stats.save_seconds += time.perf_counter() - started
                self._evict()
            except OSError as e:
                log.warning("disk tier: saving a block failed (%s)", e)
            finally:
                with self._lock:
                    self._pending_bytes -= self.payload_bytes
                    self._queued.discard(key)

    def _evict(self) -> None:
        """Least recently used files go until the directory is within max_bytes (what other engines
        wrote is counted once it was seen: at start, on a hit, or at a rescan when over the bound)."""
        with self._lock:
            over = sum(self._index.values()) > self.max_bytes
        if not over:
            return
        self._scan()
        while True:
            with self._lock:
                if sum(self._index.values()) <= self.max_bytes or not self._index:
                    return
                name, _ = self._index.popitem(last=False)
                self.stats.evicted_files += 1
            try:
                (self.dir / name[:2] / name).unlink()
            except FileNotFoundError:
                pass

    def drain(self, timeout: float = 30) -> None:
        """Wait until every queued save is written (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queued and time.monotonic() < deadline:
            time.sleep(0.01)

    def total_bytes(self) -> int:
        with self._lock:
            return sum(self._index.values())
