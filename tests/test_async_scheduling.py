"""Async scheduling (server/engine/llm_engine.py: step): step n is launched before step n - 1's outputs
are processed, its placeholder inputs taken from step n - 1's sampled tokens on the device. On a CPU
the steps run at launch, so nothing overlaps in time, but the bookkeeping is the same code as on a GPU:
these tests check that it gives the synchronous engine's outputs under every feature that touches it,
and that the steps really are interleaved."""

import json

import pytest
import torch
from launch_spy import spy_on_launches

PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3, 4,", "Write a poem about the sea:",
           "Question: what is the tallest mountain on Earth? Answer:", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def sync_llm():
    from kvpilot.server import LLM

    return LLM(num_threads=1, show_progress=False)


def params():
    from kvpilot.server import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3),
            SamplingParams(temperature=0.8, seed=5, max_tokens=40, stop=[".", "\n"]),      # ends early on a stop string
            SamplingParams(temperature=0.7, seed=3, n=2, max_tokens=18),                   # two sequences, own generators
            SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, min_tokens=5),  # penalties need the host's tokens
            SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=2),
            SamplingParams(temperature=0.9, top_p=0.8, top_k=40, seed=11, max_tokens=33, logprobs=1)]


def run(mode, **engine_args):
    """(the LLM, its outputs, how many steps filled placeholders in penalised output ids on the device)"""
    from kvpilot.server import LLM
    from kvpilot.server.engine.sequence import PLACEHOLDER_TOKEN

    llm = LLM(num_threads=1, show_progress=False, async_scheduling=mode, **engine_args)
    assert llm.engine.async_scheduling is (mode == "on")
    runner, penalty_fills = llm.engine.worker, []
    launch = runner.launch

    def spy(inp, previous=None, proposal=None):
        pen = inp.sampling.penalties if inp.sampling is not None else None
        penalty_fills.append(pen is not None and pen.from_previous is not None)
        return launch(inp, previous, proposal)

    runner.launch = spy
    outs = llm.generate(PROMPTS, params())
    assert not llm.engine.has_unfinished_requests() and llm.engine.block_manager.usage() == 0.0  # every block returned
    result = []
    for o in outs:
        for c in o.outputs:
            assert PLACEHOLDER_TOKEN not in c.token_ids
            lps = [max(e.values()) for e in c.logprobs] if c.logprobs is not None else None
            result.append((c.token_ids, c.text, c.finish_reason, c.stop_reason, lps))
        if o.prompt_logprobs is not None:
            result.append([max(e.values()) if e else None for e in o.prompt_logprobs])
    return llm, result, sum(penalty_fills)


def assert_same(sync, overlapped):
    for a, b in zip(sync, overlapped, strict=True):
        if isinstance(a, list):  # prompt logprobs
            torch.testing.assert_close(torch.tensor(b[1:]), torch.tensor(a[1:]), atol=1e-4, rtol=1e-4)
            continue
        assert b[:4] == a[:4]
        if a[4] is not None:
            torch.testing.assert_close(torch.tensor(b[4]), torch.tensor(a[4]), atol=1e-4, rtol=1e-4)


@pytest.mark.timeout(300)
def test_async_scheduling_gives_the_synchronous_outputs():
    """Greedy and seeded sampling, stop strings, n = 2, penalties, min_tokens, logprobs and prompt
    logprobs; 16-token steps (prompts split over steps) and a KV cache small enough to preempt."""
    engine_args = dict(max_num_batched_tokens=16, block_size=8, kv_cache_memory=13 * 368640)  # 12 blocks of 8 tokens, plus scratch
    _, sync, no_fills = run("off", **engine_args)
    llm, overlapped, fills = run("on", **engine_args)
    assert no_fills == 0 and fills >= 20  # the penalised request's decode steps count its awaited token from the device
    assert llm.engine.block_manager.num_blocks == 12
    assert llm.engine.scheduler.num_preemptions > 0
    assert_same(sync, overlapped)


@pytest.mark.timeout(300)
def test_steps_interleave_and_placeholders_take_the_device_tokens(sync_llm):
    """Each step is launched before the previous one is waited for, decode inputs come from the
    previous step's device tokens (the host holds a placeholder), and a sequence that reaches max_tokens
    with the token in flight is not scheduled again."""
    from kvpilot.server import LLM, SamplingParams

    llm = LLM(num_threads=1, show_progress=False, async_scheduling="on")
    runner = llm.engine.worker
    events = []
    spy_on_launches(runner, events)
    sync_tokens = [o.outputs[0].token_ids for o in sync_llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))]
    outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == sync_tokens
    launches = [e for e in events if e[0] == "launch"]
    # One prefill step, then 5 decode steps of both sequences (their 6th token ends them: never scheduled).
    assert [e[2] for e in launches] == [0, 2, 2, 2, 2, 2]
    order = [e[:2] for e in events]
    assert order == [("launch", 0)] + [x for n in range(1, 6) for x in (("launch", n), ("wait", n - 1))] + [("wait", 5)]


@pytest.mark.timeout(300)
def test_abort_while_a_step_is_in_flight(sync_llm):
    """A request aborted between steps, while the step holding its next token is in flight: its final
    output carries no placeholder, its blocks are freed, and the other request is unaffected."""
    from kvpilot.server import LLM, SamplingParams
    from kvpilot.server.engine.sequence import PLACEHOLDER_TOKEN

    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = sync_llm.generate(PROMPTS[1], greedy)[0].outputs[0].token_ids
    engine = LLM(num_threads=1, show_progress=False, async_scheduling="on").engine
    engine.add_request(PROMPTS[0], greedy, request_id="aborted")
    engine.add_request(PROMPTS[1], greedy, request_id="kept")
    seen = {}
    for _ in range(4):
        for out in engine.step():
            seen[out.request_id] = out
    assert engine.requests["aborted"].seqs[0].num_placeholders == 1  # the 4th step, in flight, samples its next token
    final = engine.abort_request("aborted")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert PLACEHOLDER_TOKEN not in final.outputs[0].token_ids
    assert final.outputs[0].token_ids == seen["aborted"].outputs[0].token_ids  # what was delivered, nothing more
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "kept"
            seen["kept"] = out
    assert seen["kept"].finished and seen["kept"].outputs[0].token_ids == expected
    assert engine.block_manager.usage() == 0.0


def test_async_scheduling_is_refused_where_it_cannot_run():
    from kvpilot.server.config import EngineConfig

    assert EngineConfig().async_scheduling == "auto"
    with pytest.raises(ValueError, match="async_scheduling=on with speculative_method=ngram: n-gram proposals are looked up"):
        EngineConfig(async_scheduling="on", speculative_method="ngram")
    assert EngineConfig(async_scheduling="on", speculative_method="draft", speculative_model="draft.gguf").async_scheduling == "on"
    assert EngineConfig(async_scheduling="on", tensor_parallel_size=3).async_scheduling == "on"  # ranks build placeholders' inputs too
    assert EngineConfig.from_cli_args(["--async-scheduling", "off"]).async_scheduling == "off"


@pytest.mark.timeout(300)
def test_async_scheduling_through_the_decode_graph_buffers(sync_llm):
    """The CUDA-graph path (static buffers, capture=False on a CPU) takes the placeholder rows' tokens
    from the device too: they are filled in before the step's inputs are copied into the buffers."""
    from kvpilot.server import LLM, SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=3 + 4 * i, ignore_eos=True) for i in range(3)]
    expected = [o.outputs[0].token_ids for o in sync_llm.generate(PROMPTS[:3], params)]
    llm = LLM(num_threads=1, show_progress=False, async_scheduling="on")
    runner = llm.engine.worker
    runner.start_decode_graphs(llm.engine.max_model_len, capture=False)
    took = []
    run = runner.decode_graphs.run

    def spy(inp):
        took.append(inp.from_previous is not None)
        return run(inp)

    runner.decode_graphs.run = spy
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], params)] == expected
    assert len(took) == 10 and all(took)  # the longest request's tokens 2..11, each step's inputs from the one before


@pytest.mark.timeout(300)
def test_the_server_with_async_scheduling(sync_llm, tmp_path):
    """`kvpilot serve --async-scheduling on`: concurrent streams give the synchronous engine's text, a
    client leaving mid-stream aborts its request and frees its blocks, and the token counter counts
    delivered tokens only (never a dropped row's)."""
    import threading

    import httpx

    from kvpilot.server import SamplingParams
    from server_harness import ServerProcess, metrics, wait_until_freed

    prompts = PROMPTS[:3]
    expected = [o.outputs[0].text for o in sync_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))]
    server = ServerProcess("--async-scheduling", "on", "--kv-cache-memory", "64MiB", log_path=tmp_path / "log").wait_ready()
    try:
        texts = [None] * len(prompts)

        def stream(i):
            body = {"prompt": prompts[i], "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stream": True}
            parts = []
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        parts.append(json.loads(line[6:])["choices"][0]["text"])
            texts[i] = "".join(parts)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert texts == expected
        assert metrics(server.url)["kvpilot:generation_tokens_total"] == 60
        body = {"prompt": PROMPTS[3], "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i > 10:
                    break  # leave mid-stream
        assert wait_until_freed(server.url)
        after = metrics(server.url)
        assert after["kvpilot:request_success_total{finished_reason=abort}"] == 1 and after["kvpilot:generation_tokens_total"] < 60 + 1000
    finally:
        assert server.terminate() == 0
