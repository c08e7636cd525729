"""The HF-oracle rule holds under every scheduling mode: chunked prefill, preemption, prefix caching."""

import pytest

from oracle import ORACLE_PROMPTS, ORACLE_STEPS, compare_greedy


@pytest.fixture(scope="module")
def oracle(hf_oracle_session):
    return hf_oracle_session.run()


def greedy(**kw):
    from kvpilot.server import SamplingParams

    return SamplingParams(temperature=0, max_tokens=ORACLE_STEPS, ignore_eos=True, logprobs=5, **kw)


def check(outs, oracle, label):
    tokens = [o.outputs[0].token_ids for o in outs]
    topks = [[sorted(e, key=e.get, reverse=True)[:5] for e in o.outputs[0].logprobs] for o in outs]
    result = compare_greedy(tokens, topks, oracle)
    print(f"HF equivalence ({label}): {result}")
    assert result["exact"] >= result["total"] - 1, result
    assert not result["violations"], result


def test_chunked_prefill(oracle):
    from kvpilot.server import LLM

    llm = LLM(num_threads=1, show_progress=False, max_num_batched_tokens=16, block_size=8)
    steps = []
    engine = llm.engine
    original = engine.scheduler.schedule

    def spy():
        batch = original()
        steps.append(batch.total_tokens)
        return batch

    engine.scheduler.schedule = spy
    check(llm.generate(ORACLE_PROMPTS, greedy()), oracle, "chunked prefill, 16-token steps")
    assert max(steps) <= 16
    longest = max(len(r.prompt_ids) for r in oracle)
    assert longest > 16  # so at least one prompt really was split over several steps


def test_preemption(oracle):
    from kvpilot.server import LLM

    # 24 blocks of 16 tokens (and the scratch block) for 10 sequences that each grow to 70–110 tokens:
    # preemption is certain.
    llm = LLM(num_threads=1, show_progress=False, block_size=16, kv_cache_memory=25 * 737280)
    assert llm.engine.block_manager.num_blocks == 24
    outs = llm.generate(ORACLE_PROMPTS, greedy())
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outs) == llm.engine.scheduler.num_preemptions
    check(outs, oracle, f"preemption x{llm.engine.scheduler.num_preemptions}")
    assert llm.engine.block_manager.usage() == 0.0  # every block returned


def test_shared_prefix_hits_cache_and_keeps_outputs(hf_oracle_session):
    from kvpilot.server import LLM

    prefix = ("You are a meticulous assistant. Read the following background carefully before answering. "
              "The Rhine is a river that rises in the Swiss Alps and flows through Germany and the Netherlands "
              "into the North Sea. It has been an important trade route since Roman times. ")
    prompts = [prefix + q for q in ("Question: where does the Rhine rise?", "Question: where does it end?",
                                     "Question: why was it important?")]
    oracle = hf_oracle_session.run(prompts, 32)
    llm = LLM(num_threads=1, show_progress=False, block_size=16)
    from kvpilot.server import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    first = llm.generate(prompts[0], params)[0]  # fills the cache with the prefix blocks
    bm = llm.engine.block_manager
    hits_before = bm.prefix_hits
    rest = llm.generate(prompts[1:], params)
    shared_blocks = len(llm.engine.tokenizer.encode(prefix)) // 16
    assert shared_blocks >= 3
    assert bm.prefix_hits - hits_before >= 2 * (shared_blocks - 1) * 16
    assert all(o.num_cached_tokens >= (shared_blocks - 1) * 16 for o in rest)
    outs = [first] + rest
    tokens = [o.outputs[0].token_ids for o in outs]
    topks = [[sorted(e, key=e.get, reverse=True)[:5] for e in o.outputs[0].logprobs] for o in outs]
    result = compare_greedy(tokens, topks, oracle)
    print(f"HF equivalence (prefix cache): {result}")
    assert result["exact"] >= 2 and not result["violations"], result
