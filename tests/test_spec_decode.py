"""Speculative decoding: the verification rule on hand-built distributions, then the engine with every
proposer (n-gram, draft model, a random EAGLE-3 head) on the bundled model (greedy output identical to plain decoding, sampling distribution
unchanged), its bookkeeping (KV slots given back, metrics) and its off-switch.

Correctness tests force speculation on (no batch-size or acceptance off-switch)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvpilot.server.config import EngineConfig
from kvpilot.server.engine.model_io import InputBuffers, SamplingTensors
from kvpilot.server.engine.sampler import Sampler
from kvpilot.server.engine.sampling_params import SamplingParams
from kvpilot.server.engine.spec_decode import ngram_lookup
from kvpilot.server.engine.step_message import BatchSeq
from oracle import ORACLE_PROMPTS

FORCED = dict(speculative_disable_batch_size=0, speculative_min_acceptance=0.0)
NEG = float("-inf")


# --- the verification rule ------------------------------------------------------------------

def proposing(prompt, proposal, seq_id=0, **params) -> BatchSeq:
    """A sequence carrying a proposal, as a worker's batch holds it (what the sampling tensors read)."""
    return BatchSeq(seq_id, list(prompt), len(prompt), [], SamplingParams(**params), spec_token_ids=list(proposal), num_spec_tokens=len(proposal))


def verify(logits, seqs, draft_probs=None, generator=None):
    t = SamplingTensors.build(seqs, None, torch.float32, InputBuffers(torch.device("cpu")), draft_probs)
    return Sampler(generator or torch.Generator().manual_seed(0))(logits, t)


def test_greedy_verification_all_accepted_first_rejected_and_bonus():
    logits = torch.tensor([[0.0, 5.0, 0.0, 0.0], [0.0, 0.0, 5.0, 0.0], [0.0, 0.0, 0.0, 5.0]])  # argmaxes 1, 2, 3
    all_ok = verify(logits, [proposing([0], [1, 2], temperature=0)])
    assert all_ok.token_ids == [[1, 2, 3]]  # both accepted, plus the bonus token from the last row
    first_wrong = verify(logits, [proposing([0], [3, 2], temperature=0)])
    assert first_wrong.token_ids == [[1]]  # rejected at once: the target's own token replaces it
    second_wrong = verify(logits, [proposing([0], [1, 0], temperature=0, logprobs=0)])
    assert second_wrong.token_ids == [[1, 2]]
    lp = torch.log_softmax(logits, -1)
    assert second_wrong.logprobs == [[pytest.approx({1: float(lp[0, 1])}), pytest.approx({2: float(lp[1, 2])})]]  # the target's logprobs


def test_a_batch_mixes_proposals_of_different_lengths_with_plain_rows():
    rows = torch.full((6, 5), 0.0)
    for r, best in enumerate([4, 3, 2, 1, 0, 2]):
        rows[r, best] = 9.0
    seqs = [proposing([0], [4, 3], 0, temperature=0), proposing([0], [], 1, temperature=0), proposing([0], [1], 2, temperature=0)]
    # rows: seq 0 -> 0, 1, 2; seq 1 -> 3; seq 2 -> 4, 5
    assert verify(rows, seqs).token_ids == [[4, 3, 2], [1], [0]]


def test_certain_proposal_is_accepted_with_probability_p_and_the_residual_excludes_it():
    """An n-gram proposal (q one-hot at d): accept with probability p(d), else draw from p without d."""
    logits = torch.log(torch.tensor([[0.3, 0.5, 0.2], [1 / 3, 1 / 3, 1 / 3]]))
    g = torch.Generator().manual_seed(1)
    firsts = Counter(verify(logits, [proposing([0], [0], temperature=1.0)], generator=g).token_ids[0][0] for _ in range(4000))
    assert abs(firsts[0] / 4000 - 0.3) < 0.03 and abs(firsts[1] / 4000 - 0.5) < 0.03 and abs(firsts[2] / 4000 - 0.2) < 0.03
    never = torch.log(torch.tensor([[0.0, 0.6, 0.4], [1 / 3, 1 / 3, 1 / 3]]))
    outs = [verify(never, [proposing([0], [0], temperature=1.0)], generator=g).token_ids[0] for _ in range(300)]
    assert all(len(o) == 1 and o[0] != 0 for o in outs)  # p(d) = 0: always rejected, never resampled to d


@pytest.mark.parametrize("p,q", [([0.25, 0.25, 0.5], [0.5, 0.5, 0.0]), ([0.1, 0.6, 0.3], [0.7, 0.1, 0.2]), ([0.5, 0.5, 0.0], [0.5, 0.5, 0.0])])
def test_draft_proposals_verified_by_rejection_sampling_give_the_target_distribution(p, q):
    """Draw d ~ q, verify against p: the first token is distributed as p, whatever q is."""
    g = torch.Generator().manual_seed(2)
    logits = torch.log(torch.tensor([p, [1 / 3] * 3]))
    qt = torch.tensor(q)
    n, counts, rejected = 6000, Counter(), 0
    for d in torch.multinomial(qt, n, replacement=True, generator=g).tolist():
        s = proposing([0], [d], temperature=1.0)
        out = verify(logits, [s], {s.seq_id: qt[None, :]}, generator=g).token_ids[0]
        counts[out[0]] += 1
        rejected += len(out) == 1
    for token, expected in enumerate(p):
        assert abs(counts[token] / n - expected) < 0.025, (token, counts)
    assert (rejected > 0) == (p != q)  # identical distributions never reject


# --- n-gram lookup ----------------------------------------------------------------------------

def test_ngram_lookup_takes_the_longest_suffix_and_its_most_recent_occurrence():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 1, 3, 2) == [7, 5]  # most recent "1 2 3"
    assert ngram_lookup([4, 2, 3, 8, 1, 2, 3], 2, 3, 3) == [8, 1, 2]  # "1 2 3" unseen, "2 3" seen
    assert ngram_lookup([1, 2, 3, 4], 1, 3, 3) == []
    assert ngram_lookup([5, 6, 5], 1, 2, 4) == [6, 5]  # the continuation may run into the suffix itself


# --- the engine -------------------------------------------------------------------------------

COPY_PROMPTS = [
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\ndef add3(a, b, c):\n    return add(add(a, b), c)\n\ndef add4(a, b, c, d):\n    return",
    "<|im_start|>user\nList the days of the week, Monday to Sunday, twice.<|im_end|>\n<|im_start|>assistant\n",
    "The capital of France is",
]


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory, model_path):
    from kvpilot.server.gguf_loader import write_truncated

    return str(write_truncated(model_path, tmp_path_factory.mktemp("draft") / "draft4.gguf", 4))


@pytest.fixture(scope="module")
def eagle_path(tmp_path_factory, model_path):
    """A random EAGLE-3 head for the bundled model. Its draft vocabulary is the distribution prompt's
    tokens and eight others: random logits over so few still hit the target's choices now and then."""
    from eagle_factory import write_eagle3_head
    from kvpilot.server.loading import open_model

    weights, tokenizer = open_model(model_path)
    draft = set(tokenizer.encode(DISTRIBUTION_PROMPT)) | set(range(8))
    return str(write_eagle3_head(tmp_path_factory.mktemp("eagle") / "head", weights.config, sorted(draft)))


def method_kw(method: str, draft_path: str, eagle_path: str) -> dict:
    """draft-lookup, eagle3-lookup: n-gram lookup first (up to 5 tokens), the model for the rest (2 drafted)."""
    if method.endswith("-lookup"):
        return {**method_kw(method.removesuffix("-lookup"), draft_path, eagle_path), "speculative_lookup": True,
                "num_speculative_tokens": 2, "speculative_lookup_tokens": 5}
    return {"speculative_method": method, **({"speculative_model": draft_path} if method == "draft" else {}),
            **({"speculative_model": eagle_path} if method == "eagle3" else {})}


def make_engine(**kw):
    from kvpilot.server.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(num_threads=1, **kw), show_progress=False)


def run(engine, prompts, params):
    """All requests to completion (`params` for all, or a list: one per prompt): (outputs in prompt
    order, streamed text per request)."""
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params if isinstance(params, list) else [params] * len(prompts), strict=True)]
    done, streamed = {}, {i: "" for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id] += out.outputs[0].text_delta
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids], [streamed[i] for i in ids]


# Five of the HF-oracle prompts (plain decoding equals HF on them: test_hf_equivalence.py) and the copy-heavy ones.
GREEDY_PROMPTS = ORACLE_PROMPTS[:5] + COPY_PROMPTS[:3]
GREEDY = SamplingParams(temperature=0, max_tokens=32)


@pytest.fixture(scope="module")
def plain_greedy():
    outs, _ = run(make_engine(kv_cache_memory="64MiB"), GREEDY_PROMPTS, GREEDY)
    return [o.outputs[0].token_ids for o in outs]


SETTINGS = {
    "batched": dict(kv_cache_memory="64MiB"),
    # 64-token steps: prompts are prefilled in chunks, and verification rows share steps with them.
    "chunked": dict(kv_cache_memory="64MiB", max_num_batched_tokens=64),
    # 20 blocks of 16 tokens (K and V, 30 layers, 3 KV heads of 64 fp32; and the scratch block) for 8
    # sequences of up to ~80 tokens: sequences are preempted and recomputed.
    "preempted": dict(kv_cache_memory=21 * (2 * 30 * 16 * 3 * 64 * 4), block_size=16),
    # Decode steps (verifications: k + 1 rows per sequence) and the draft's proposal steps through the
    # CUDA graphs' static buffers, run without capture (decode_graphs.py), padding rows included.
    "graph-buffers": dict(kv_cache_memory="64MiB"),
    # Async scheduling: each step's proposal made on the device from the step in flight's tokens and
    # accepted counts, its rows moved on there; with preemptions of sequences whose verification is in flight.
    "async": dict(kv_cache_memory="64MiB", async_scheduling="on"),
    "async-preempted": dict(kv_cache_memory=21 * (2 * 30 * 16 * 3 * 64 * 4), block_size=16, async_scheduling="on"),
}
ASYNC_METHODS = ("draft", "eagle3")  # n-gram proposals are looked up on the host: its steps stay synchronous


# An EAGLE-3 head reads each step's hidden states: its engine runs no decode graphs (checked below); its
# chunked and preempted runs batch all the prompts too. With lookup first, one batch mixes looked-up
# proposals and the head's.
@pytest.mark.parametrize(("method", "setting"), [(m, s) for m in ("ngram", "draft", "eagle3") for s in SETTINGS
                                                 if (m != "eagle3" or s in ("chunked", "preempted", "async", "async-preempted"))
                                                 and (m in ASYNC_METHODS or not s.startswith("async"))] + [("eagle3-lookup", "preempted"), ("draft-lookup", "batched")])
def test_greedy_speculation_is_token_for_token_plain_decoding(method, setting, plain_greedy, draft_path, eagle_path):
    kw = dict(SETTINGS[setting], **method_kw(method, draft_path, eagle_path), **FORCED)
    if setting.endswith("preempted"):  # a block now also holds the draft's 4 layers, or the head's one
        kw["kv_cache_memory"] = kw["kv_cache_memory"] * {"ngram": 30, "draft": 34}.get(method, 31) // 30
    engine = make_engine(**kw)
    assert engine.async_scheduling is setting.startswith("async")
    shifted = []  # async: steps whose verifications follow one in flight (rows moved on by its accepted counts on the device)
    launch = engine.worker.launch
    engine.worker.launch = lambda inp, previous=None, proposal=None: (
        shifted.append(inp.shift is not None and inp.from_proposal is not None) or launch(inp, previous, proposal))
    sources = Counter()  # *-lookup: proposals looked up, and the model's
    if method.endswith("-lookup"):
        plan, propose = engine.proposer.plan, engine.worker.drafter.propose

        def counted_plan(running):
            plan(running)
            sources["looked up"] += len(engine.proposer.looked_up)

        def counted_propose(batch, previous=None):
            proposal = propose(batch, previous)
            sources["drafted"] += len(proposal.index) if proposal else 0
            sources["longest drafted"] = max(sources["longest drafted"], proposal.tokens.shape[1] if proposal else 0)
            return proposal

        engine.proposer.plan, engine.worker.drafter.propose = counted_plan, counted_propose
    graph_rows = []
    if setting == "graph-buffers":
        engine.worker.start_decode_graphs(engine.max_model_len, capture=False)
        drafter = engine.worker.drafter
        for graphs in (engine.worker.decode_graphs, drafter.graphs if method == "draft" else None):
            if graphs is not None:
                plain_run = graphs.run
                graphs.run = lambda inp, plain_run=plain_run: graph_rows.append(inp.input_ids.shape[0]) or plain_run(inp)
        assert (getattr(drafter, "graphs", None) is not None) == (method == "draft")
    outs, streamed = run(engine, GREEDY_PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == plain_greedy
    if setting == "graph-buffers":
        assert graph_rows and any(rows not in engine.worker.decode_graphs.buckets for rows in graph_rows)  # padded steps ran
    assert streamed == [o.outputs[0].text for o in outs]  # multi-token deltas stream the same text
    stats = engine.proposer.stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    if method != "eagle3":  # a random head's proposals are all but never right: counted, and exact all the same
        assert stats.num_accepted_tokens > 0
    if method.startswith("eagle3"):
        engine.worker.start_decode_graphs(engine.max_model_len, capture=False)
        assert engine.worker.decode_graphs is None and engine.worker.drafter.kv_cache[0].shape[0] == engine.worker.num_blocks + 1
    if setting.endswith("preempted"):
        assert engine.scheduler.num_preemptions > 0
    assert (sum(shifted) > 10) is setting.startswith("async")
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # every slot reserved for a proposal came back
    if method == "ngram" or method.endswith("-lookup"):
        assert stats.accepted_per_pos[1] > 0  # runs of several accepted tokens happened (the copy prompts' lookups)
    if method.endswith("-lookup"):
        assert sources["looked up"] > 0 and sources["drafted"] > 0
        assert stats.accepted_per_pos[3] > 0 and sources["longest drafted"] == 2  # lookups longer than the model's drafts
        # the looked-up proposals' own counters: one per verified lookup (a preempted sequence's was never
        # verified), the model's the rest (never past its 2 drafts)
        lookup = stats.lookup
        assert 0 < lookup.num_drafts <= sources["looked up"] and lookup.num_drafts < stats.num_drafts
        assert stats.num_drafts - lookup.num_drafts == sources["drafted"]
        assert lookup.num_accepted_tokens <= lookup.num_draft_tokens and lookup.accepted_per_pos[3] == stats.accepted_per_pos[3] > 0
    else:
        assert stats.lookup is None


def test_an_eagle_head_above_the_batch_threshold_writes_kv_only_and_proposes_below_it(plain_greedy, eagle_path):
    """Above speculative_disable_batch_size the head's pass writes its K/V alone (no state at any row:
    no proposal follows); as sequences finish and the batch falls to the threshold, proposals start
    from complete head caches; greedy output stays plain decoding's."""
    engine = make_engine(kv_cache_memory="64MiB", speculative_method="eagle3", speculative_model=eagle_path,
                         speculative_disable_batch_size=3, speculative_min_acceptance=0.0)
    states = []
    launch = engine.worker.launch
    engine.worker.launch = lambda inp, previous=None, proposal=None: states.append(inp.head_states) or launch(inp, previous, proposal)
    lengths = [4 + 4 * i for i in range(len(GREEDY_PROMPTS))]  # they end one by one: the batch shrinks to the threshold
    outs, _ = run(engine, GREEDY_PROMPTS, [SamplingParams(temperature=0, max_tokens=n) for n in lengths])
    assert [o.outputs[0].token_ids for o in outs] == [tokens[:n] for tokens, n in zip(plain_greedy, lengths)]
    assert False in states and True in states and engine.proposer.stats.num_drafts > 0

    def head_cache_after_a_prefill(states: bool) -> list[torch.Tensor]:
        engine = make_engine(kv_cache_memory="64MiB", speculative_method="eagle3", speculative_model=eagle_path)
        launch = engine.worker.launch

        def spy(inp, previous=None, proposal=None):
            inp.head_states = states
            return launch(inp, previous, proposal)

        engine.worker.launch = spy
        engine.add_request(GREEDY_PROMPTS[0], SamplingParams(temperature=0, max_tokens=1))
        engine.step()
        return [c[:-1].clone() for c in engine.worker.drafter.kv_cache]  # (the last block: the scratch block)

    # The K/V-only pass writes what the whole layer's pass writes.
    whole, kv_only = head_cache_after_a_prefill(True), head_cache_after_a_prefill(False)
    assert whole[0].abs().sum() > 0 and all(torch.equal(a, b) for a, b in zip(whole, kv_only))


def test_a_truncated_draft_is_accepted_sometimes_and_rejections_are_resampled(draft_path):
    engine = make_engine(kv_cache_memory="64MiB", speculative_method="draft", speculative_model=draft_path, **FORCED)
    # The draft's cache is carved from the same budget: a block costs 30 target + 4 draft layers of K/V
    # (one of them the scratch block).
    layer_block = 2 * 16 * 3 * 64 * 4
    assert engine.worker.num_blocks == (64 << 20) // (34 * layer_block) - 1 and len(engine.worker.drafter.kv_caches) == 4
    run(engine, COPY_PROMPTS, SamplingParams(temperature=1.0, max_tokens=32, seed=3))
    s = engine.proposer.stats
    assert 0 < s.num_accepted_tokens / s.num_draft_tokens < 0.95
    assert s.num_draft_tokens - s.num_accepted_tokens > 0  # rejected proposals: each drew from the residual max(0, p - q)


def _chi_square_p_value(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of homogeneity (categories seen in either sample)."""
    keys = sorted(set(a) | set(b))
    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for k in keys:
        total = a[k] + b[k]
        for count, n in ((a[k], na), (b[k], nb)):
            expected = total * n / (na + nb)
            stat += (count - expected) ** 2 / expected
    df = len(keys) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


DISTRIBUTION_PROMPT = "one two three four one two three four one two three four one two three"  # 15 tokens
DISTRIBUTION_PARAMS = [SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True, seed=s) for s in range(300)]
DISTRIBUTION_KW = dict(kv_cache_memory="64MiB", max_num_seqs=64, block_size=8)  # a full block of the prompt to share


def _sample_all(engine) -> list[list[int]]:
    """The first request runs one step alone, so that the others find the prompt's first block in the
    prefix cache and prefill only its last 7 tokens (each request has its own seed: its samples do not
    depend on what it is batched with)."""
    outs = []
    for i, p in enumerate(DISTRIBUTION_PARAMS):
        engine.add_request(DISTRIBUTION_PROMPT, p, request_id=f"s{i}")
        if i == 0:
            outs += [o for o in engine.step() if o.finished]
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain_samples():
    """The no-speculation side of the distribution test, shared by both methods (seeded: the same
    300 samples either way)."""
    return _sample_all(make_engine(**DISTRIBUTION_KW))


@pytest.mark.parametrize(("method", "async_scheduling"), [("ngram", "off"), ("draft", "off"), ("eagle3", "off"), ("draft", "on"), ("eagle3", "on"),
                                                          ("eagle3-lookup", "off")])
def test_sampling_distribution_is_unchanged_by_speculation(method, async_scheduling, draft_path, eagle_path, plain_samples):
    """Temperature 1 (top-k 4 keeps the support small enough to test), 300 seeds each way: the tokens at
    output positions 2 and 3 (the first comes from the prefill and is never speculated) are distributed
    the same with and without speculation (chi-square homogeneity, p > 0.001 on this fixed seed set),
    while rejections did happen; with async scheduling too (proposals drawn on the device)."""
    engine = make_engine(**DISTRIBUTION_KW, **method_kw(method, draft_path, eagle_path), **FORCED, async_scheduling=async_scheduling)
    spec_samples = _sample_all(engine)
    s = engine.proposer.stats
    assert s.num_drafts > 100 and 0 < s.num_accepted_tokens < s.num_draft_tokens
    for position in (1, 2):
        a = Counter(ids[position] for ids in plain_samples)
        b = Counter(ids[position] for ids in spec_samples)
        assert _chi_square_p_value(a, b) > 1e-3, (position, a, b)


@pytest.mark.parametrize("method", ["ngram", "draft-async"])
def test_stops_inside_an_accepted_run_end_the_sequence_at_the_right_token(method, plain_greedy, model_path):
    """EOS-like stops, stop strings, max_tokens and min_tokens falling inside a run of accepted tokens;
    with async scheduling, while the next step (its proposal made on the device) is in flight: there the
    model drafts for itself (every greedy proposal accepted)."""
    kw = dict(speculative_method="ngram") if method == "ngram" else dict(speculative_method="draft", speculative_model=str(model_path), async_scheduling="on")
    engine = make_engine(kv_cache_memory="64MiB", **kw, **FORCED)
    plain = make_engine(kv_cache_memory="64MiB")
    full = plain_greedy[GREEDY_PROMPTS.index(COPY_PROMPTS[1])]  # the code prompt: its output copies long runs of its context
    tok = engine.tokenizer
    cases = [SamplingParams(temperature=0, max_tokens=27),
             SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[full[30]]),
             SamplingParams(temperature=0, max_tokens=48, stop=[tok.decode(full[25:27]).strip()]),
             SamplingParams(temperature=0, max_tokens=40, min_tokens=35, stop_token_ids=[full[20]]),
             SamplingParams(temperature=0, max_tokens=30, n=2)]
    # all cases in one batch each way (speculation is forced on at any batch size)
    for params, want, got in zip(cases, run(plain, COPY_PROMPTS[1:2] * len(cases), cases)[0], run(engine, COPY_PROMPTS[1:2] * len(cases), cases)[0]):
        assert [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in got.outputs] == \
               [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in want.outputs], params
    assert engine.proposer.stats.accepted_per_pos[2] > 0


def test_seeded_speculative_sampling_is_reproducible(draft_path):
    params = SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.2, max_tokens=24, seed=11)
    results = []
    for _ in range(2):
        engine = make_engine(kv_cache_memory="64MiB", speculative_method="draft", speculative_model=draft_path, **FORCED)
        results.append([o.outputs[0].token_ids for o in run(engine, COPY_PROMPTS[:2], params)[0]])
    assert results[0] == results[1] and all(len(r) == 24 for r in results[0])


def test_spec_decode_metrics_are_exported(draft_path):
    from kvpilot.server.api.metrics import EngineMetrics

    engine = make_engine(kv_cache_memory="64MiB", speculative_method="ngram", **FORCED)
    run(engine, COPY_PROMPTS[:1], SamplingParams(temperature=0, max_tokens=32))
    from prometheus_client import generate_latest

    text = generate_latest(EngineMetrics(engine, "m", engine.max_model_len).registry).decode()
    s = engine.proposer.stats
    assert f'kvpilot:spec_decode_num_drafts_total{{model_name="m"}} {float(s.num_drafts)}' in text
    assert f'kvpilot:spec_decode_num_draft_tokens_total{{model_name="m"}} {float(s.num_draft_tokens)}' in text
    assert f'kvpilot:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(s.num_accepted_tokens)}' in text
    assert f'kvpilot:spec_decode_num_accepted_tokens_per_pos_total{{model_name="m",position="0"}} {float(s.accepted_per_pos[0])}' in text
    assert s.num_accepted_tokens > 0 and "spec_decode_lookup" not in text
    assert "spec_decode" not in generate_latest(EngineMetrics(make_engine(kv_cache_memory="16MiB"), "m", 2048).registry).decode()


def test_lookup_first_exports_the_looked_up_proposals_counters(draft_path):
    """--speculative-lookup: the spec_decode counters count both sources; spec_decode_lookup_* the
    looked-up proposals alone, so the model's acceptance by position is the difference."""
    from prometheus_client import generate_latest

    from kvpilot.server.api.metrics import EngineMetrics

    engine = make_engine(kv_cache_memory="64MiB", speculative_method="draft", speculative_model=draft_path, speculative_lookup=True,
                         num_speculative_tokens=2, speculative_lookup_tokens=4, **FORCED)
    run(engine, COPY_PROMPTS[:2], SamplingParams(temperature=0, max_tokens=32))
    text = generate_latest(EngineMetrics(engine, "m", engine.max_model_len).registry).decode()
    s, lookup = engine.proposer.stats, engine.proposer.stats.lookup
    assert 0 < lookup.num_drafts < s.num_drafts and 0 < lookup.num_accepted_tokens < s.num_accepted_tokens
    assert f'kvpilot:spec_decode_lookup_num_drafts_total{{model_name="m"}} {float(lookup.num_drafts)}' in text
    assert f'kvpilot:spec_decode_lookup_num_draft_tokens_total{{model_name="m"}} {float(lookup.num_draft_tokens)}' in text
    assert f'kvpilot:spec_decode_lookup_num_accepted_tokens_total{{model_name="m"}} {float(lookup.num_accepted_tokens)}' in text
    for position in range(4):
        assert (f'kvpilot:spec_decode_lookup_num_accepted_tokens_per_pos_total{{model_name="m",position="{position}"}} '
                f'{float(lookup.accepted_per_pos[position])}') in text
    assert f'kvpilot:spec_decode_num_drafts_total{{model_name="m"}} {float(s.num_drafts)}' in text
    assert s.accepted_per_pos[2] == lookup.accepted_per_pos[2]  # past the model's 2 drafts, only lookups


def test_off_switch_batch_size_and_low_acceptance():
    from kvpilot.server.engine.spec_decode import PAUSE_STEPS

    busy = make_engine(kv_cache_memory="64MiB", speculative_method="ngram", speculative_disable_batch_size=2)
    run(busy, COPY_PROMPTS[:3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert busy.proposer.stats.num_drafts == 0  # three running sequences > 2: no step speculated
    engine = make_engine(kv_cache_memory="64MiB", speculative_method="ngram", speculative_disable_batch_size=0, speculative_min_acceptance=1.0)
    engine.add_request(COPY_PROMPTS[1], SamplingParams(temperature=0, max_tokens=48))
    paused_steps = []
    while engine.has_unfinished_requests():
        engine.step()
        paused_steps += [a.paused_steps for a in engine.proposer.acceptance.values() if a.paused_steps]
    assert PAUSE_STEPS in paused_steps and PAUSE_STEPS - 1 in paused_steps  # acceptance below 100% paused it, and the pause counts down


def test_low_acceptance_pauses_double_while_it_stays_low_and_reset_after_a_good_window():
    from kvpilot.server.engine.spec_decode import MAX_PAUSE_STEPS, PAUSE_STEPS, NgramProposer

    proposer = NgramProposer(EngineConfig(speculative_method="ngram", speculative_min_acceptance=0.25), max_model_len=100)
    s = proposing([0], [1, 2, 3, 4])
    pauses = []
    for accepted in (0, 1, 0, 0, 0, 0, 0, 0, 4, 4, 0, 0):  # windows of two proposals of 4
        proposer.verified([(s, 4, accepted)])
        pauses.append(proposer.acceptance[s.seq_id].paused_steps)
        proposer.acceptance[s.seq_id].paused_steps = 0
    assert pauses[1] == PAUSE_STEPS and pauses[3] == 2 * PAUSE_STEPS and pauses[5] == 4 * PAUSE_STEPS and pauses[7] == 8 * PAUSE_STEPS
    assert pauses[9] == 0 and pauses[11] == PAUSE_STEPS  # 8 of 8 accepted reset the backoff
    assert max(pauses) <= MAX_PAUSE_STEPS and proposer.stats.num_accepted_tokens == 9 and proposer.stats.num_draft_tokens == 48


def test_bad_speculative_configs_are_refused(tmp_path, model_path):
    with pytest.raises(ValueError, match="needs speculative_model"):
        EngineConfig(speculative_method="draft")
    with pytest.raises(ValueError, match="only used with speculative_method=draft"):
        EngineConfig(speculative_method="ngram", speculative_model="x.gguf")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(speculative_method="ngram", prompt_lookup_min=5, prompt_lookup_max=3)
    for method in ("ngram", None):
        with pytest.raises(ValueError, match=f"speculative_lookup combines .* \\(not {method}"):
            EngineConfig(speculative_method=method, speculative_lookup=True)
    with pytest.raises(ValueError, match="speculative_lookup_tokens is only used with speculative_lookup"):
        EngineConfig(speculative_method="eagle3", speculative_model="head", speculative_lookup_tokens=4)
    with pytest.raises(ValueError, match="async_scheduling=on with speculative_lookup"):
        EngineConfig(speculative_method="eagle3", speculative_model="head", speculative_lookup=True, async_scheduling="on")
    import numpy as np

    from gguf_factory import write_gguf

    other = write_gguf(tmp_path / "other.gguf", {"token_embd.weight": (np.zeros((4, 8), np.float32), "F32")},
                       metadata={"llama.block_count": 1, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "c", "d"]})
    with pytest.raises(ValueError, match="does not share the model's tokenizer"):
        make_engine(kv_cache_memory="16MiB", speculative_method="draft", speculative_model=str(other))
