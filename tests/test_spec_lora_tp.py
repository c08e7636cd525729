"""Speculation, LoRA, tensor parallelism and async scheduling together (issue #63), pairwise: every
pair of values of the four axes appears in at least one engine below, not their full product.

  tensor parallelism   1 and 3 (the bundled model: 9 query / 3 KV heads), 2 (the tiny Qwen2 test checkpoint
                       tests/test_tensor_parallel_families.py splits, with four layers here)
  speculation          none, n-gram, a draft model (whole on rank 0: a 4-layer truncation of the bundled
                       model; for the tiny checkpoint the checkpoint itself), an EAGLE-3 head (random)
  LoRA                 off, on (a peft adapter; the batch mixes adapter rows and base rows)
  async scheduling     off, on (on a CPU `auto` is off: `on` is what `auto` does on a GPU; n-gram keeps its
                       steps synchronous, so its rows are off)

Each engine's greedy tokens equal plain decoding of the same model and adapter on as many ranks (one
plain engine per model and rank count, LoRA slots on, run with and without the adapter); a draft model and
an EAGLE-3 head over three ranks, with two adapters and a grammar in one batch, give one rank's tokens."""

from __future__ import annotations

from dataclasses import replace

import pytest

PROMPTS = ["one two three four one two three four one two", "The capital of France is", "A code like 123-abc:", "def fibonacci(n):"]
ADAPTED = [False, True, False, True]  # with LoRA on: which prompts run with the adapter (the others the base model)
# (ranks, speculation, LoRA, async scheduling): a pairwise covering set of the four axes
ROWS = [(1, "none", False, "off"), (1, "ngram", True, "off"), (1, "draft", True, "on"), (1, "eagle3", False, "on"),
        (2, "none", True, "on"), (2, "ngram", False, "off"), (2, "draft", False, "off"), (2, "eagle3", True, "off"),
        (3, "none", False, "off"), (3, "ngram", True, "off"), (3, "draft", True, "on"), (3, "eagle3", False, "on")]


def test_the_rows_cover_every_pair_of_axis_values():
    values = [{1, 2, 3}, {"none", "ngram", "draft", "eagle3"}, {False, True}, {"off", "on"}]
    refused = {("ngram", "on")}  # n-gram's lookups read each step's tokens on the host (EngineConfig refuses it)
    for i in range(4):
        for j in range(i + 1, 4):
            wanted = {(a, b) for a in values[i] for b in values[j]} - (refused if (i, j) == (1, 3) else set())
            assert wanted <= {(row[i], row[j]) for row in ROWS}, (i, j)


@pytest.fixture(scope="module")
def models(tmp_path_factory, model_path, lora_peft_case):
    """Per rank count: the model, its adapter, its draft model and a random EAGLE-3 head."""
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
    tiny = build_checkpoint(replace(case, config={**case.config, "num_hidden_layers": 4}), root / "qwen2-4", tokenizer_dir)
    _, adapter = save_adapter(AutoModelForCausalLM.from_pretrained(str(tiny)), "all7-r8", root / "tiny-adapters")
    tiny_weights, _ = open_model(tiny)
    small = {"model": str(tiny), "adapter": str(adapter), "draft": str(tiny),
             "eagle3": str(write_eagle3_head(root / "tiny-head", tiny_weights.config, draft_vocab, aux_layers=[0, 1, 3]))}
    return {1: bundled, 2: small, 3: bundled}


def engine(ranks: int, model: dict, speculation: str = "none", lora: bool = True, async_scheduling: str = "off", **extra):
    from kvpilot.server import LLM

    spec = {} if speculation == "none" else {"speculative_method": speculation, "speculative_disable_batch_size": 0,
                                             "speculative_min_acceptance": 0.0}
    if speculation in ("draft", "eagle3"):
        spec["speculative_model"] = model[speculation]
    lora_kw = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8} if lora else {}
    return LLM(model=model["model"], num_threads=1, show_progress=False, tensor_parallel_size=ranks, kv_cache_memory="32MiB",
               max_num_batched_tokens=32, async_scheduling=async_scheduling, **spec, **{**lora_kw, **extra})


def greedy(llm, model: dict, adapted: list[bool]) -> list[list[int]]:
    from kvpilot.server import SamplingParams
    from kvpilot.server.adapters import LoRARequest

    lora = LoRARequest("all7-r8", 1, model["adapter"])
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, lora_request=[lora if a else None for a in adapted])]


@pytest.fixture(scope="module")
def plain(models):
    """Plain decoding per rank count: with the adapter where ADAPTED says, and without any (one
    tensor-parallel engine at a time in a process)."""
    out = {}
    for ranks in (1, 2, 3):
        llm = engine(ranks, models[ranks])
        try:
            out[ranks] = {True: greedy(llm, models[ranks], ADAPTED), False: greedy(llm, models[ranks], [False] * len(PROMPTS))}
        finally:
            llm.engine.close()
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("ranks", "speculation", "lora", "async_scheduling"), ROWS, ids=["-".join(map(str, r)) for r in ROWS])
def test_greedy_output_is_plain_decodings_in_every_composition(models, plain, ranks, speculation, lora, async_scheduling):
    llm = engine(ranks, models[ranks], speculation, lora, async_scheduling)
    try:
        assert llm.engine.async_scheduling is (async_scheduling == "on")
        got = greedy(llm, models[ranks], ADAPTED if lora else [False] * len(PROMPTS))
        stats = llm.engine.proposer.stats if llm.engine.proposer else None
    finally:
        llm.engine.close()
    assert got == plain[ranks][lora]
    # (n-gram on the random tiny checkpoint: its output never repeats its context, nothing to look up)
    if speculation in ("draft", "eagle3") or (speculation == "ngram" and ranks != 2):
        assert stats.num_drafts > 0, stats


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
def test_a_draft_model_and_a_head_over_three_ranks_with_two_adapters_and_a_grammar_equal_one_rank(models, lora_peft_case):
    paths = lora_peft_case[0]
    results = {}
    for ranks, speculation in ((1, "none"), (3, "draft"), (3, "eagle3")):
        llm = engine(ranks, models[ranks], speculation, max_loras=2, max_lora_rank=16)
        try:
            results[speculation] = mixed(llm, paths)
            assert speculation == "none" or llm.engine.proposer.stats.num_drafts > 0
        finally:
            llm.engine.close()
    assert results["draft"] == results["none"] and results["eagle3"] == results["none"]
