"""The KV connector: every way K/V comes into the cache from past the prefix cache, or leaves it to be had
again — the host tier, the disk tier (kv_tiers.py) and a prefill engine (prefill/decode
disaggregation: kv_transfer.py, the bytes moved by NIXL: kv_nixl.py) — as one component with two
sides, as vLLM's KVConnectorBase_V1 splits them.

The scheduler side (KVConnector, in rank 0's engine) answers the scheduler: how many blocks past a
waiting sequence's in-memory hits can be had from outside (the lookup starts their read or pull and
touches nothing in the cache); it learns of the blocks that join the prefix cache (the block
manager's on_cached) and decides which tier each is saved to; when a prefill request ends it holds
its blocks for a decode engine. What each rank is to do is one KVWork (step_message.py): saves, then
loads, then the host tier's evictions.

The worker side (KVConnectorWorker, one per rank) does it on its own shard: copies a saved block off
its cache into its host tier and its disk tier's writer, and fills a loaded block from its host tier,
its disk file or the prefill rank of its index (a NIXL read straight into the cache). Every rank
says whether its loads went well and all agree (a MIN over the ranks): when any failed, every rank
drops the step's loads and their sequences compute their prompts instead — time lost, never tokens,
and never a block loaded on some ranks only.

The tiers chain: a lookup takes what the host tier holds of the prompt's chain, then the rest from
the prefill engine the request names, else from disk. A drafter's K/V (draft model, EAGLE-3 head)
lives in the same blocks (worker.cache_regions) and moves with them: a loaded prefix is as good to
the drafter as a computed one.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

from kvpilot.server.config import EngineConfig
from kvpilot.server.engine.block_manager import BlockManager, chained
from kvpilot.server.engine.kv_tiers import BlockLoad, DiskTier, HostTier, Payload
from kvpilot.server.engine.sequence import Sequence
from kvpilot.server.engine.step_message import KVWork, LoadedBlock, NixlPeer, SavedBlock

log = logging.getLogger("kvpilot.server.kv_connector")
# Beside running sequences, reading a KV tier's files takes this share of the time of the step before,
# between steps (kv_tiers.DiskTier.read).
TIER_READ_SHARE = 0.1
# A step's NIXL reads from one prefill engine take at most this long (they are milliseconds: the step waits for them, and a
# prefill engine that hangs must not stall every running sequence for kv_transfer_timeout).
NIXL_READ_TIMEOUT_S = 10.0


class KVConnectorWorker:
    """One rank's side: its shard of every block saved and loaded (rank 0's tiers are also the scheduler
    side's: its host tier decides what is held, its disk tier keeps the directory's index)."""

    def __init__(self, config: EngineConfig, worker, events=None):
        """worker: this rank's (its cache regions, block copies and writes); events: rank 0's KV events."""
        self.worker, self.config = worker, config
        self.rank, self.world_size = worker.rank, worker.world_size  # (every rank of every stage: each holds its own layers' shard)
        layout, self.payload_bytes = worker.block_layout()
        self.host = (HostTier(config.kv_host_offload_size, self.payload_bytes, events)
                     if config.kv_host_offload_size and self.rank == 0 else None)
        self.host_shards: dict[bytes, Payload] = {}  # ranks 1…N−1: their shards of rank 0's host tier
        self.disk = (DiskTier(config.kv_offload_dir, config.kv_offload_size, layout, self.payload_bytes, self.rank, self.world_size,
                              events=events if self.rank == 0 else None) if config.kv_offload_dir else None)
        self.nixl = None
        if config.kv_role != "none":
            from kvpilot.server.engine.kv_nixl import NixlCache

            self.nixl = NixlCache(worker.cache_regions(), config.kv_role, self.rank)
            if self.rank > 0 and config.kv_role in ("prefill", "both"):
                self.nixl.active.set()  # (rank 0 knows when blocks are held; these ranks answer reads promptly always)
        worker.stage_block_writes()

    def peer(self) -> NixlPeer:
        return self.nixl.describe()

    def run(self, work: KVWork) -> list[bytes]:
        """Ranks 1…N−1: a KVWork as rank 0 decided it — the saved blocks copied first (a load may reuse
        a block), then the loads (the keys of those that failed here), then the copies into the tiers
        and the host tier's evictions."""
        copies = [self.worker.block_bytes(s.block_id, s.window_block) if s.to_host or s.to_disk else None for s in work.saves]
        failed: list[bytes] = []
        if work.loads:
            try:
                failed = self.load(work.loads, work.peers, None, work.read_seconds)
            except Exception as e:  # noqa: BLE001 - every rank agrees on the outcome: this rank's is a failure
                log.warning("KV connector: rank %d: loading failed (%s: %s)", self.rank, type(e).__name__, e)
                failed = [block.key for block in work.loads]
        for save, payload in zip(work.saves, copies):
            if save.to_host:
                self.host_shards[save.key] = payload
            if save.to_disk and self.disk is not None:
                self.disk.save(save.key, save.parent, tuple(save.token_ids), lambda p=payload: p)
        for key in work.evicted:
            self.host_shards.pop(key, None)
        return failed

    def load(self, blocks: list[LoadedBlock], peers: list[list[NixlPeer]], own: list[Payload | None] | None,
             read_seconds: list[float]) -> list[bytes]:
        """Fill fresh cache blocks with this rank's shard of each: own[i] when rank 0 has it already, else
        from this rank's host tier or disk file, or read from the prefill rank of this index, done within
        read_seconds[peer] of the start (else failed: past its hold the prefill engine may reuse the blocks).
        The keys of the blocks that could not be (logged)."""
        started = time.monotonic()
        self.worker.settle_writes()  # (on a GPU: nothing queued may still write these blocks, or copy them off)
        written: list[tuple[int, int, Payload]] = []
        remote: dict[int, list[LoadedBlock]] = {}
        failed: list[bytes] = []
        for i, block in enumerate(blocks):
            payload = own[i] if own is not None else None
            if block.source == "p2p":
                remote.setdefault(block.peer, []).append(block)
                continue
            if payload is None and block.source == "host":
                payload = self.host_shards.get(block.key)
            elif payload is None and block.source == "disk" and self.disk is not None:
                payload = self.disk.read_block(block.key, block.parent, tuple(block.token_ids))
            if payload is None:
                log.warning("KV connector: rank %d: block %s… is no longer in its %s tier (or its shard is bad): computed instead",
                            self.rank, block.key.hex()[:16], block.source)
                failed.append(block.key)
            else:
                written.append((block.block_id, block.window_block, payload))
        self.worker.write_blocks(written)
        for peer, reads in remote.items():
            agent, deadline = peers[peer][self.rank], started + read_seconds[peer]
            if self.nixl is None:
                why = "no NIXL agent on this engine"
            elif deadline <= time.monotonic():
                why = "the prefill engine's hold ends before it could be read"
            else:
                why = self.nixl.read(agent, [(b.block_id, b.remote_block) for b in reads], deadline - time.monotonic())
                if why is None and time.monotonic() > deadline:  # done, but maybe after the blocks were released: not trusted
                    why = "done only as the prefill engine's hold ended"
            if why is not None:
                log.warning("KV connector: rank %d: reading %d blocks from %s failed (%s): computed instead", self.rank, len(reads),
                            agent.agent, why)
                failed += [b.key for b in reads]
        return failed

    def close(self) -> None:
        """Saves queued for the disk tier are written first."""
        if self.disk is not None:
            self.disk.drain()
        if self.nixl is not None:
            self.nixl.close()


@dataclass(slots=True)
class _Save:
    block_id: int
    window_block: int
    key: bytes
    parent: bytes
    token_ids: tuple[int, ...]


class KVConnector:
    """The scheduler side (rank 0): lookups, saves decided, loads sent, holds for decode engines."""

    def __init__(self, config: EngineConfig, own: KVConnectorWorker, workers, block_manager: BlockManager, max_model_len: int):
        """own: rank 0's worker side; workers: the other ranks (parallel.Workers), or None."""
        self.config, self.own, self.workers, self.bm = config, own, workers, block_manager
        self.host, self.disk = own.host, own.disk
        self.block_size = config.block_size
        self.external_queries = 0  # prompt tokens looked up past the in-memory hits
        self._saves: list[_Save] = []
        self._evicted: list[bytes] = []  # host tier keys the other ranks are to drop with the next saves
        self._transfer_ids = 0
        self.sender = self.receiver = None
        if config.kv_role != "none":
            self.sender, self.receiver = self._transfer(max_model_len)

    def _transfer(self, max_model_len: int):
        """Prefill/decode disaggregation: (the sending side, the receiving side), as kv_role has them."""
        from kvpilot.server.engine.kv_transfer import KVReceiver, KVSender
        from kvpilot.server.engine.kv_trust import transfer_secret

        config = self.config
        engine_id = self.bm.salt.hex()  # the KV identity: another model's or settings' keys never match
        secret = transfer_secret(config.kv_role)
        block_bytes = self.own.payload_bytes * config.tensor_parallel_size
        sender = receiver = None
        if config.kv_role in ("prefill", "both"):
            peers = [self.own.peer()] + (self.workers.peers() if self.workers is not None else [])
            sender = KVSender(config.kv_transfer_host, config.kv_transfer_port, engine_id, config.kv_transfer_timeout, secret,
                              -(-max_model_len // config.block_size), block_bytes, lambda: peers)
            weakref.finalize(self, sender.close)  # its thread ends with the engine
        if config.kv_role in ("decode", "both"):
            receiver = KVReceiver(engine_id, block_bytes, config.kv_transfer_timeout, secret, config.tensor_parallel_size)
            weakref.finalize(self, receiver.close)
        return sender, receiver

    # --- the scheduler asks -------------------------------------------------------------------
    def lookup(self, seq: Sequence, cached: list[int]) -> BlockLoad | None:
        """A read of seq's prompt blocks after its in-memory hits (`cached`): the host tier's chain, then
        the rest pulled from the prefill engine its kv_transfer_params name, else read from disk (None:
        nowhere to read any from). Nothing in the cache changes."""
        bm, size = self.bm, self.block_size
        tokens = seq.token_ids()
        usable = (len(tokens) - 1) // size
        if len(cached) >= usable:
            transfer = seq.params.kv_transfer
            if transfer is not None and transfer.do_remote_prefill and self.receiver is not None:
                self.receiver.release(transfer)  # all in the cache already: the prefill engine's hold is not needed
            return None
        parent = bm.blocks[cached[-1]].hash if cached else bm.root(seq)
        chunks = [tuple(tokens[i * size:(i + 1) * size]) for i in range(len(cached), usable)]
        self.external_queries += len(chunks) * size
        return self.find(parent, chunks, len(cached), seq.params.kv_transfer)

    def find(self, parent: bytes, chunks: list[tuple[int, ...]], first_index: int, transfer=None) -> BlockLoad | None:
        """The blocks of `chunks` (chained from `parent`, the first the prompt's first_index-th) to be had
        from outside, as one load: the host tier's part of the chain, then the rest from the prefill
        engine `transfer` names, else from disk (None: no block)."""
        payloads, keys = self.host.chain(parent, chunks) if self.host is not None else ([], [])
        load = BlockLoad(first_index, parent, keys, chunks[:len(keys)], list(payloads), num_host=len(keys), num_read=len(keys))
        rest = chunks[len(keys):]
        remote = transfer is not None and transfer.do_remote_prefill and self.receiver is not None
        if rest and remote:
            load.keys += [key for _, _, key in chained(keys[-1] if keys else parent, rest)]
            load.chunks += rest
            return self.receiver.pull(transfer, load)
        if remote:  # nothing to pull (all here already): the prefill engine need not hold the blocks any longer
            self.receiver.release(transfer)
        if rest and self.disk is not None:
            found = self.disk.find(keys[-1] if keys else parent, rest)
            if found:
                load.keys += found
                load.chunks += rest[:len(found)]
                self.disk.queue(load)
                return load
        if not keys:
            return None
        load.done.set()
        return load

    def block_cached(self, block_id: int, window_block: int, key: bytes, parent: bytes, token_ids: tuple[int, ...]) -> None:
        """The block manager's word that a full block joined the prefix cache: saved at the next flush
        (save_cached, right after the scheduler counted the step: before any step can reuse it)."""
        self._saves.append(_Save(block_id, window_block, key, parent, tuple(token_ids)))

    # --- the engine's step -----------------------------------------------------------------------
    def save_cached(self) -> None:
        """The blocks that joined the prefix cache since the last call: each copied off every rank's
        cache once, into the tiers that do not hold it yet."""
        saves, self._saves = self._saves, []
        if not (saves or self._evicted) or (self.host is None and self.disk is None):
            return
        sent, evicted, self._evicted = [], self._evicted, []
        for save in saves:
            copied: list[Payload] = []

            def copy(save=save, copied=copied) -> Payload:
                if not copied:
                    copied.append(self.own.worker.block_bytes(save.block_id, save.window_block))
                return copied[0]

            to_host = self.host is not None and not self.host.has(save.key)
            if to_host:
                evicted += self.host.put(save.key, save.parent, save.token_ids, copy())
            to_disk = self.disk is not None and self.disk.save(save.key, save.parent, save.token_ids, copy)
            if to_host or to_disk:
                sent.append(SavedBlock(save.block_id, save.window_block, save.key, save.parent, list(save.token_ids), to_host, to_disk))
        if self.workers is not None and (sent or evicted):  # (a key evicted, then saved again in this batch, stays)
            self.workers.send(KVWork(sent, [], [key for key in evicted if not self.host.has(key)], []))

    def load(self, loads: list[tuple[Sequence, int, int, BlockLoad, int]]) -> list[Sequence]:
        """Write the step's loaded blocks ((sequence, cache block, window block, its load, index in the load)) on every
        rank; the sequences whose loads failed somewhere (every rank dropped them: computed instead). A
        pulled block is not read past the time its prefill engine holds it."""
        if not loads:
            return []
        started, now = time.perf_counter(), time.monotonic()
        late = {id(load) for _, _, _, load, _ in loads if load.remote is not None and now > load.remote.read_by}
        if late:
            log.warning("KV transfer: %d pulled loads waited past their prefill engine's hold: computed instead", len(late))
        doing = [entry for entry in loads if id(entry[3]) not in late]
        blocks, own, peers, read_seconds, peer_index = [], [], [], [], {}
        for _, block_id, window_block, load, i in doing:
            source = "host" if i < load.num_host else load.source
            remote_block, peer = -1, -1
            if source == "p2p":
                peer = peer_index.setdefault(id(load), len(peers))
                if peer == len(peers):
                    peers.append(load.remote.peers)
                    read_seconds.append(max(0.0, min(NIXL_READ_TIMEOUT_S, self.config.kv_transfer_timeout, load.remote.hold_ends - now)))
                remote_block = load.remote.block_ids[i]
            blocks.append(LoadedBlock(block_id, window_block, load.keys[i], load.keys[i - 1] if i else load.parent, list(load.chunks[i]),
                                      source, remote_block, peer))
            own.append(load.payloads[i])
        failed_keys: set[bytes] = set()
        if blocks:
            if self.workers is not None:
                self.workers.send(KVWork([], blocks, [], peers, read_seconds))
            try:
                failed_keys = set(self.own.load(blocks, peers, own, read_seconds))
            except Exception as e:  # noqa: BLE001 - agreed on below: a failed load is computed, never fatal
                log.warning("KV connector: rank 0: loading failed (%s: %s)", type(e).__name__, e)
                failed_keys = {block.key for block in blocks}
            if self.workers is not None:
                failed_keys = self.workers.agree(failed_keys)  # every rank's failures, on every rank
        failed = {seq.seq_id: seq for (seq, _, _, load, _), block in zip(doing, blocks) if block.key in failed_keys or id(load) in late}
        failed |= {seq.seq_id: seq for seq, _, _, load, _ in loads if id(load) in late}
        outcome: dict[int, tuple[BlockLoad, bool]] = {}
        for (seq, _, _, load, i), block in zip(doing, blocks):
            ok = seq.seq_id not in failed
            load.payloads[i] = None  # written (or not): its read buffer is free again (kv_tiers.py)
            load.num_written += ok
            outcome[id(load)] = (load, outcome.get(id(load), (load, True))[1] and ok)
            if not ok:
                self._forget(block, block.key in failed_keys)
        for _, _, _, load, _ in loads:
            if id(load) in late:
                outcome[id(load)] = (load, False)
        for load, ok in outcome.values():
            if load.remote is not None and self.receiver is not None and (not ok or load.num_written >= load.num_taken):
                self.receiver.finish(load, ok, time.perf_counter() - started)
        return list(failed.values())

    def _forget(self, block: LoadedBlock, bad: bool) -> None:
        """A block of a load dropped (its sequence computes it): not counted as found; when some rank could
        not load it (bad), not offered again (its disk files removed, its host entry dropped on every rank)."""
        tier = {"host": self.host, "disk": self.disk}.get(block.source)
        if tier is None:
            return
        tier.stats.hit_blocks -= 1  # counted as a hit when rank 0 had its shard: computed after all
        tier.stats.miss_blocks += 1
        if not bad:
            return
        if tier is self.disk:
            self.disk.discard(block.key)
        elif self.host.drop(block.key):
            self._evicted.append(block.key)

    def abandon(self, load: BlockLoad) -> None:
        """The scheduler lets go of a load before all of it was written (its sequence ended or was
        preempted, or took none of it): a prefill engine holding its blocks releases them now."""
        if load.source == "p2p" and self.receiver is not None:
            self.receiver.abandon(load)

    def between_steps(self, step_seconds: float, running: bool) -> None:
        """Held blocks a decode engine is done with given back; a slice of the disk tier's reads while
        sequences run (all of them when none does: wait)."""
        if self.sender is not None:
            for block_ids in self.sender.releases():
                self.bm.release(block_ids)
            if self.sender.num_held_blocks():
                self.own.nixl.active.set()
            else:
                self.own.nixl.active.clear()
        if self.disk is not None and self.disk.reading() and running:
            self.disk.read(TIER_READ_SHARE * step_seconds)

    def wait(self, waiting, timeout: float = 0.01) -> None:
        """Nothing to run while waiting sequences' reads are outstanding: the disk tier's are read now,
        all of them; a pull from a prefill engine is waited for (no busy loop)."""
        if self.disk is not None and self.disk.reading():
            self.disk.read()
            return
        load = next((seq.kv_load for seq in waiting if seq.kv_load is not None and not seq.kv_load.done.is_set()), None)
        if load is not None:
            load.done.wait(timeout)

    def needs_step(self) -> bool:
        """Held blocks to give back now (pulled or expired): a step releases them."""
        return self.sender is not None and self.sender.has_releases()

    def request_finished(self, seq: Sequence) -> dict | None:
        """A prefill request's sequence ended well: its prompt's full blocks held for a decode engine's
        pull; the kv_transfer_params its output carries (None: not a prefill request here)."""
        transfer = seq.params.kv_transfer
        if self.sender is None or transfer is None or not transfer.do_remote_decode:
            return None
        n = min(len(seq.block_hashes), (seq.num_prompt_tokens - 1) // self.block_size)
        block_ids, keys = list(seq.block_table[:n]), list(seq.block_hashes[:n])
        self.bm.hold(block_ids)
        self._transfer_ids += 1
        transfer_id = f"{seq.request_id}-{self._transfer_ids}"
        self.sender.hold(transfer_id, block_ids, keys)
        self.own.nixl.active.set()
        return self.sender.sign({"do_remote_decode": False, "do_remote_prefill": True, "remote_host": self.config.kv_transfer_host,
                                 "remote_port": self.sender.port, "remote_request_id": transfer_id,
                                 "remote_engine_id": self.sender.engine_id, "remote_block_ids": block_ids,
                                 "tp_size": self.config.tensor_parallel_size})

    def reset(self) -> int:
        """Every block of the tiers dropped (a prefix-cache reset with external); how many (rank 0's count)."""
        dropped = self.host.clear() if self.host is not None else []
        if dropped and self.workers is not None:
            self.workers.send(KVWork([], [], dropped, []))
        return len(dropped) + (self.disk.clear() if self.disk is not None else 0)

    def drain(self) -> None:
        """Saves queued for the disk tier written (tests, shutdown)."""
        if self.disk is not None:
            self.disk.drain()

    def close(self) -> None:
        self.own.close()
        for side in (self.sender, self.receiver):
            if side is not None:
                side.close()
