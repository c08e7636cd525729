"""Properties of BlockManager + Scheduler over random workloads (no model: tokens are faked).

Checked after every step: no block leaked or double-freed, ref counts equal the block tables that
hold them, free and held blocks partition the cache, step budgets hold, running sequences use at most
max_loras LoRA adapters, cached blocks chain from their sequence's adapter, under the priority policy
the waiting queue stays in (priority, arrival) order, and in the end every request finishes exactly
once (none dropped, duplicated or starved), under either policy. With a sliding-window pool
(WindowPool) the same of its blocks, every block a sequence's next query sees held, and no more held
than the window and the step's tokens span."""

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.server.engine.block_manager import BlockManager, WindowPool, block_hash
from kvpilot.server.engine.sampling_params import SamplingParams
from kvpilot.server.engine.scheduler import Scheduler
from kvpilot.server.engine.sequence import Sequence, Status


def check_invariants(bm: BlockManager, sched: Scheduler) -> None:
    live = list(sched.running) + [s for s in sched.waiting if s.block_table]
    held = Counter(b for s in live for b in s.block_table)
    for block in bm.blocks:
        assert block.ref_count == held.get(block.block_id, 0), f"block {block.block_id}: ref {block.ref_count} != holders {held.get(block.block_id, 0)}"
        assert (block.ref_count == 0) == (block.block_id in bm.free)
    for h, block_id in bm.cached.items():
        assert bm.blocks[block_id].hash == h
    assert all(not s.block_table for s in sched.waiting if s.num_computed_tokens == 0)
    if sched.policy == "priority":  # the waiting queue stays in (priority, arrival) order
        ranks = [(s.params.priority, s.seq_id) for s in sched.waiting]
        assert ranks == sorted(ranks)
    for s in sched.running:
        assert len(s.block_table) * bm.block_size >= s.num_computed_tokens
        assert len(s.block_hashes) <= len(s.block_table)
        if s.block_hashes:  # a sequence's cached blocks chain from its own adapter's root: no KV shared across adapters
            assert s.block_hashes[0] == block_hash(bm.root(s), tuple(s.tokens_slice(0, bm.block_size)))
    assert 0.0 <= bm.usage() <= 1.0
    if bm.window is not None:
        pool = bm.window
        held = Counter(b for s in live for b in s.window_table if b != pool.null)
        for block in pool.blocks:
            assert block.ref_count == held.get(block.block_id, 0), f"window block {block.block_id}: ref {block.ref_count}"
            assert (block.ref_count == 0) == (block.block_id in pool.free)
        for s in sched.running:
            assert len(s.window_table) == len(s.block_table)
            seen = s.window_table[max(0, s.num_computed_tokens - pool.window + 1) // bm.block_size:]  # the blocks of keys > c - window
            assert pool.null not in seen, f"sequence {s.seq_id} lost a block its next query sees"


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_len = draw(st.integers(8, 64))
    num_blocks = draw(st.integers(max_len // block_size + 2, max_len // block_size + 40))
    vocab = draw(st.sampled_from([3, 50]))  # a tiny vocabulary makes shared prefixes (cache hits) common
    n = draw(st.integers(1, 25))
    reqs = []
    for _ in range(n):
        plen = draw(st.integers(1, max_len - 1))
        out = draw(st.integers(1, max_len - plen))
        arrive = draw(st.integers(0, 30))
        abort_at = draw(st.one_of(st.none(), st.integers(0, 60)))
        reqs.append((plen, out, arrive, abort_at, draw(st.integers(0, 3))))  # its LoRA adapter (0: none)
    budget = draw(st.integers(max(16, block_size), 96))
    window = draw(st.one_of(st.none(), st.integers(2, 24)))
    # a window pool holding at least one sequence's window, a block, and a step's tokens
    least = -(-window // block_size) + 2 + -(-max(budget, 64) // block_size) if window else 0
    window_blocks = draw(st.integers(least, least + 20)) if window else 0
    return dict(block_size=block_size, num_blocks=num_blocks, vocab=vocab, reqs=reqs, max_loras=draw(st.integers(1, 2)),
                max_num_seqs=draw(st.integers(1, 8)), budget=budget, window=window, window_blocks=window_blocks,
                chunked=draw(st.booleans()), prefix=draw(st.booleans()), seed=draw(st.integers(0, 10**6)),
                policy=draw(st.sampled_from(["fcfs", "priority"])), priorities=draw(st.lists(st.integers(-2, 2), min_size=n, max_size=n)))


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_scheduler_properties(w):
    rng = random.Random(w["seed"])
    pool = WindowPool(w["window_blocks"], w["block_size"], w["window"]) if w["window"] else None
    bm = BlockManager(w["num_blocks"], w["block_size"], w["prefix"], adapter_fingerprint=lambda adapter: bytes([adapter]), window=pool)
    budget = w["budget"] if w["chunked"] else max(w["budget"], 64)
    sched = Scheduler(bm, w["max_num_seqs"], budget, w["chunked"], w["max_loras"], policy=w["policy"])
    seqs, finished, lengths = [], Counter(), {}
    for i, (plen, out, arrive, abort_at, adapter) in enumerate(w["reqs"]):
        prompt = [rng.randrange(w["vocab"]) for _ in range(plen)]
        seqs.append((arrive, abort_at, Sequence(i, f"r{i}", 0, prompt, SamplingParams(max_tokens=out, ignore_eos=True, priority=w["priorities"][i]),
                                             adapter=adapter)))
    for step in range(5000):
        for arrive, abort_at, seq in seqs:
            if arrive == step:
                sched.add(seq)
            if abort_at == step and seq.status is not Status.FINISHED and arrive <= step:
                sched.finish(seq)
                finished[seq.seq_id] += 1
        batch = sched.schedule()
        assert batch.total_tokens <= budget
        assert len({s.adapter for s in sched.running} - {0}) <= w["max_loras"]  # the adapters' slots always suffice
        assert len(batch.seqs) <= w["max_num_seqs"] and len(set(id(s) for s in batch.seqs)) == len(batch.seqs)
        assert all(n >= 1 for n in batch.num_new_tokens)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if pool is not None:  # the window's blocks, and the step's: every one its queries see held, no more
                seen = seq.window_table[max(0, seq.num_computed_tokens - w["window"] + 1) // w["block_size"]:]
                assert pool.null not in seen, f"sequence {seq.seq_id} lost a block its queries see"
                assert pool.held(seq) <= -(-(w["window"] - 1) // w["block_size"]) + 1 + -(-n // w["block_size"]), (pool.held(seq), n)
            assert seq.status is Status.RUNNING and n <= seq.num_tokens - seq.num_computed_tokens
            seq.num_computed_tokens += n
            bm.cache_full_blocks(seq, seq.num_computed_tokens)
            if seq.num_computed_tokens == seq.num_tokens:  # "sample" a token
                seq.output_token_ids.append(rng.randrange(w["vocab"]))
                if seq.length_reached():
                    sched.finish(seq)
                    lengths[seq.seq_id] = len(seq.output_token_ids)
                    finished[seq.seq_id] += 1
        check_invariants(bm, sched)
        if step > 30 and not sched.has_unfinished():
            break
    assert not sched.has_unfinished(), f"starved: {len(sched.waiting)} waiting, {len(sched.running)} running"
    assert all(finished[s.seq_id] == 1 for _, _, s in seqs), "a request finished more or less than once"
    for _, _, s in seqs:
        if s.seq_id in lengths:
            assert lengths[s.seq_id] == s.params.max_tokens
    assert bm.usage() == 0.0 and len(bm.free) == bm.num_blocks
    assert pool is None or len(pool.free) == len(pool.blocks)


def test_evictable_cached_blocks_count_as_free():
    bm = BlockManager(8, 4)
    seq = Sequence(0, "r", 0, list(range(9)), SamplingParams())
    assert bm.allocate(seq, 9)
    bm.cache_full_blocks(seq, 9)
    assert bm.usage() == 3 / 8
    bm.free_seq(seq)
    assert bm.usage() == 0.0 and len(bm.cached) == 2  # still cached, but free
    again = Sequence(1, "r2", 0, list(range(9)), SamplingParams())
    hits = bm.match_prefix(again)
    assert len(hits) == 2
    assert bm.allocate(again, 1, hits) and again.num_computed_tokens == 8


def test_hash_hit_rechecks_token_ids():
    bm = BlockManager(8, 2)
    seq = Sequence(0, "r", 0, [5, 6, 7], SamplingParams())
    bm.allocate(seq, 3)
    bm.cache_full_blocks(seq, 3)
    (h, block_id), = bm.cached.items()
    bm.blocks[block_id].token_ids = (9, 9)  # as if another token run had collided on this hash
    assert bm.match_prefix(Sequence(1, "r2", 0, [5, 6, 7], SamplingParams())) == []


def test_lru_eviction_keeps_recent_prefixes():
    bm = BlockManager(4, 2)
    a = Sequence(0, "a", 0, [1, 2, 3], SamplingParams())
    b = Sequence(1, "b", 0, [4, 5, 6], SamplingParams())
    for s in (a, b):
        bm.allocate(s, 3)
        bm.cache_full_blocks(s, 3)
    bm.free_seq(a)
    bm.free_seq(b)
    c = Sequence(2, "c", 0, [7, 8, 9, 10, 11], SamplingParams())
    assert bm.allocate(c, 5)  # needs 3 blocks: 2 uncached first, then the oldest cached (a's)
    assert bm.match_prefix(Sequence(3, "a2", 0, [1, 2, 3], SamplingParams())) == []
    assert len(bm.match_prefix(Sequence(4, "b2", 0, [4, 5, 6], SamplingParams()))) == 1


def test_abort_frees_blocks_at_once():
    bm = BlockManager(8, 4)
    sched = Scheduler(bm, 4, 64)
    seq = Sequence(0, "r", 0, list(range(10)), SamplingParams())
    sched.add(seq)
    sched.schedule()
    assert bm.usage() > 0
    sched.finish(seq)
    assert bm.usage() == 0 and seq.is_finished and not sched.has_unfinished()
