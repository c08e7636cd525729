"""KV-cache block bookkeeping with prefix caching. Pure Python: no tensors.

A full block's key is SHA-256 over its parent's key and its token ids; the first block's parent is the
cache's root: a salt of everything that makes K/V differ (the model's files, block size, dtypes,
quantization, tensor-parallel layout, a speculative head's layer in the same blocks) and, for a LoRA
adapter's sequences, the adapter's files. Keys are the same in every process and replica (Python's
`hash` is salted per process for strings), and a crafted collision would need a SHA-256 one: the
property that lets blocks leave the process (a KV tier shared by replicas). Identical prefixes share
blocks by reference count. A block whose count drops to zero stays cached (its key remains findable)
and sits in the free queue, in least-recently-freed order; it is evicted only when a fresh block is
needed. Usage counts blocks held by live sequences: evictable cached blocks count as free.

A model whose sliding-window layers are a pool of their own (WindowPool: Gemma 3's five layers in six)
holds a second table per sequence, parallel to its block table, for those layers: a block that fell out
of the window of the sequence's next query goes back (to the free queue, findable by its key while it is
not evicted), its entry then the pool's null block, which no kernel reads (they read nothing before a
window). A sequence holds at most ceil(window / block_size) + 1 such blocks from one step to the next,
plus its step's new ones. A prefix hit counts only as far as the window's blocks before its end are cached too.
Blocks written from outside the cache (a KV tier's, `num_loaded`) take a window block only where the first
computed query sees them; a block joins a tier (on_cached) only while its window block is held.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from kvpilot.server.engine.kv_events import KVEventRecorder
from kvpilot.server.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = field(default_factory=tuple)


def drop_reference(block: Block, free: OrderedDict[int, None], cached: dict[bytes, int], what: str = "block") -> None:
    """One holder fewer of `block`; held by none, it joins the free queue: at the back while its key still finds it
    (evicted last, a prefix hit until then), at the front otherwise (reused first)."""
    block.ref_count -= 1
    if block.ref_count < 0:
        raise AssertionError(f"{what} {block.block_id} freed twice")
    if block.ref_count == 0:
        free[block.block_id] = None
        if block.hash is None or cached.get(block.hash) != block.block_id:
            block.hash, block.token_ids = None, ()
            free.move_to_end(block.block_id, last=False)


def cache_salt(identity: dict) -> bytes:
    """The root key of a cache: SHA-256 of the canonical JSON of what its K/V depend on."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()).digest()


def block_hash(parent: bytes, token_ids: Seq[int]) -> bytes:
    """A block's key: SHA-256 over its parent's key (32 bytes) and its token ids (little-endian uint32;
    a token id outside that range, such as an async placeholder, is an error, never a key)."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}I", *token_ids)).digest()


def chained(parent: bytes, chunks: Iterable[tuple[int, ...]]) -> Iterator[tuple[bytes, tuple[int, ...], bytes]]:
    """Each chunk of a chain of blocks from `parent`, with its parent's key and its own."""
    for chunk in chunks:
        key = block_hash(parent, chunk)
        yield parent, chunk, key
        parent = key


def adapter_root(salt: bytes, fingerprint: bytes) -> bytes:
    """The root of a LoRA adapter's blocks: its K/V are its own (an adapter changes K and V), shared with
    the base model's by no key; the same adapter files give the same root in every process."""
    return hashlib.sha256(salt + b"lora-adapter\0" + fingerprint).digest()


# Tests and tools that build a BlockManager without an engine: a fixed salt, still the same everywhere.
TEST_SALT = cache_salt({"model": "none"})


class WindowPool:
    """The sliding-window layers' blocks (the module's docstring): num_blocks of them, their own free queue
    and prefix cache (the same keys as the block table's blocks), and `null`, the id a table holds for a block
    out of the window (the pool's scratch block)."""

    def __init__(self, num_blocks: int, block_size: int, window: int):
        if num_blocks < 1:
            raise ValueError("the sliding-window layers' KV cache must hold at least one block")
        self.window, self.block_size = window, block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.null = num_blocks

    def first_needed(self, num_computed: int) -> int:
        """The first block a query at position num_computed (the next one to compute) still sees."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def held(self, seq: Sequence) -> int:
        return sum(1 for b in seq.window_table if b != self.null)

    def find(self, key: bytes | None, tokens: tuple[int, ...]) -> int | None:
        block_id = self.cached.get(key) if key is not None else None
        return block_id if block_id is not None and self.blocks[block_id].token_ids == tokens else None

    def release_before(self, seq: Sequence, first: int) -> None:
        """Give back seq's blocks before block `first` (out of every window its next queries have)."""
        for j in range(min(first, len(seq.window_table))):
            if seq.window_table[j] != self.null:
                drop_reference(self.blocks[seq.window_table[j]], self.free, self.cached, "sliding-window block")
                seq.window_table[j] = self.null

    def take(self, block_id: int) -> int:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1
        return block_id

    def take_fresh(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def free_all(self, seq: Sequence, keep: int = 0) -> None:
        """Give back seq's blocks from block `keep` on (tail first, as the block table's)."""
        for block_id in reversed(seq.window_table[keep:]):
            if block_id != self.null:
                drop_reference(self.blocks[block_id], self.free, self.cached, "sliding-window block")
        del seq.window_table[keep:]

    def cache(self, seq: Sequence, index: int, key: bytes, tokens: tuple[int, ...]) -> None:
        block_id = seq.window_table[index] if index < len(seq.window_table) else self.null
        if block_id == self.null:
            return
        block = self.blocks[block_id]
        if block.hash is None:
            block.hash, block.token_ids = key, tokens
            self.cached.setdefault(key, block_id)

    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, salt: bytes = TEST_SALT,
                 adapter_fingerprint: Callable[[int], bytes] | None = None,
                 on_cached: Callable[[int, int, bytes, bytes, tuple[int, ...]], None] | None = None,
                 events: KVEventRecorder | None = None, window: WindowPool | None = None):
        """salt: cache_salt of the engine's identity; adapter_fingerprint: a LoRA adapter id -> the
        digest of its files (the registry's); on_cached(block id, window block id, key, parent key, token ids): a
        block just joined the prefix cache (a KV tier saves it; the window id is the block id without a window pool);
        events: told what joins and leaves the
        prefix cache (KV events for routers); window: the sliding-window layers' pool (the module's
        docstring), None: every layer reads the block table."""
        self.window = window
        self.on_cached = on_cached
        self.events = events
        if num_blocks < 1:
            raise ValueError("the KV cache must hold at least one block")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.salt, self.adapter_fingerprint = salt, adapter_fingerprint
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}   # block key -> block id
        # Counters for metrics (tokens).
        self.prefix_queries = 0
        self.prefix_hits = 0

    # --- queries -----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def usage(self) -> float:
        """Fraction of blocks held by live sequences (0–1); with a window pool, the fuller of the two."""
        used = 1.0 - len(self.free) / len(self.blocks)
        return used if self.window is None else max(used, self.window.usage())

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def root(self, seq: Sequence) -> bytes:
        """The parent key of seq's first block: the salt, or its adapter's root."""
        if not seq.adapter:
            return self.salt
        if self.adapter_fingerprint is None:
            raise AssertionError(f"sequence {seq.seq_id} has LoRA adapter {seq.adapter}, and this cache knows no adapters")
        return adapter_root(self.salt, self.adapter_fingerprint(seq.adapter))

    # --- prefix cache -----------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int] | None:
        """Cached blocks holding seq's leading full blocks (at least one token is always left to
        compute, so the last prompt token's logits exist); None when there is no look-up to make.
        The look-up counts (prefix_queries/hits) once allocate() admits seq with it."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return None  # prompt logprobs need every prompt position computed
        tokens = seq.token_ids()
        usable = (len(tokens) - 1) // self.block_size
        hits: list[int] = []
        parent = self.root(seq)
        for i in range(usable):
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            h = block_hash(parent, chunk)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != chunk:  # re-checked all the same (cheap)
                break
            hits.append(block_id)
            parent = h
        if self.window is not None:  # as far as the sliding-window layers' blocks its next query sees are cached too
            while hits and any(self.window.find(self.blocks[b].hash, self.blocks[b].token_ids) is None
                               for b in hits[self.window.first_needed(len(hits) * self.block_size):]):
                hits.pop()
        return hits

    # --- allocation -------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = (), num_loaded: int = 0) -> bool:
        have = len(seq.block_table) + len(cached)
        need = self.blocks_needed(seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens) - have
        reusable = sum(1 for b in cached if self.blocks[b].ref_count == 0)  # they leave the free queue
        if need + reusable > len(self.free):
            return False
        if self.window is None:
            return True
        first = self.window.first_needed(seq.num_computed_tokens + len(cached) * self.block_size + num_loaded)
        found = [self.window.find(self.blocks[b].hash, self.blocks[b].token_ids) for j, b in enumerate(cached, len(seq.block_table)) if j >= first]
        fresh = sum(1 for j in range(have, have + need) if j >= first)
        return fresh + sum(1 for w in found if self.window.blocks[w].ref_count == 0) <= len(self.window.free)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] | None = None, num_loaded: int = 0) -> bool:
        """Take the cached prefix blocks that match_prefix found (first admission only) and enough
        fresh blocks for num_new_tokens more tokens, the first num_loaded of them written from outside the
        cache (a KV tier's full blocks: with a window pool, only those the first computed query sees take
        a window block). All or nothing: returns False and changes nothing (counters included) if short —
        but with a window pool, the blocks no coming query of seq sees have gone back first."""
        looked_up, cached = cached is not None, cached or []
        if self.window is not None:  # what no coming query sees goes back first (it counts as room)
            self.window.release_before(seq, self.window.first_needed(seq.num_computed_tokens))
        if not self.can_allocate(seq, num_new_tokens, cached, num_loaded):
            return False
        if looked_up:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += len(cached) * self.block_size
        first = self.window.first_needed(seq.num_computed_tokens + len(cached) * self.block_size + num_loaded) if self.window is not None else 0
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            if self.window is not None:
                found = self.window.find(block.hash, block.token_ids) if len(seq.block_table) >= first else None
                if found is None and len(seq.block_table) >= first:
                    raise AssertionError(f"sequence {seq.seq_id}: a prefix hit without the sliding-window block its query sees")
                seq.window_table.append(self.window.null if found is None else self.window.take(found))
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.hash)
        if cached:
            seq.num_computed_tokens = len(cached) * self.block_size
            seq.record_cached_prompt(seq.num_computed_tokens, "device")
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(need):
            if self.window is not None:
                seq.window_table.append(self.window.take_fresh() if len(seq.block_table) >= first else self.window.null)
            seq.block_table.append(self._take_fresh())
        return True

    def _take_fresh(self) -> int:
        block_id, _ = self.free.popitem(last=False)  # least recently freed first
        block = self.blocks[block_id]
        if block.hash is not None:  # evict it from the prefix cache
            if self.cached.get(block.hash) == block_id:
                del self.cached[block.hash]
                if self.events is not None:
                    self.events.removed([block.hash])
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block_id

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """After a step: register seq's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = num_computed_tokens // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else self.root(seq)
        run: list[bytes] = []  # consecutive blocks that joined the cache: one event
        for i in range(len(seq.block_hashes), full):
            chunk = tuple(seq.tokens_slice(i * self.block_size, (i + 1) * self.block_size))
            h = block_hash(parent, chunk)
            block = self.blocks[seq.block_table[i]]
            joined = False
            if block.hash is None:
                block.hash, block.token_ids = h, chunk
                joined = self.cached.setdefault(h, block.block_id) == block.block_id  # (an identical block computed alongside keeps the first)
                window = block.block_id if self.window is None else seq.window_table[i] if i < len(seq.window_table) else self.window.null
                if joined and self.on_cached is not None and (self.window is None or window != self.window.null):
                    # (not when its window layers' block went back already, a block loaded past the window: a tier holds whole blocks)
                    self.on_cached(block.block_id, window, h, parent, chunk)
            if self.events is not None:
                if joined:
                    run.append(h)
                else:
                    self._announce(seq, run, i)
            if self.window is not None:
                self.window.cache(seq, i, h, chunk)
            seq.block_hashes.append(h)
            parent = h
        if self.events is not None:
            self._announce(seq, run, full)

    def _announce(self, seq: Sequence, run: list[bytes], end: int) -> None:
        """The run of seq's blocks ending before block `end` joined the prefix cache (a KV event); emptied."""
        if not run:
            return
        first = end - len(run)
        parent = seq.block_hashes[first - 1] if first else None
        tokens = seq.tokens_slice(first * self.block_size, end * self.block_size)
        self.events.stored(list(run), parent, tokens, seq.adapter)
        run.clear()

    def reset_prefix_cache(self) -> int:
        """Forget every key (vLLM's /reset_prefix_cache): no block is found by a later look-up; blocks
        live sequences hold stay theirs, uncached. The number of keys forgotten."""
        forgotten = len(self.cached)
        for block_id in self.cached.values():
            block = self.blocks[block_id]
            block.hash, block.token_ids = None, ()
            if block.ref_count == 0:  # evictable: now reused first, as any uncached free block
                self.free.move_to_end(block_id, last=False)
        self.cached.clear()
        if self.window is not None:
            for block_id in self.window.cached.values():
                block = self.window.blocks[block_id]
                block.hash, block.token_ids = None, ()
                if block.ref_count == 0:
                    self.window.free.move_to_end(block_id, last=False)
            self.window.cached.clear()
        if self.events is not None:
            self.events.cleared()
        return forgotten

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back seq's blocks past the first num_tokens tokens (reserved for proposed tokens that
        were rejected: never full of computed tokens, so never in the prefix cache)."""
        keep = self.blocks_needed(num_tokens)
        for block_id in seq.block_table[keep:]:
            block = self.blocks[block_id]
            if block.ref_count != 1 or block.hash is not None:
                raise AssertionError(f"block {block_id} trimmed while shared or cached")
            block.ref_count = 0
            self._free_uncached(block_id)
        del seq.block_table[keep:]
        if self.window is not None:
            self.window.free_all(seq, keep)

    def free_seq(self, seq: Sequence) -> None:
        """Release seq's blocks. Tail blocks are freed first so they are evicted before the shared prefix."""
        for block_id in reversed(seq.block_table):
            drop_reference(self.blocks[block_id], self.free, self.cached)
        seq.block_table = []
        seq.block_hashes = []
        if self.window is not None:
            self.window.free_all(seq)

    def hold(self, block_ids: list[int]) -> None:
        """One more reference on each block (a prefill engine's blocks held for a decode engine's pull)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop the references hold() took; a block no one uses goes back to the free queue (evictable
        from the prefix cache, as a finished sequence's blocks)."""
        for block_id in block_ids:
            drop_reference(self.blocks[block_id], self.free, self.cached)

    def _free_uncached(self, block_id: int) -> None:
        self.free[block_id] = None
        self.free.move_to_end(block_id, last=False)  # uncached blocks are reused first
