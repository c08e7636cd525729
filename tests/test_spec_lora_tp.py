"""Speculation, LoRA, tensor parallelism and async scheduling together (issue #63), pairwise: every
pair of values of the four axes appears in at least one engine below, not their full product.

  tensor parallelism   1 and 3 (the bundled model: 9 query / 3 KV heads), 2 (the tiny Qwen2 test checkpoint
                       tests/test_tensor_parallel_families.py splits, with four layers here)
  speculation          none, n-gram, a draft model (a 4-layer truncation of the bundled model, split over three
                       ranks as the target is; the tiny checkpoint itself, whole on rank 0 over two), an EAGLE-3
                       head (random, whole on rank 0)
  LoRA                 off, on (a peft adapter; the batch mixes adapter rows and base rows)
  async scheduling     off, on (on a CPU `auto` is off: `on` is what `auto` does on a GPU; n-gram keeps its
                       steps synchronous, so its rows are off)
  KV tier              none, host, disk, host and disk (issue #64: the KV connector)
  prefill/decode       off, on (kv_role both: the engine hands its prompts' blocks off to itself, read with NIXL
                       rank to rank)

Each engine's greedy tokens equal plain decoding of the same model and adapter on as many ranks (one
plain engine per model and rank count, LoRA slots on, run with and without the adapter); with a KV tier,
served again after the prefix cache forgot the prompts (their blocks come back from the tier), and with
prefill/decode, decoded from blocks a prefill request held and the cache forgot (pulled), they are still
plain decoding's — a drafter's proposals as good as on computed blocks (its K/V moved with them); the draft model and
EAGLE-3 head rows over three ranks also run 8 requests in one batch, with two adapters and a grammar, and
give one rank's tokens. A draft model split over two ranks keeps the sampling distribution (seeded,
chi-square) and proposes what it proposes on one rank."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

PROMPTS = ["one two three four one two three four one two", "The capital of France is", "A code like 123-abc:", "def fibonacci(n):"]
ADAPTED = [False, True, False, True]  # with LoRA on: which prompts run with the adapter (the others the base model)
# (ranks, speculation, LoRA, async scheduling, KV tier, prefill/decode): a pairwise covering set of the six axes
ROWS = [(1, "none", False, "off", "none", "on"), (1, "ngram", True, "off", "host+disk", "on"), (1, "draft", True, "on", "host", "on"),
        (1, "eagle3", False, "on", "host", "off"), (2, "none", True, "on", "host+disk", "on"), (2, "ngram", False, "off", "none", "off"),
        (2, "draft", False, "off", "host+disk", "off"), (2, "eagle3", True, "off", "disk", "on"), (3, "none", False, "off", "host", "off"),
        (3, "ngram", True, "off", "disk", "on"), (3, "draft", True, "on", "none", "off"), (3, "eagle3", True, "on", "host+disk", "on"),
        (2, "none", False, "on", "disk", "off"), (2, "ngram", False, "off", "host", "on"), (1, "draft", False, "on", "disk", "on"),
        (3, "eagle3", False, "off", "none", "on")]


def test_the_rows_cover_every_pair_of_axis_values():
    values = [{1, 2, 3}, {"none", "ngram", "draft", "eagle3"}, {False, True}, {"off", "on"}, {"none", "host", "disk", "host+disk"}, {"off", "on"}]
    refused = {("ngram", "on")}  # n-gram's lookups read each step's tokens on the host (EngineConfig refuses it)
    for i in range(6):
        for j in range(i + 1, 6):
            wanted = {(a, b) for a in values[i] for b in values[j]} - (refused if (i, j) == (1, 3) else set())
            assert wanted <= {(row[i], row[j]) for row in ROWS}, (i, j)


def test_a_draft_model_is_split_where_it_fits_unless_asked_otherwise(model_path):
    from kvpilot.server.config import EngineConfig
    from kvpilot.server.loading import draft_split, open_model

    weights, _ = open_model(model_path)  # 9 query heads, 3 KV heads, FFN width 1536
    split = lambda **kw: draft_split(EngineConfig(speculative_method="draft", speculative_model="d", **kw), weights)  # noqa: E731
    assert split(tensor_parallel_size=3) and split(tensor_parallel_size=3, speculative_draft_tensor_parallel_size=3)
    assert not split(tensor_parallel_size=3, speculative_draft_tensor_parallel_size=1)
    assert not split(tensor_parallel_size=2) and not split(tensor_parallel_size=1)  # 9 heads over 2 ranks: whole on rank 0
    with pytest.raises(ValueError, match=r"speculative_draft_tensor_parallel_size=2: the draft model cannot be split \(tensor_parallel_size=2 "
                                         r"does not fit .*the 9 query heads.*; 1 keeps it whole on rank 0"):
        split(tensor_parallel_size=2, speculative_draft_tensor_parallel_size=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory, model_path, lora_peft_case):
    """Per rank count: the model, its adapter, its draft model and a random EAGLE-3 head; for two ranks
    also a draft that differs a little (the tiny checkpoint with another RoPE base), for the distribution
    test."""
    from transformers import AutoModelForCausalLM

    from checkpoint_factory import CASES, build_checkpoint, save_tokenizer
    from eagle_factory import write_eagle3_head
    from kvpilot.server.gguf_loader import write_truncated
    from kvpilot.server.loading import open_model
    from lora_factory import save_adapter

    root = tmp_path_factory.mktemp("composition")
    tokenizer_dir = save_tokenizer(model_path, root / "tokenizer")
    weights, tokenizer = open_model(model_path)
    draft_vocab = sorted(set(tokenizer.encode(" ".join(PROMPTS))) | set(range(8)))
    bundled = {"model": str(model_path), "adapter": str(lora_peft_case[0]["all7-r8"]),
               "draft": str(write_truncated(model_path, root / "draft4.gguf", 4)),
               "eagle3": str(write_eagle3_head(root / "head", weights.config, draft_vocab))}
    # the Qwen2 test checkpoint with four layers (an EAGLE-3 head reads three different ones)
    case = CASES["qwen2"]
    four = {**case.config, "num_hidden_layers": 4}
    tiny = build_checkpoint(replace(case, config=four), root / "qwen2-4", tokenizer_dir)
    _, adapter = save_adapter(AutoModelForCausalLM.from_pretrained(str(tiny)), "all7-r8", root / "tiny-adapters")
    tiny_weights, _ = open_model(tiny)
    small = {"model": str(tiny), "adapter": str(adapter), "draft": str(tiny),
             # the same weights, another RoPE base: its attention differs a little (accepted about half the time)
             "near draft": str(build_checkpoint(replace(case, config={**four, "rope_theta": 1e4}), root / "qwen2-4-theta", tokenizer_dir)),
             "eagle3": str(write_eagle3_head(root / "tiny-head", tiny_weights.config, draft_vocab, aux_layers=[0, 1, 3]))}
    return {1: bundled, 2: small, 3: bundled}


def engine(ranks: int, model: dict, speculation: str = "none", lora: bool = True, async_scheduling: str = "off", tier: str = "none",
           pd: str = "off", tier_dir=None, **extra):
    from kvpilot.server import LLM

    if tier != "none" or pd == "on":  # (blocks of 4 tokens: every prompt here has some to save and load)
        extra["block_size"] = 4
    if "host" in tier:
        extra["kv_host_offload_size"] = "16MiB"
    if "disk" in tier:
        extra["kv_offload_dir"] = str(tier_dir)
    if pd == "on":
        extra.update(kv_role="both", kv_transfer_port=0, kv_transfer_timeout=20)

    spec = {} if speculation == "none" else {"speculative_method": speculation, "speculative_disable_batch_size": 0,
                                             "speculative_min_acceptance": 0.0}
    if speculation in ("draft", "eagle3"):
        spec["speculative_model"] = model[speculation]
    if speculation == "draft" and ranks == 2:  # whole on rank 0 unless asked (over three ranks: split, as it fits)
        spec["speculative_draft_tensor_parallel_size"] = extra.pop("speculative_draft_tensor_parallel_size", 1)
    lora_kw = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16} if lora else {}
    return LLM(model=model["model"], num_threads=1, show_progress=False, tensor_parallel_size=ranks, kv_cache_memory="32MiB",
               max_num_batched_tokens=32, async_scheduling=async_scheduling, **spec, **{**lora_kw, **extra})


def greedy(llm, model: dict, adapted: list[bool], transfers: list[dict] | None = None) -> list[list[int]]:
    """Each prompt's greedy tokens (transfers: each decoded from the blocks its kv_transfer_params name)."""
    from kvpilot.server import SamplingParams
    from kvpilot.server.adapters import LoRARequest
    from kvpilot.server.engine.sampling_params import KVTransferParams

    lora = LoRARequest("all7-r8", 1, model["adapter"])
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                             kv_transfer=KVTransferParams.from_dict(transfers[i]) if transfers else None) for i in range(len(PROMPTS))]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, lora_request=[lora if a else None for a in adapted])]


def served_from_outside(llm, model: dict, adapted: list[bool], tier: str, pd: str) -> dict:
    """After a first round: the prompts served again from the KV tier once the prefix cache forgot them,
    and decoded from blocks prefill requests held once the cache (and the tiers) forgot them; each
    round's tokens and what came from where."""
    from kvpilot.server import SamplingParams
    from kvpilot.server.adapters import LoRARequest
    from kvpilot.server.engine.sampling_params import KVTransferParams

    connector, out = llm.engine.kv_connector, {}
    proposer = llm.engine.proposer

    def accepted() -> int:
        return proposer.stats.num_accepted_tokens if proposer else 0

    if tier != "none":
        connector.drain()
        llm.engine.reset_prefix_cache()
        before = accepted()
        out["tier"] = greedy(llm, model, adapted)
        out["tier accepted"] = accepted() - before
        out["tier hits"] = sum(t.stats.hit_blocks for t in (connector.host, connector.disk) if t is not None)
    if pd == "on":
        lora = LoRARequest("all7-r8", 1, model["adapter"])
        prefill = SamplingParams(temperature=0, max_tokens=1, kv_transfer=KVTransferParams(do_remote_decode=True))
        transfers = [o.kv_transfer_params for o in llm.generate(PROMPTS, prefill, lora_request=[lora if a else None for a in adapted])]
        llm.engine.reset_prefix_cache(external=True)  # the held blocks stay held; nothing else has them
        before = accepted()
        out["pd"] = greedy(llm, model, adapted, transfers)
        out["pd accepted"] = accepted() - before
        out["pulled"] = connector.receiver.stats.pulled_blocks
    return out


@pytest.fixture(scope="module")
def plain(models, lora_peft_case):
    """Plain decoding per rank count: with the adapter where ADAPTED says, and without any (one
    tensor-parallel engine at a time in a process); on one rank, the mixed batch too."""
    out = {}
    for ranks in (1, 2, 3):
        llm = engine(ranks, models[ranks])
        try:
            out[ranks] = {True: greedy(llm, models[ranks], ADAPTED), False: greedy(llm, models[ranks], [False] * len(PROMPTS))}
            if ranks == 1:
                out["mixed"] = mixed(llm, lora_peft_case[0])
        finally:
            llm.engine.close()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("ranks", "speculation", "lora", "async_scheduling", "tier", "pd"), ROWS, ids=["-".join(map(str, r)) for r in ROWS])
def test_greedy_output_is_plain_decodings_in_every_composition(models, plain, lora_peft_case, tmp_path, ranks, speculation, lora,
                                                               async_scheduling, tier, pd):
    llm = engine(ranks, models[ranks], speculation, lora, async_scheduling, tier, pd, tmp_path)
    adapted = ADAPTED if lora else [False] * len(PROMPTS)
    try:
        assert llm.engine.async_scheduling is (async_scheduling == "on")
        got = greedy(llm, models[ranks], adapted)
        stats = llm.engine.proposer.stats if llm.engine.proposer else None
        accepted = stats.num_accepted_tokens if stats else 0
        held = llm.engine.describe_ranks() if ranks > 1 else None
        mixed_batch = mixed(llm, lora_peft_case[0]) if ranks == 3 and speculation in ("draft", "eagle3") and tier == pd == "none" else None
        outside = served_from_outside(llm, models[ranks], adapted, tier, pd)
    finally:
        llm.engine.close()
    assert got == plain[ranks][lora]
    for served in ("tier", "pd"):  # from blocks that came from outside the cache: the same tokens
        assert outside.get(served, got) == got, (served, outside)
    if tier != "none":
        assert outside["tier hits"] > 0, outside
    if pd == "on":
        assert outside["pulled"] > 0, outside
    for served in ("tier", "pd"):  # the drafter's K/V came with the blocks: its proposals are as good as on computed ones
        if speculation in ("draft", "eagle3") and served in outside:
            assert outside[f"{served} accepted"] >= 0.8 * accepted, (served, accepted, outside)
    # (n-gram on the random tiny checkpoint: its output never repeats its context, nothing to look up)
    if speculation in ("draft", "eagle3") or (speculation == "ngram" and ranks != 2):
        assert stats.num_drafts > 0, stats
    if speculation == "draft" and ranks > 1:
        draft_bytes = [r.get("draft_projection_bytes", 0) for r in held]
        if ranks == 3:  # split: a third on each rank (its 3 KV heads one each)
            assert draft_bytes == [draft_bytes[0]] * 3 and draft_bytes[0] > 0 and [r["draft_kv_heads"] for r in held] == [1] * 3, held
        else:  # whole on rank 0
            assert draft_bytes[1:] == [0] and draft_bytes[0] == 2 * held[0]["projection_bytes"], held
    if mixed_batch is not None:
        assert mixed_batch == plain["mixed"]


MIXED = ["one two three four one two three four one two", "The capital of France is", "Hello, my name is", "def fibonacci(n):",
         "1, 2, 3, 4, 5,", "The quick brown fox", "A code like 123-abc:", "Write a haiku about the sea."]
MIXED_ADAPTERS = [None, "all7-r8", "mixed-r16", None, "all7-r8", None, None, "mixed-r16"]


def mixed(llm, paths) -> list[list[int]]:
    """8 requests in one batch: two adapters and base rows, one of them constrained by a regex."""
    from kvpilot.server import SamplingParams
    from kvpilot.server.adapters import LoRARequest
    from kvpilot.server.engine.structured import StructuredOutput

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    coded = SamplingParams(temperature=0, max_tokens=12, structured=StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,8}"))
    outs = llm.generate(MIXED, [coded if "code" in p else greedy for p in MIXED],
                        lora_request=[LoRARequest(n, 1, str(paths[n])) if n else None for n in MIXED_ADAPTERS])
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.timeout(300)
def test_a_draft_model_split_over_two_ranks_keeps_the_distribution_and_its_proposals(models):
    """test_spec_decode's chi-square test (300 seeds at temperature 1, top-k 4) on the tiny checkpoint: a
    draft split over two ranks (its shards in lockstep, the proposals drawn on rank 0) and the target
    verifying over them give the tokens at output positions 2 and 3 the distribution plain decoding on
    one rank gives (the same seeds, the same model); and the same draft on one rank, drawing with the
    same seeds, has about as many proposals accepted (shards computing anything else would not)."""
    from test_spec_decode import DISTRIBUTION_KW, _chi_square_p_value, _sample_all, make_engine

    model = models[2]
    spec = dict(speculative_method="draft", speculative_model=model["near draft"], speculative_disable_batch_size=0, speculative_min_acceptance=0.0)
    plain_samples = _sample_all(make_engine(model=model["model"], **DISTRIBUTION_KW))
    one_rank = make_engine(model=model["model"], **DISTRIBUTION_KW, **spec)
    _sample_all(one_rank)
    split = make_engine(model=model["model"], tensor_parallel_size=2, speculative_draft_tensor_parallel_size=2, **DISTRIBUTION_KW, **spec)
    try:
        spec_samples = _sample_all(split)
        s = split.proposer.stats
        held = split.describe_ranks()
    finally:
        split.close()
    assert held[0]["draft_projection_bytes"] == held[1]["draft_projection_bytes"] > 0
    assert s.num_drafts > 100 and 0 < s.num_accepted_tokens < s.num_draft_tokens, s
    assert abs(s.num_accepted_tokens - one_rank.proposer.stats.num_accepted_tokens) <= 15, (s, one_rank.proposer.stats)
    for position in (1, 2):
        a, b = Counter(ids[position] for ids in plain_samples), Counter(ids[position] for ids in spec_samples)
        assert _chi_square_p_value(a, b) > 1e-3, (position, a, b)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("failing", ["build", "draft step"])
def test_a_step_rank_0_fails_in_after_split_proposals_began_is_dropped_by_every_rank(models, failing):
    """A split draft model's proposals are collective, so the other ranks run them before rank 0 builds
    the rest of the step; when rank 0's own work fails between two collective parts (building the step
    after the proposals, or drawing a draft step's tokens), rank 0 says so and every rank drops the step:
    the engine re-runs its requests one by one and their tokens are plain decoding's (no rank left
    waiting in a collective, none a step ahead)."""
    from test_spec_decode import make_engine

    from kvpilot.server import SamplingParams

    model = models[2]
    kw = dict(model=model["model"], kv_cache_memory="32MiB", tensor_parallel_size=2)
    spec = make_engine(**kw, speculative_method="draft", speculative_model=model["near draft"], speculative_draft_tensor_parallel_size=2,
                       speculative_disable_batch_size=0, speculative_min_acceptance=0.0)
    failures = []
    if failing == "build":
        build = spec.worker.build

        def failing_once(batch, step, proposal=None):
            if proposal is not None and not failures:
                failures.append(step)
                raise RuntimeError("rank 0 could not build this step")
            return build(batch, step, proposal)

        spec.worker.build = failing_once
    else:
        drafter = spec.worker.drafter
        draw_rows, calls = drafter._draw_rows, []

        def failing_at_the_second_draft_step(active):
            calls.append(len(active))
            if len(calls) == 2 and not failures:
                failures.append(active)
                raise RuntimeError("rank 0 could not draw this draft step")
            return draw_rows(active)

        drafter._draw_rows = failing_at_the_second_draft_step
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    try:
        ids = [spec.add_request(p, params) for p in PROMPTS]
        got = {}
        while spec.has_unfinished_requests():
            got.update({o.request_id: o.outputs[0].token_ids for o in spec.step() if o.finished})
        drafts = spec.proposer.stats.num_drafts
    finally:
        spec.close()
    plain = make_engine(**kw)
    try:
        ids_plain = [plain.add_request(p, params) for p in PROMPTS]
        want = {}
        while plain.has_unfinished_requests():
            want.update({o.request_id: o.outputs[0].token_ids for o in plain.step() if o.finished})
    finally:
        plain.close()
    assert failures and drafts > 0
    assert [got[i] for i in ids] == [want[i] for i in ids_plain]
