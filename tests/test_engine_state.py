"""Each piece of request state has one owner (issue #36): the scheduler's Sequence holds scheduling
state only; output state is the output processor's, proposal statistics the proposer's; request
limits are checked once, by RequestLimits, into an Admission the engine never changes."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import pytest

from kvpilot.server.engine.limits import ContextLengthExceeded, RequestLimits, RequestRejected
from kvpilot.server.engine.sampling_params import SamplingParams
from kvpilot.server.engine.sequence import Sequence

ROOT = Path(__file__).resolve().parents[1]
OUTPUT_STATE = {"text", "emitted_len", "logprobs", "prompt_logprobs", "cumulative_logprob", "detokenizer", "stop_reason", "error",
                "finish_reason", "arrival_time", "scheduled_time", "first_token_time", "last_token_time", "finish_time"}
PROPOSER_STATE = {"spec_recent_proposed", "spec_recent_accepted", "spec_paused_steps", "spec_pause_length"}


def test_the_scheduler_request_holds_no_output_timing_or_proposer_state():
    names = {f.name for f in fields(Sequence)}
    assert not names & (OUTPUT_STATE | PROPOSER_STATE), names & (OUTPUT_STATE | PROPOSER_STATE)
    assert {"num_placeholders", "max_output_tokens", "block_table", "num_computed_tokens"} <= names
    seq = Sequence(0, "r", 0, [1, 2], SamplingParams())
    with pytest.raises(AttributeError):  # slots: no module can bolt state onto it
        seq.text = "x"


def test_spec_decode_writes_only_the_proposal_into_sequences():
    tree = ast.parse((ROOT / "server" / "engine" / "spec_decode.py").read_text())
    written = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in ("seq", "s"):
                written.add(t.attr)
    assert written <= {"spec_token_ids"}, written


def test_limits_admit_once_into_an_admission_and_never_touch_params():
    limits = RequestLimits(max_model_len=32, vocab_size=100)
    params = SamplingParams(max_tokens=None)
    admission = limits.admit([1, 2, 3], params)
    assert admission.max_output_tokens == 29 and params.max_tokens is None and admission.params is params
    assert limits.admit([1, 2, 3], SamplingParams(max_tokens=5)).max_output_tokens == 5
    cases = [([], SamplingParams(), RequestRejected, "prompt"), ([100], SamplingParams(), RequestRejected, "prompt"),
             (list(range(32)), SamplingParams(), ContextLengthExceeded, "prompt"),
             ([1], SamplingParams(max_tokens=32), ContextLengthExceeded, "max_tokens"),
             ([1], SamplingParams(max_tokens=None, min_tokens=40), RequestRejected, "min_tokens"),
             ([1], SamplingParams(stop_token_ids=[100]), RequestRejected, "stop_token_ids")]
    for ids, p, error, param in cases:
        with pytest.raises(error) as e:
            limits.admit(ids, p)
        assert e.value.param == param
    assert ContextLengthExceeded.code == "context_length_exceeded"


def test_input_buffers_alternate_two_arenas_and_grow_without_moving_a_live_view():
    import torch

    from kvpilot.server.engine.model_io import InputBuffers

    buffers = InputBuffers(torch.device("cpu"), capacity=8)
    buffers.begin_step()
    a, b = buffers.upload([1, 2, 3], torch.long), buffers.upload([4, 5], torch.long)
    assert a.data_ptr() + 3 * 8 == b.data_ptr()  # one step's uploads follow each other: they never share memory
    grown = buffers.upload(list(range(20)), torch.long)  # past the arena: a new one, twice the size or more
    assert grown.tolist() == list(range(20)) and a.tolist() == [1, 2, 3] and b.tolist() == [4, 5]
    buffers.begin_step()
    c = buffers.upload([7, 8, 9], torch.long)  # the other arena: the step in flight keeps its inputs
    assert a.tolist() == [1, 2, 3] and c.untyped_storage().data_ptr() != grown.untyped_storage().data_ptr()
    buffers.begin_step()
    d = buffers.upload([6], torch.long)  # back to the first arena, from its start
    assert d.data_ptr() == grown.data_ptr() and grown[0].item() == 6


def test_a_running_engine_writes_its_inputs_into_persistent_buffers():
    """Once warm, steps allocate no input tensors: every step's input ids live in one of two buffers."""
    from kvpilot.server import LLM

    llm = LLM(num_threads=1, show_progress=False, max_num_seqs=4)
    storages = []
    launch = llm.engine.worker.launch

    def spy(inp, previous=None, proposal=None):
        storages.append((inp.input_ids.untyped_storage().data_ptr(), inp.sampling.temperature.untyped_storage().data_ptr()))
        return launch(inp, previous, proposal)

    llm.engine.worker.launch = spy
    params = SamplingParams(temperature=0.7, seed=1, max_tokens=12, ignore_eos=True, repetition_penalty=1.1)
    outs = llm.generate(["The capital of France is", "One, two, three,", "Hello"], params)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs) and len(storages) >= 12
    warm = storages[2:]  # the first step of each arena may grow it
    assert len({ids for ids, _ in warm}) == 2 and len({temps for _, temps in warm}) == 2, storages
    # reused buffers carry nothing over: the seeded first prompt, alone now, gets the tokens it got in the batch
    assert llm.generate("The capital of France is", params)[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.timeout(180)
@pytest.mark.parametrize("engine_args", [{"enable_lora": True, "speculative_method": "ngram", "num_speculative_tokens": 3, "kv_offload_dir": ""},
                                         {"async_scheduling": "on"}], ids=["lora+ngram+disk-tier", "async"])
def test_dropping_the_last_llm_frees_its_engine_without_the_garbage_collector(engine_args, tmp_path):
    """The engine's parts call back into it without owning it: a cycle would keep its KV cache and
    weights until a full collection (a test suite or a notebook that makes engines grew by GiBs)."""
    import gc
    import weakref

    from kvpilot.server import LLM

    if "kv_offload_dir" in engine_args:
        engine_args = {**engine_args, "kv_offload_dir": str(tmp_path)}
    gc.disable()
    try:
        llm = LLM(num_threads=1, show_progress=False, kv_cache_memory="64MiB", block_size=8, **engine_args)
        out = llm.generate(["one two three one two three one two three"], SamplingParams(max_tokens=8, temperature=0))
        assert len(out[0].outputs[0].token_ids) == 8
        engine, model = weakref.ref(llm.engine), weakref.ref(llm.engine.worker.model)
        llm.engine.close()
        del llm, out
        assert engine() is None and model() is None
    finally:
        gc.enable()


def test_cached_prompt_tokens_are_counted_once_and_never_past_the_prompt():
    """usage.prompt_tokens_details.cached_tokens: a preempted sequence's re-admission finds its own
    output cached too (it reported more cached tokens than its prompt had)."""
    seq = Sequence(0, "r", 0, list(range(40)), SamplingParams())
    seq.record_cached_prompt(64)
    assert seq.num_cached_tokens == 40
    seq.num_preemptions = 1
    seq.record_cached_prompt(16)
    assert seq.num_cached_tokens == 40
