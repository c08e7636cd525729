"""Pipeline parallelism on CPU (gloo, stages as processes): SmolLM2-135M over 2 stages gives HF's greedy
ids (vLLM's rule) batched, in prefill chunks, preempted, with two steps in flight on disjoint sequences,
and again from the host tier after the prefix cache is reset; prompt logprobs within 2e-4 of HF's;
LoRA adapters equal peft's; constrained outputs hold; synchronous stages with n-gram speculation give
HF's ids over 3 stages; 2 stages of 3 tensor-parallel ranks give HF's ids; what does not compose is refused with the
reason. (A stage that dies takes the server down with its cause: test_tensor_parallel.py's dead-rank test.)"""

from __future__ import annotations

import json
import re
import time

import pytest

from oracle import ORACLE_PROMPTS, OracleResult, compare_greedy

STAGES = 2


@pytest.fixture(scope="module")
def tier_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("pp-disk-tier")


@pytest.fixture(scope="module")
def pp_llm(tier_dir):
    from kvpilot.server import LLM

    # 12 MiB per stage (33 blocks of 16 tokens): about five of the oracle's sequences at once, so they preempt each other;
    # a 24-token budget: the long prompts prefill in chunks. LoRA slots and both KV tiers too (their tests below).
    llm = LLM(num_threads=1, show_progress=False, pipeline_parallel_size=STAGES, kv_cache_memory="12MiB", max_num_batched_tokens=24,
              enable_lora=True, max_loras=2, max_lora_rank=16, kv_host_offload_size="64MiB", kv_offload_dir=str(tier_dir))
    yield llm
    llm.engine.close()


def greedy(llm, prompts, tokens, lora_request=None, **kw):
    from kvpilot.server import SamplingParams

    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, **kw), lora_request=lora_request)


def ids_and_top5(outs):
    return [o.outputs[0].token_ids for o in outs], [[sorted(e, key=e.get, reverse=True)[:5] for e in o.outputs[0].logprobs] for o in outs]


def shortened(oracle: list[OracleResult], steps: int) -> list[OracleResult]:
    return [OracleResult(r.prompt_ids, r.tokens[:steps], r.topk[:steps], r.prompt_logprobs) for r in oracle]


def test_stage_layers_and_ranks():
    from kvpilot.server.models.sharding import PipelineStage, stage_layers

    assert stage_layers(30, 2) == [(0, 15), (15, 30)]
    assert stage_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]  # the earlier stages one more
    assert stage_layers(30, 2, [19, 11]) == [(0, 19), (19, 30)]
    stage = PipelineStage.of(4, 3, 2, 30)  # rank 4 of 2 stages x 3 ranks: the second stage's middle rank
    assert (stage.index, stage.layers, stage.previous_rank, stage.last, stage.last_stage_rank) == (1, (15, 30), 1, True, 3)


@pytest.mark.timeout(300)
def test_two_stages_match_hf_batched_chunked_preempted_with_prefix_hits_and_from_the_tiers(pp_llm, hf_oracle_session, tier_dir):
    oracle = hf_oracle_session.run()
    engine = pp_llm.engine
    assert engine.steps_in_flight == STAGES and engine.async_scheduling
    in_flight, batches, launch = [], [], engine._launch

    def spy(batch, previous):
        batches.append(len(batch.seqs))
        in_flight.append(len(engine._pipeline) + 1)
        return launch(batch, previous)

    engine._launch = spy
    try:
        tokens, topk = ids_and_top5(greedy(pp_llm, ORACLE_PROMPTS, len(oracle[0].tokens), logprobs=5))
    finally:
        del engine._launch
    result = compare_greedy(tokens, topk, oracle)
    print(f"PP={STAGES} vs HF: {result}; {engine.scheduler.num_preemptions} preemptions, steps in flight {max(in_flight)}")
    assert result["exact"] >= result["total"] - 1 and not result["violations"], result
    assert engine.scheduler.num_preemptions > 0 and max(len(r.prompt_ids) for r in oracle) > 24  # preempted, chunked
    assert max(in_flight) == STAGES and max(batches) <= -(-len(ORACLE_PROMPTS) // STAGES)  # disjoint shares in flight together
    assert engine.block_manager.usage() == 0.0 and not engine._pipeline
    worst = 0.0
    for out, ref in zip(greedy(pp_llm, ORACLE_PROMPTS, 1, prompt_logprobs=0), oracle):
        worst = max(worst, max(abs(e[t] - lp) for e, t, lp in zip(out.prompt_logprobs[1:], ref.prompt_ids[1:], ref.prompt_logprobs)))
    print(f"PP={STAGES}: max |prompt logprob - HF| = {worst:.2e}")
    assert worst < 2e-4
    long = [i for i, r in enumerate(oracle) if len(r.prompt_ids) > 16]  # a full block before the last token
    hits = engine.block_manager.prefix_hits
    again, _ = ids_and_top5(greedy(pp_llm, [ORACLE_PROMPTS[i] for i in long], 16, logprobs=0))
    assert again == [tokens[i][:16] for i in long] and engine.block_manager.prefix_hits > hits
    # The prefix cache forgotten: the long prompts' blocks come back from the host tier, each stage its own layers'.
    host = engine.kv_connector.host
    engine.reset_prefix_cache()
    before = host.stats.hit_blocks
    again, _ = ids_and_top5(greedy(pp_llm, [ORACLE_PROMPTS[i] for i in long], 16, logprobs=0))
    assert again == [tokens[i][:16] for i in long]
    assert host.stats.hit_blocks - before >= len(long)
    engine.kv_connector.drain()  # the disk tier: each rank writes its own shard of a block (the other stage's writer: within 30 s)
    deadline = time.monotonic() + 30
    while not list(tier_dir.glob("*/*-1.kvblock")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {p.name.rsplit("-", 1)[1] for p in tier_dir.glob("*/*.kvblock")} == {"0.kvblock", "1.kvblock"}


@pytest.mark.timeout(300)
def test_adapters_over_two_stages_equal_peft(pp_llm, lora_peft_case):
    """Each stage reads its layers' share of an adapter when rank 0's message fills a slot."""
    from kvpilot.server.adapters import LoRARequest

    paths, results, base = lora_peft_case
    names = [None, "all7-r8", "mixed-r16"]
    requests = [LoRARequest(names[i % 3], 1, str(paths[names[i % 3]])) if names[i % 3] else None for i in range(len(ORACLE_PROMPTS))]
    oracle = [(results[names[i % 3]] if names[i % 3] else base)[i] for i in range(len(ORACLE_PROMPTS))]
    tokens, topk = ids_and_top5(greedy(pp_llm, ORACLE_PROMPTS, len(oracle[0].tokens), logprobs=5, lora_request=requests))
    result = compare_greedy(tokens, topk, oracle)
    print(f"PP={STAGES} with adapters vs peft: {result}")
    assert result["exact"] >= result["total"] - 1 and not result["violations"], result


@pytest.mark.timeout(300)
def test_constrained_outputs_over_two_stages(pp_llm):
    """Rank 0 masks and samples the logits the last stage sends it."""
    from kvpilot.server import SamplingParams
    from kvpilot.server.engine.sampling_params import StructuredOutput

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer"}},
              "required": ["city", "rank"], "additionalProperties": False}
    chat = pp_llm.get_tokenizer().encode_chat
    outs = pp_llm.generate([chat([{"role": "user", "content": "A city and its rank, in JSON."}]),
                            chat([{"role": "user", "content": "Give a code like 123-abc."}])],
                           [SamplingParams(temperature=0, max_tokens=60, structured=StructuredOutput("json", schema)),
                            SamplingParams(temperature=0.8, seed=1, max_tokens=20, structured=StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,8}"))])
    value = json.loads(outs[0].outputs[0].text)
    assert set(value) == {"city", "rank"} and isinstance(value["rank"], int)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,8}", outs[1].outputs[0].text)


@pytest.mark.timeout(300)
def test_three_synchronous_stages_with_ngram_speculation_match_hf(pp_llm, hf_oracle_session):
    """Three stages (a middle one: neither embedding nor head), async scheduling off (n-gram proposals
    need each step's tokens on the host): one step at a time, rank 0 proposes and verifies against the
    last stage's logits."""
    from kvpilot.server import LLM

    pp_llm.engine.close()  # one engine of ranks per process
    oracle = shortened(hf_oracle_session.run()[:5], 32)
    llm = LLM(num_threads=1, show_progress=False, pipeline_parallel_size=3, kv_cache_memory="16MiB", speculative_method="ngram",
              speculative_disable_batch_size=0)
    try:
        assert not llm.engine.async_scheduling and llm.engine.steps_in_flight == 1
        assert [r["layers"] for r in llm.engine.describe_ranks()] == [[0, 10], [10, 20], [20, 30]]
        tokens, topk = ids_and_top5(greedy(llm, ORACLE_PROMPTS[:5], 32, logprobs=5))
        result = compare_greedy(tokens, topk, oracle)
        print(f"PP=3, synchronous, n-gram vs HF: {result}")
        assert result["exact"] >= result["total"] - 1 and not result["violations"], result
        assert llm.engine.proposer.stats.num_accepted_tokens > 0
    finally:
        llm.engine.close()


@pytest.mark.timeout(400)
def test_two_stages_of_three_ranks_match_hf(hf_oracle_session):
    from kvpilot.server import LLM

    oracle = shortened(hf_oracle_session.run()[:4], 16)
    # Uneven stages (pipeline_layer_partition): the LM head weighs about eight of SmolLM2's layers.
    llm = LLM(num_threads=1, show_progress=False, pipeline_parallel_size=STAGES, tensor_parallel_size=3, kv_cache_memory="16MiB",
              max_num_batched_tokens=24, pipeline_layer_partition=[19, 11])
    try:
        ranks = llm.engine.describe_ranks()
        assert [(r["rank"], r["layers"], r["kv_heads"]) for r in ranks] == [(i, [0, 19] if i < 3 else [19, 30], 1) for i in range(6)]
        tokens, topk = ids_and_top5(greedy(llm, ORACLE_PROMPTS[:4], 16, logprobs=5))
    finally:
        llm.engine.close()
    result = compare_greedy(tokens, topk, oracle)
    print(f"PP={STAGES} x TP=3 vs HF: {result}")
    assert result["exact"] >= result["total"] - 1 and not result["violations"], result


def test_what_does_not_compose_is_refused_with_the_reason():
    from kvpilot.server import LLM
    from kvpilot.server.config import EngineConfig

    with pytest.raises(ValueError, match="speculative_method=draft with pipeline_parallel_size=2"):
        EngineConfig(pipeline_parallel_size=2, speculative_method="draft", speculative_model="smollm2-135m-instruct")
    with pytest.raises(ValueError, match="kv_role=prefill with pipeline_parallel_size=2"):
        EngineConfig(pipeline_parallel_size=2, kv_role="prefill")
    with pytest.raises(ValueError, match="pipeline_parallel_size=31 .* one of its 30 layers"):
        LLM(num_threads=1, show_progress=False, pipeline_parallel_size=31)
    with pytest.raises(ValueError, match=r"pipeline_layer_partition=\[19, 12\] adds up to 31 layers; .* has 30"):
        LLM(num_threads=1, show_progress=False, pipeline_parallel_size=2, pipeline_layer_partition=[19, 12])
    with pytest.raises(ValueError, match="one count of 1 or more layers per stage"):
        EngineConfig(pipeline_parallel_size=2, pipeline_layer_partition=[30])
    assert EngineConfig.from_cli_args(["--pipeline-parallel-size", "2", "--pipeline-layer-partition", "19", "11"]).pipeline_layer_partition == [19, 11]
