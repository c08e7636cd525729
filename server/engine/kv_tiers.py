"""The tiers below the KV cache (the KV connector, kv_connector.py, chains them): a host tier (blocks
in host memory, least recently used out first) and a disk tier, full blocks' K/V in files named by
their SHA-256 block key, under a directory that several engines (replicas on one shared volume, or one
engine across restarts) may use. A block is saved to each tier; a lookup takes what the host tier holds
of a prompt's chain, then what the disk holds after it.

A block computed here is saved after the step that completed it (the engine copies it off the cache,
a writer thread writes the file: tmp file + rename, so readers never see half a file). A waiting
sequence whose prompt continues past the in-memory prefix cache with blocks on disk has them read and
verified between the engine's steps — all at once when nothing else runs, else a slice of each step's
time, so other sequences' steps go on — while the scheduler passes over it; once the read is done it is
admitted with those blocks counted as computed, and the worker writes them into fresh cache blocks
before a step's forward pass (a few per step while other sequences run; it computes once all are).

Under tensor parallelism each rank saves its own shard of a block (`<key>-<rank>.kvblock`; the keys
of a tensor-parallel engine differ from a single-process one's, its salt holds the world size) and
reads it back itself when the block is written, verified as rank 0 verifies its own ahead: when one
rank's shard fails, every rank drops the load and the block is computed (a block is loaded on all
ranks or on none). Rank 0 keeps the directory's index and evicts a block's shards together. The host
tier is per rank too: rank 0's decides what is held and evicted, the others hold their shards of it.

A file is trusted only when everything in it matches what the reader asked for: the magic, its key,
parent key and token ids (and the key recomputed from those two), its rank, the K/V layout (dtype and
shape) and the CRC-32 of its payload. A torn, truncated, corrupted, foreign (another model's keys
differ: the engine's salt is the chain's root) or mismatched file is a miss — its block is computed —
never wrong tokens; such a file is removed (or, when it cannot be, remembered and not read again). The
directory is bounded by size: least recently used blocks (by modification time, touched on each hit) go
first; a file that cannot be deleted (immutable, another uid's on a shared volume) is passed over,
remembered and still counted. Temporary files a crashed writer left are removed once stale. A file
that cannot be read (another uid's 0600 file) is dropped as a refused one is; one not named as a block's
file is ignored (logged once). A save that fails, however, is logged and lost alone: the writer goes on.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import struct
import threading
import time
import weakref
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from kvpilot.server.engine.block_manager import block_hash, chained
from kvpilot.server.engine.kv_events import MEDIUM_DISK, MEDIUM_HOST, KVEventRecorder

log = logging.getLogger("kvpilot.server.kv_tiers")
MAGIC = b"KVPILOT-KV-BLOCK-2\n"  # 2: the payload's checksum is a CRC-32 (1: SHA-256)
SUFFIX = ".kvblock"
BLOCK_NAME = re.compile(r"[0-9a-f]{64}(-[0-9]+)?" + re.escape(SUFFIX))  # <key in hex>[-<rank>].kvblock, as path() writes
MAX_HEADER = 1 << 20
# A temporary file older than this is a crashed writer's and is removed at a scan. A younger one may be
# another replica's save in progress on a shared volume (a block's file is written in milliseconds): it
# is left alone, and counted once renamed. Were a writer stalled this long, its rename fails: one lost save.
STALE_TMP_SECONDS = 600
READ_ARENA_BYTES = 128 << 20


class PendingCopy(Protocol):
    """A block's K/V still being copied off the device (the worker's HostCopy on CUDA)."""

    def result(self) -> bytes: ...


Payload = bytes | memoryview | PendingCopy  # one rank's K/V of one block, in the worker's block_layout()


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
    """A waiting sequence's blocks from outside the cache (kv_connector.py): blocks first_index,
    first_index + 1, ... of its prompt, from the host tier (the first num_host), then from `source`:
    the disk tier (read and verified between steps, rank 0's shard; the other ranks read theirs when
    the blocks are written) or a prefill engine (p2p: every rank reads its shard then)."""

    first_index: int
    parent: bytes                      # the key before the first block's
    keys: list[bytes]
    chunks: list[tuple[int, ...]]      # each block's token ids
    payloads: list[Payload | None] = field(default_factory=list)  # rank 0's K/V of each block found so far (None: read when written)
    done: threading.Event = field(default_factory=threading.Event)
    num_read: int = 0                  # of keys, read (or refused) so far
    num_host: int = 0                  # leading payloads from the host tier (the rest from `source`)
    source: str = "disk"               # where the others come from: disk, p2p (a prefill engine)
    remote: Any = None                 # p2p: kv_transfer.RemoteBlocks (the prefill engine's ranks and block ids)
    num_taken: int = 0                 # blocks the scheduler took at admission
    num_written: int = 0               # of them, written into the cache on every rank
    finished: bool = False             # p2p: the prefill engine was told it may release the blocks


class DiskTier:
    def __init__(self, directory: str | Path, max_bytes: int, layout: list, payload_bytes: int,
                 rank: int = 0, world_size: int = 1, max_pending_bytes: int = 256 << 20, events: KVEventRecorder | None = None):
        """layout: the regions' dtype names and block shapes of one block (this rank's shard) as the
        worker gives them; payload_bytes: its size. Rank 0 keeps the index (every rank's files) and reads
        its shards ahead (read(), on the engine's thread); every rank writes its shards and reads them
        when their blocks are written (read_block). Saves beyond max_pending_bytes in
        the writer's queue are dropped (counted). events: told of the blocks this engine writes and deletes
        (not those of other replicas sharing the directory: theirs announce them)."""
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.layout, self.payload_bytes = max_bytes, layout, payload_bytes
        self.rank, self.world_size = rank, world_size
        self.max_pending_bytes = max_pending_bytes
        self.events = events
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key (hex) -> bytes of its files, least recently used first
        # Files that could not be deleted -> their bytes: out of the index, never tried again, still counted
        # (they fill the disk as any other); forgotten once a scan no longer finds them.
        self._undeletable: dict[Path, int] = {}
        self._bad: set[Path] = set()  # refused files that could not be deleted: a lookup passes over them
        self._unreadable: set[Path] = set()  # files this engine may not read (kept bad while they exist)
        self._strays: set[Path] = set()  # files named as no block is (logged when first seen): not counted, never evicted
        self._pending_bytes = 0
        self._queued: set[bytes] = set()
        if rank == 0:
            self._scan()
        self._saves: queue.Queue = queue.Queue()
        threading.Thread(target=self._writer, name="kvpilot-kv-tier-writer", daemon=True).start()
        self._loads: deque[BlockLoad] = deque()  # rank 0's reads not done yet, oldest first
        # Files are read into rows of one arena made (its pages touched) at start: fresh memory per block
        # cost more in page faults than reading the block (~1 ms per 720 KB here), in a fresh process most.
        # A row is free again once nothing holds its payload (written into the cache, or dropped with its
        # sequence); while every row is taken, reads go into fresh buffers.
        self._buffer_bytes = payload_bytes + (64 << 10)  # a file: its header (~1 KB) and payload
        self._arena = torch.zeros((max(1, min(READ_ARENA_BYTES, max_bytes) // self._buffer_bytes), self._buffer_bytes),
                                  dtype=torch.uint8).numpy()
        self._free_rows: list[int] = list(range(len(self._arena)))

    # --- files ----------------------------------------------------------------------------
    def path(self, key: bytes, rank: int | None = None) -> Path:
        name = key.hex()
        shard = "" if self.world_size == 1 else f"-{self.rank if rank is None else rank}"
        return self.dir / name[:2] / f"{name}{shard}{SUFFIX}"

    def has(self, key: bytes) -> bool:
        return key in self._queued or self.path(key).is_file()

    def _scan(self) -> None:
        """The directory's blocks, least recently used first (what other engines wrote too); stale
        temporary files removed (those that cannot be: counted as undeletable)."""
        found: dict[str, list] = {}
        undeletable: dict[Path, int] = {}
        strays: set[Path] = set()
        with self._lock:
            known = set(self._undeletable)  # those the engine's thread adds meanwhile are kept (below)
        stale_before = time.time() - STALE_TMP_SECONDS
        for sub in _listing(self.dir):
            if len(sub.name) != 2:
                continue
            for f in _listing(sub):
                is_tmp = f.name.startswith(".") and f.name.endswith(".tmp")
                if not (is_tmp or f.name.endswith(SUFFIX)):
                    continue
                if not is_tmp and not (BLOCK_NAME.fullmatch(f.name) and f.name[:2] == sub.name):
                    # Not a key's file (another tool's, or misplaced): the index names blocks by their key,
                    # which eviction decodes, and deleting it would delete some other file than this one.
                    if f not in self._strays:
                        log.warning("disk tier: %s is not named as a block's file is: ignored (not counted, not evicted)", f)
                    strays.add(f)
                    continue
                try:
                    st = f.stat()
                except OSError:
                    continue
                if f in known:
                    undeletable[f] = st.st_size
                elif is_tmp:
                    if st.st_mtime < stale_before and not self._delete(f):
                        undeletable[f] = st.st_size
                else:
                    entry = found.setdefault(f.name[:64], [0.0, 0])
                    entry[0], entry[1] = max(entry[0], st.st_mtime), entry[1] + st.st_size
        with self._lock:
            self._index = OrderedDict((key, size) for key, (_, size) in sorted(found.items(), key=lambda kv: kv[1][0]))
            self._undeletable = undeletable | {f: size for f, size in self._undeletable.items() if f not in known}
            self._unreadable = {f for f in self._unreadable if f.exists()}
            self._bad &= self._undeletable.keys() | self._unreadable
        self._strays = strays

    def _delete(self, path: Path) -> bool:
        """Delete a file; False when it cannot be (logged: this is asked once per file)."""
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("disk tier: %s cannot be deleted (%s): passed over, still counted", path, e)
            return False
        return True

    def header(self, key: bytes, parent: bytes, token_ids: tuple[int, ...], payload: bytes) -> bytes:
        """What a block's file holds before its payload."""
        header = json.dumps({"key": key.hex(), "parent": parent.hex(), "tokens": list(token_ids), "rank": [self.rank, self.world_size],
                             "layout": self.layout, "crc32": zlib.crc32(payload)}, separators=(",", ":")).encode()
        return MAGIC + struct.pack("<I", len(header)) + header

    def decode(self, data: bytes | memoryview, key: bytes, parent: bytes, token_ids: tuple[int, ...], rank: int = 0) -> memoryview | None:
        """The payload of a file's bytes if it is rank's shard of the block asked for, intact; else None (why: logged)."""
        def refuse(why: str) -> None:
            log.warning("disk tier: %s refused (%s): computing the block instead", self.path(key, rank).name, why)
            with self._lock:
                self.stats.refused_files += 1

        if bytes(data[:len(MAGIC)]) != MAGIC or len(data) < len(MAGIC) + 4:
            return refuse("not a kvpilot KV block file")
        (size,) = struct.unpack_from("<I", data, len(MAGIC))
        start = len(MAGIC) + 4
        if size > MAX_HEADER or len(data) < start + size:
            return refuse("truncated header")
        try:
            header = json.loads(bytes(data[start:start + size]))
            recorded = (bytes.fromhex(header["key"]), bytes.fromhex(header["parent"]), tuple(header["tokens"]))
        except Exception as e:  # noqa: BLE001 - whatever a file holds (a RecursionError: nesting too deep) is a miss
            return refuse(f"unreadable header: {type(e).__name__}")
        if recorded != (key, parent, tuple(token_ids)):
            return refuse("another block's key, parent or tokens")
        if block_hash(parent, token_ids) != key:
            return refuse("its key is not its parent's and tokens' hash")
        if header.get("rank") != [rank, self.world_size]:
            return refuse(f"rank {header.get('rank')}, {[rank, self.world_size]} expected")
        if header.get("layout") != self.layout:
            return refuse(f"K/V layout {header.get('layout')}, this engine's is {self.layout}")
        payload = memoryview(data)[start + size:]
        if len(payload) != self.payload_bytes:
            return refuse(f"{len(payload)} payload bytes, {self.payload_bytes} expected (truncated?)")
        if zlib.crc32(payload) != header.get("crc32"):
            return refuse("payload checksum mismatch (corrupted)")
        return payload

    # --- loads ----------------------------------------------------------------------------------
    def find(self, parent: bytes, chunks: list[tuple[int, ...]]) -> list[bytes]:
        """Rank 0: the keys of the blocks chained from `parent` over `chunks` whose every rank's file is
        there (and not known bad), as far as they go."""
        keys = []
        for _, _, key in chained(parent, chunks):
            if not all(p.is_file() and p not in self._bad for p in (self.path(key, r) for r in range(self.world_size))):
                break
            keys.append(key)
        if len(keys) < len(chunks):
            with self._lock:
                self.stats.miss_blocks += 1
        return keys

    def queue(self, load: BlockLoad) -> None:
        """Rank 0: read (read()) the load's blocks from load.num_read on."""
        self._loads.append(load)

    def read_block(self, key: bytes, parent: bytes, chunk: tuple[int, ...]) -> memoryview | None:
        """This rank's shard of one block, verified (on rank 0 the block touched: recently used); None
        (a bad file removed) when it is not."""
        path = self.path(key)
        try:
            data = self._read_file(path)
        except FileNotFoundError:
            return None  # evicted since the lookup (by another replica): computed, and saved again
        except PermissionError as e:
            # Another uid's 0600 file on a shared volume: passed over from now on (neither opened nor logged
            # again on each lookup), and left to its owner.
            log.warning("disk tier: %s cannot be read (%s): passed over from now on", path.name, e)
            with self._lock:
                self._bad.add(path)
                self._unreadable.add(path)
            return None
        except OSError as e:  # no file descriptor left, an I/O error: this read misses, the file stays
            log.warning("disk tier: reading %s failed (%s): computing the block instead", path.name, e)
            return None
        payload = self.decode(data, key, parent, chunk, self.rank)
        if payload is None:
            self.discard(key)  # the block is computed and saved again
            return None
        if self.rank == 0:
            self._touch(key, self.world_size * len(data))
        return payload

    def _read_file(self, path: Path) -> memoryview:
        """A file's bytes, in a free row of the arena when there is one (the row is freed with the last
        view of it: payloads are memoryviews of the row)."""
        with open(path, "rb", buffering=0) as f:
            size = min(os.fstat(f.fileno()).st_size, len(MAGIC) + 4 + MAX_HEADER + self.payload_bytes)  # longer: refused by decode
            if self._free_rows and size <= self._buffer_bytes:
                i = self._free_rows.pop()
                row = self._arena[i]  # a view object of its own: when it is collected, row i is free
                weakref.finalize(row, self._free_rows.append, i)
            else:
                row = bytearray(size)
            buffer = memoryview(row)
            return buffer[:f.readinto(buffer[:size])]

    def free_rows(self) -> int:
        return len(self._free_rows)

    def reading(self) -> bool:
        return bool(self._loads)

    def read(self, seconds: float | None = None) -> None:
        """Read the queued loads' blocks, oldest load first, for about `seconds` (at least one block;
        None: until all are done). Called by the engine between its steps, so that reading never
        competes with a step for the CPU: on a 2-core machine a reader thread beside the step's two
        threads held every step up by more than it read, the step waiting for the thread it displaced."""
        started = time.perf_counter()
        while self._loads:
            load = self._loads[0]
            key, parent = load.keys[load.num_read], load.keys[load.num_read - 1] if load.num_read else load.parent
            began = time.perf_counter()
            try:
                payload = self.read_block(key, parent, load.chunks[load.num_read])
            except Exception:  # noqa: BLE001 - a read that fails is a miss; the engine goes on
                log.exception("disk tier: reading a block failed")
                payload = None
            load.num_read += 1
            with self._lock:
                self.stats.load_seconds += time.perf_counter() - began
                if payload is None:
                    self.stats.miss_blocks += 1
                else:
                    self.stats.hit_blocks += 1
                    self.stats.loaded_bytes += len(payload)  # (rank 0's shard: the other ranks read theirs when writing)
            if payload is not None:
                load.payloads.append(payload)
            if payload is None or load.num_read == len(load.keys):
                self._loads.popleft()
                load.done.set()
            if seconds is not None and time.perf_counter() - started >= seconds:
                return

    def discard(self, key: bytes) -> None:
        """Every shard of a block goes (one bad shard makes the block a miss); one that cannot is
        remembered as bad, so that it is not read again."""
        with self._lock:
            self._index.pop(key.hex(), None)
        self._remove(key, bad=True)
        if self.events is not None:
            self.events.removed([key], MEDIUM_DISK)

    def _remove(self, key: bytes, bad: bool = False) -> int:
        """Delete a block's files (those known to be undeletable are not tried again); those that cannot
        be deleted are remembered (as bad: not to be read). How many went."""
        removed = 0
        for rank in range(self.world_size):
            path = self.path(key, rank)
            if path not in self._undeletable:
                if self._delete(path):
                    removed += 1
                    continue
                try:
                    size = path.stat().st_size
                except OSError:
                    size = 0
                with self._lock:
                    self._undeletable[path] = size
            if bad:
                with self._lock:
                    self._bad.add(path)
        return removed

    def _touch(self, key: bytes, size: int) -> None:
        paths = [self.path(key, rank) for rank in range(self.world_size)]
        for path in paths:
            try:
                os.utime(path)
            except OSError:
                pass
        with self._lock:
            if any(path in self._undeletable for path in paths):
                return  # counted there: in the index too, its bytes would count twice
            self._index[key.hex()] = size
            self._index.move_to_end(key.hex())

    # --- saves ----------------------------------------------------------------------------
    def save(self, key: bytes, parent: bytes, token_ids: tuple[int, ...], read_payload: Callable[[], Payload]) -> bool:
        """Queue this rank's shard of a computed block for the writer; False when it is not (already on
        disk or queued, or dropped). read_payload copies its K/V off the cache now, before the block can
        be reused."""
        if self.has(key):
            return False
        with self._lock:
            if self._pending_bytes + self.payload_bytes > self.max_pending_bytes:
                self.stats.dropped_saves += 1
                return False
            self._pending_bytes += self.payload_bytes
            self._queued.add(key)
        self._saves.put((key, parent, token_ids, read_payload()))
        return True

    def _writer(self) -> None:
        while True:
            key, parent, token_ids, payload = self._saves.get()
            started = time.perf_counter()
            tmp = None
            try:
                payload = payload if isinstance(payload, bytes) else payload.result()
                head = self.header(key, parent, token_ids, payload)
                target = self.path(key)
                target.parent.mkdir(exist_ok=True)
                tmp = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.tmp")
                with open(tmp, "wb") as f:
                    f.write(head)
                    f.write(payload)
                os.replace(tmp, target)  # atomic: a reader sees the old state or the whole file
                with self._lock:
                    self.stats.saved_blocks += 1
                    self.stats.saved_bytes += len(head) + len(payload)
                    self.stats.save_seconds += time.perf_counter() - started
                    if self.rank == 0:  # the other ranks' shards of it are as big
                        self._index[key.hex()] = self.world_size * (len(head) + len(payload))
                        self._index.move_to_end(key.hex())
                if self.events is not None:
                    self.events.stored([key], parent, token_ids, medium=MEDIUM_DISK)
            except Exception as e:  # noqa: BLE001 - one save lost, never the writer: the saves after it must land
                # An OSError (a full disk) is the volume's state; anything else (a device copy that failed) gets its traceback.
                log.warning("disk tier: saving block %s failed (%s: %s)", key.hex(), type(e).__name__, e, exc_info=not isinstance(e, OSError))
                if tmp is not None:
                    try:
                        tmp.unlink(missing_ok=True)
                    except OSError:
                        pass  # removed once stale, at a scan
            else:
                if self.rank == 0:
                    try:
                        self._evict()  # its own failures are its own: not logged as the save's
                    except Exception:  # noqa: BLE001 - nor does it stop the writer: the next save evicts again
                        log.exception("disk tier: evicting failed")
            finally:
                with self._lock:
                    self._pending_bytes -= self.payload_bytes
                    self._queued.discard(key)

    def _evict(self) -> None:
        """Least recently used blocks go until the directory is within max_bytes (what other engines
        wrote is counted once it was seen: at start, on a hit, or at a rescan when over the bound).
        The bound counts the files that could not be deleted too: they take the room of others, and
        while they alone exceed it, every block saved goes right after (the directory holds only them)."""
        with self._lock:
            over = self._used() > self.max_bytes
        if not over:
            return
        self._scan()
        while True:
            with self._lock:
                if self._used() <= self.max_bytes or not self._index:
                    return
                name, _ = self._index.popitem(last=False)
            removed = self._remove(bytes.fromhex(name))
            with self._lock:
                self.stats.evicted_files += removed
            if self.events is not None:
                self.events.removed([bytes.fromhex(name)], MEDIUM_DISK)

    def clear(self) -> int:
        """Delete every block's files the index knows (after the saves queued now are written); how many blocks."""
        self.drain()
        with self._lock:
            names = list(self._index)
            self._index.clear()
        for name in names:
            self._remove(bytes.fromhex(name))
        if names and self.events is not None:
            self.events.removed([bytes.fromhex(n) for n in names], MEDIUM_DISK)
        return len(names)

    def drain(self, timeout: float = 30) -> None:
        """Wait until every queued save is written (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queued and time.monotonic() < deadline:
            time.sleep(0.01)

    def _used(self) -> int:
        return sum(self._index.values()) + sum(self._undeletable.values())

    def total_bytes(self) -> int:
        with self._lock:
            return self._used()


def _listing(directory: Path) -> list[Path]:
    """A directory's entries; none when it cannot be listed (gone, or not readable to this uid)."""
    try:
        return list(directory.iterdir())
    except OSError:
        return []


@dataclass(slots=True)
class HostTierStats:
    """Monotonic counters (blocks, bytes) for metrics."""

    hit_blocks: int = 0
    miss_blocks: int = 0
    loaded_bytes: int = 0
    saved_blocks: int = 0
    saved_bytes: int = 0
    evicted_blocks: int = 0


class HostTier:
    """Blocks in host memory, least recently used out first: a prefix that fell out of the KV cache
    comes back with a copy instead of a forward pass (on a GPU, over PCIe; on a CPU engine, whose KV
    cache is host memory already, it holds what a larger kv_cache_memory would). In this process
    only: what it holds is checked against the chain asked for, as the disk tier's files are."""

    def __init__(self, max_bytes: int, payload_bytes: int, events: KVEventRecorder | None = None):
        """events: told of the blocks that join and leave this tier."""
        if max_bytes < payload_bytes:
            raise ValueError(f"the host tier's size ({max_bytes} bytes) does not hold one block ({payload_bytes} bytes)")
        self.max_blocks = max_bytes // payload_bytes
        self.payload_bytes = payload_bytes
        self.events = events
        self.stats = HostTierStats()
        self._blocks: OrderedDict[bytes, tuple[bytes, tuple[int, ...], Payload]] = OrderedDict()  # key -> (parent, tokens, payload)

    def has(self, key: bytes) -> bool:
        return key in self._blocks

    def drop(self, key: bytes) -> bool:
        """Forget a block (a rank could not load it); whether it was held."""
        if self._blocks.pop(key, None) is None:
            return False
        if self.events is not None:
            self.events.removed([key], MEDIUM_HOST)
        return True

    def put(self, key: bytes, parent: bytes, token_ids: tuple[int, ...], payload: Payload) -> list[bytes]:
        """Hold a block (the least recently used go past the bound); the keys that went."""
        new = key not in self._blocks
        self._blocks[key] = (parent, tuple(token_ids), payload)
        self._blocks.move_to_end(key)
        self.stats.saved_blocks += 1
        self.stats.saved_bytes += self.payload_bytes
        if new and self.events is not None:
            self.events.stored([key], parent, token_ids, medium=MEDIUM_HOST)
        evicted = []
        while len(self._blocks) > self.max_blocks:
            evicted.append(self._blocks.popitem(last=False)[0])
            self.stats.evicted_blocks += 1
        if evicted and self.events is not None:
            self.events.removed(evicted, MEDIUM_HOST)
        return evicted

    def chain(self, parent: bytes, chunks: list[tuple[int, ...]]) -> tuple[list[Payload], list[bytes]]:
        """The payloads and keys of the blocks held here chained from `parent` over `chunks`, as far as
        they go (each touched: recently used)."""
        found, keys = [], []
        for chunk_parent, chunk, key in chained(parent, chunks):
            entry = self._blocks.get(key)
            if entry is None or entry[:2] != (chunk_parent, tuple(chunk)):
                break
            self._blocks.move_to_end(key)
            found.append(entry[2])
            keys.append(key)
        self.stats.hit_blocks += len(found)
        self.stats.loaded_bytes += len(found) * self.payload_bytes
        self.stats.miss_blocks += len(found) < len(chunks)
        return found, keys

    def total_bytes(self) -> int:
        return len(self._blocks) * self.payload_bytes

    def clear(self) -> list[bytes]:
        """Every block dropped; their keys."""
        keys = list(self._blocks)
        self._blocks.clear()
        if keys and self.events is not None:
            self.events.removed(keys, MEDIUM_HOST)
        return keys
