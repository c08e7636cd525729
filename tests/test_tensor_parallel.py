"""Tensor parallelism on CPU (gloo, ranks as processes): SmolLM2-135M over 3 ranks gives HF's greedy
ids (vLLM's rule) batched with chunked prefill, prompt logprobs within 2e-4 of HF's; each rank holds a
third of the projections and one of the 3 KV heads; 2 ranks are refused with the head counts; a
rank that dies (or a pipeline stage: the same watchdog) takes the server down with a non-zero exit and its cause in the
termination message."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from oracle import ORACLE_PROMPTS, ORACLE_STEPS, compare_greedy
from server_harness import ServerProcess, machine_state, rank_pids

WORLD = 3


@pytest.fixture(scope="module")
def tp_llm():
    from kvpilot.server import LLM

    # A 24-token budget: the long prompts prefill in chunks while the short ones already decode.
    # LoRA slots too (test_adapters_over_three_ranks_equal_peft): steps without adapter rows never use them.
    llm = LLM(num_threads=1, show_progress=False, tensor_parallel_size=WORLD, kv_cache_memory="64MiB", max_num_batched_tokens=24,
              enable_lora=True, max_loras=2, max_lora_rank=16)
    yield llm
    llm.engine.close()


@pytest.mark.timeout(300)
def test_three_ranks_match_hf_batched_with_chunked_prefill(tp_llm, hf_oracle_session):
    from kvpilot.server import SamplingParams

    oracle = hf_oracle_session.run()
    outs = tp_llm.generate(ORACLE_PROMPTS, SamplingParams(temperature=0, max_tokens=ORACLE_STEPS, ignore_eos=True, logprobs=5))
    assert tp_llm.engine.scheduler.max_num_batched_tokens == 24 and max(len(r.prompt_ids) for r in oracle) > 24  # chunks happened
    tokens = [o.outputs[0].token_ids for o in outs]
    topk = [[sorted(e, key=e.get, reverse=True)[:5] for e in o.outputs[0].logprobs] for o in outs]
    result = compare_greedy(tokens, topk, oracle)
    print(f"TP={WORLD} vs HF: {result}")
    assert result["exact"] >= result["total"] - 1 and not result["violations"], result
    worst = 0.0
    for out, ref in zip(tp_llm.generate(ORACLE_PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=0)), oracle):
        worst = max(worst, max(abs(e[t] - lp) for e, t, lp in zip(out.prompt_logprobs[1:], ref.prompt_ids[1:], ref.prompt_logprobs)))
    print(f"TP={WORLD}: max |prompt logprob - HF| = {worst:.2e}")
    assert worst < 2e-4


def test_adapters_over_three_ranks_equal_peft(tp_llm, lora_peft_case):
    """LoRA A/B split as their base projections are (each rank reads its share of an adapter when rank
    0's step message fills a slot): base rows and two adapters in one batch equal peft's tokens."""
    from kvpilot.server import SamplingParams
    from kvpilot.server.adapters import LoRARequest

    paths, results, base = lora_peft_case
    names = [None, "all7-r8", "mixed-r16"]
    requests = [LoRARequest(names[i % 3], 1, str(paths[names[i % 3]])) if names[i % 3] else None for i in range(len(ORACLE_PROMPTS))]
    oracle = [(results[names[i % 3]] if names[i % 3] else base)[i] for i in range(len(ORACLE_PROMPTS))]
    outs = tp_llm.generate(ORACLE_PROMPTS, SamplingParams(temperature=0, max_tokens=len(oracle[0].tokens), ignore_eos=True, logprobs=5),
                           lora_request=requests)
    result = compare_greedy([o.outputs[0].token_ids for o in outs],
                            [[sorted(e, key=e.get, reverse=True)[:5] for e in o.outputs[0].logprobs] for o in outs], oracle)
    print(f"TP={WORLD} with adapters vs peft: {result}")
    assert result["exact"] >= result["total"] - 1 and not result["violations"], result


def test_each_rank_holds_a_third(tp_llm):
    c = tp_llm.engine.model_config
    per_layer = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size \
        + 3 * c.hidden_size * c.intermediate_size
    full = 4 * (c.num_layers * per_layer + c.vocab_size * c.hidden_size)  # fp32; the tied LM head packed once
    ranks = tp_llm.engine.describe_ranks()
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    assert all(r["projection_bytes"] == full // WORLD for r in ranks), (ranks, full)
    assert all(r["kv_heads"] == c.num_kv_heads // WORLD == 1 for r in ranks)
    assert len({r["kv_cache_bytes"] for r in ranks}) == 1  # kv_cache_memory is per rank: the same blocks everywhere


def test_two_ranks_are_refused_with_the_head_counts():
    from kvpilot.server import LLM

    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .* must divide the 9 query heads, the 3 KV heads .*FFN width 1536"):
        LLM(num_threads=1, show_progress=False, tensor_parallel_size=2)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("flags, killed, cause", [(("--tensor-parallel-size", "3"), -1, "tensor-parallel rank 2 of 3 stopped"),
                                                  (("--pipeline-parallel-size", "2"), 0, "pipeline stage 1 of 2 (rank 1 of 2) stopped")],
                         ids=["tensor-parallel", "pipeline-stage"])
def test_a_dead_rank_stops_the_server_with_its_cause(tmp_path, flags, killed, cause):
    import httpx

    termination = tmp_path / "termination-log"
    termination.write_text("")
    s = ServerProcess(*flags, "--kv-cache-memory", "16MiB", log_path=tmp_path / "log", env={"KVPILOT_TERMINATION_LOG": str(termination)})
    try:
        s.wait_ready()
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        ranks = rank_pids(s.proc.pid)
        assert len(ranks) == int(flags[1]) - 1
        os.kill(ranks[killed], signal.SIGKILL)
        assert s.proc.wait(30) == 70
        with pytest.raises(httpx.HTTPError):
            httpx.get(s.url + "/ready", timeout=2)
        assert cause in s.log()
        assert termination.read_text().startswith(cause) and "exit code -9" in termination.read_text()
        others = [p for p in ranks if p != ranks[killed]]
        alive = lambda: any(Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split()[2] for p in others)  # noqa: E731
        deadline = time.monotonic() + 20  # the other ranks go too (their connection to rank 0 closed)
        while time.monotonic() < deadline and alive():
            time.sleep(0.5)
        assert not alive()
    finally:
        s.terminate()


def test_a_refused_world_size_reaches_the_termination_message(tmp_path):
    termination = tmp_path / "termination-log"
    termination.write_text("")
    s = ServerProcess("--tensor-parallel-size", "2", log_path=tmp_path / "log", env={"KVPILOT_TERMINATION_LOG": str(termination)})
    try:
        assert s.proc.wait(60) == 2
    except subprocess.TimeoutExpired:
        pytest.fail(f"a refused world size did not exit in 60 s: {s.log()[-2000:]}\n{machine_state()}")
    finally:
        s.terminate()
    assert "9 query heads" in s.log() and "9 query heads" in termination.read_text()


def test_one_tensor_parallel_engine_per_process(tp_llm):
    """torch.distributed has one default process group per process: a second engine is refused, clearly."""
    from kvpilot.server import LLM

    with pytest.raises(RuntimeError, match="already running in this process"):
        LLM(num_threads=1, show_progress=False, tensor_parallel_size=WORLD, kv_cache_memory="16MiB")
