"""Tensor-parallel ranks as SPMD workers (issue #36): every rank gets the same typed Step message and
builds its own tensors (nothing pickled per step), and async scheduling works over three ranks: the
same tokens as the synchronous engine, steps launched before the previous one is waited for, and
aborts and preemptions that free every block."""

from __future__ import annotations

import pytest
from launch_spy import spy_on_launches

WORLD = 3
CACHE = "2MiB"  # per rank: ~130 tokens, too few blocks for every request at once (preemptions)
PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):"]


def params():
    from kvpilot.server import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.8, seed=5, max_tokens=8, stop=["."]),
            SamplingParams(temperature=0.7, seed=3, n=2, max_tokens=6),
            SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3, min_tokens=3, prompt_logprobs=1)]


def tp_llm(**kw):
    from kvpilot.server import LLM

    # A small cache and a 16-token budget: prompts prefill in chunks, and decodes preempt each other.
    return LLM(num_threads=1, show_progress=False, tensor_parallel_size=WORLD, max_num_batched_tokens=16, max_num_seqs=8, **kw)


def outputs(outs):
    return [[(o.token_ids, o.text, o.finish_reason) for o in r.outputs] + [r.prompt_logprobs] for r in outs]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["off", "on"])
def test_a_rank_builds_from_the_step_message_what_rank_0_builds(mode):
    """In one process: every step's Step message, as the other ranks get it (through msgpack, without
    the sampling parts) into a WorkerBatch of their own, gives the ModelInput rank 0's worker builds,
    tensor for tensor, under chunked prefill, preemption, async placeholders, n-gram proposals (off)
    and prompt logprobs."""
    import torch

    from kvpilot.server import LLM
    from kvpilot.server.engine.model_io import InputBuilder
    from kvpilot.server.engine.step_message import WorkerBatch, decode, encode

    extra = {"speculative_method": "ngram", "speculative_disable_batch_size": 0} if mode == "off" else {}
    llm = LLM(num_threads=1, show_progress=False, kv_cache_memory="8MiB", max_num_batched_tokens=16, async_scheduling=mode, **extra)
    engine = llm.engine
    rank_batch, rank_inputs, theirs, checked = WorkerBatch(), InputBuilder(engine.config.block_size, (), torch.device("cpu")), [], []
    step, launch = engine.messenger.step, engine.worker.launch

    def message(*args):
        sent = step(*args)
        theirs.append(rank_inputs.build(rank_batch.apply(decode(encode(sent.for_other_ranks()))), sample=False)[0])
        return sent

    def launched(inp, previous=None, proposal=None):
        other = theirs.pop()
        for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables", "logits_indices", "from_previous"):
            a, b = getattr(inp, name), getattr(other, name)
            assert (a is None and b is None) or torch.equal(a, b), name
        assert (inp.num_prefills, inp.query_lens, inp.context_lens) == (other.num_prefills, other.query_lens, other.context_lens)
        assert [(r.first_row, r.target_ids, r.top_k) for r in inp.prompt_logprobs] == [(r.first_row, r.target_ids, r.top_k) for r in other.prompt_logprobs]
        assert other.sampling is None
        checked.append(inp.from_previous is not None)
        return launch(inp, previous, proposal)

    engine.messenger.step, engine.worker.launch = message, launched
    from kvpilot.server import SamplingParams

    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)  # three of these outgrow the 160-token cache: preemptions
    llm.generate([p * 4 for p in PROMPTS] + PROMPTS[:3], params() + [long] * 3)
    assert engine.scheduler.num_preemptions > 0 and len(checked) > 20
    assert any(checked) == (mode == "on")


@pytest.fixture(scope="module")
def sync_outputs():
    llm = tp_llm(kv_cache_memory=CACHE, async_scheduling="off")
    try:
        return outputs(llm.generate(PROMPTS, params()))
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def async_llm(sync_outputs):  # after the synchronous engine is closed: one tensor-parallel engine per process
    llm = tp_llm(kv_cache_memory=CACHE, async_scheduling="on")
    yield llm
    llm.engine.close()


@pytest.mark.timeout(300)
def test_async_over_three_ranks_gives_the_synchronous_tokens_without_pickling_a_step(sync_outputs, async_llm, monkeypatch):
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    llm = async_llm
    assert llm.engine.async_scheduling and llm.engine.workers is not None
    pickled = []

    def refuse(*a, **k):
        pickled.append(a)
        raise AssertionError("an object was pickled on the step path")

    monkeypatch.setattr(dist, "broadcast_object_list", refuse)
    monkeypatch.setattr(c10d, "_object_to_tensor", refuse)
    runner, events = llm.engine.worker, []
    spy_on_launches(runner, events)
    got = outputs(llm.generate(PROMPTS, params()))
    del runner.launch  # the class's launch again
    monkeypatch.undo()
    assert got == sync_outputs
    assert not pickled
    assert any(e[2] for e in events if e[0] == "launch")  # placeholder rows (their tokens broadcast to the other ranks)
    # step n + 1 is launched before step n is waited for, every time (counted)
    position = {e[:2]: i for i, e in enumerate(events)}
    launches = sum(1 for e in events if e[0] == "launch")
    assert launches > 5 and all(position[("launch", n + 1)] < position[("wait", n)] for n in range(launches - 1))
    assert llm.engine.block_manager.usage() == 0.0


@pytest.mark.timeout(300)
def test_abort_and_preemption_under_async_over_three_ranks_free_every_block(sync_outputs, async_llm):
    from kvpilot.server import SamplingParams

    llm = async_llm
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(6):
        engine.add_request(PROMPTS[i % len(PROMPTS)] * 3, greedy, request_id=f"r{i}")
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        steps += 1
        if steps == 6:
            assert engine.abort_request("r1").finished
    assert engine.scheduler.num_preemptions > 0
    assert set(finals) == {f"r{i}" for i in range(6) if i != 1}
    assert all(len(f.outputs[0].token_ids) == 40 for f in finals.values())
    assert engine.block_manager.usage() == 0.0 and not engine.scheduler.running and not engine.scheduler.waiting
    # and the engine still gives the synchronous tokens afterwards
    assert outputs(llm.generate(PROMPTS, params())) == sync_outputs
