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
    seq.record_cached_prompt(16, "device")
    seq.record_cached_prompt(48, "host")  # read from a tier after the in-memory hits
    assert seq.num_cached_tokens == 40 and seq.cached_sources == {"device": 16, "host": 24}
    seq.num_preemptions = 1
    seq.record_cached_prompt(16, "device")
    assert seq.num_cached_tokens == 40 and seq.cached_sources == {"device": 16, "host": 24}


# --- one worker per rank, built from the Step message (issue #62) ------------------------------------

ENGINE = ROOT / "server" / "engine"


def _written_attributes(path: Path) -> dict[str, set[str]]:
    """Attribute name -> the classes (or "<module>") of `path` whose code assigns it on some object."""
    written: dict[str, set[str]] = {}
    tree = ast.parse(path.read_text())

    def visit(node, owner):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.ClassDef) else owner
            targets = child.targets if isinstance(child, ast.Assign) else [child.target] if isinstance(child, ast.AugAssign) else []
            for t in targets:
                for e in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(e, ast.Attribute):
                        written.setdefault(e.attr, set()).add(owner)
            visit(child, inner)

    visit(tree, "<module>")
    return written


def test_only_the_async_scheduler_writes_the_in_flight_counters_of_a_sequence():
    """num_placeholders / num_unsettled: one writer (AsyncScheduler); a worker's batch keeps its own copy
    (BatchSeq, from the message)."""
    writers = {}
    for path in ENGINE.glob("*.py"):
        for name, owners in _written_attributes(path).items():
            if name in ("num_placeholders", "num_unsettled"):
                writers.setdefault(path.name, set()).update(owners)
    assert writers == {"scheduler.py": {"AsyncScheduler"}, "step_message.py": {"WorkerBatch"}}, writers


def test_the_input_builder_and_the_worker_never_see_a_sequence():
    """InputBuilder takes the message's StepBatch alone; the worker holds one model (a drafter holds its own)."""
    import inspect

    from kvpilot.server.engine import drafters, model_io, worker

    for module in (model_io, worker, drafters):
        source = inspect.getsource(module)
        assert "engine.sequence import Sequence" not in source and "ScheduledBatch" not in source, module.__name__
    build = inspect.signature(model_io.InputBuilder.build)
    assert list(build.parameters) == ["self", "batch", "proposal", "sample", "next_tokens"]
    assert "StepBatch" in str(build.parameters["batch"].annotation)
    # one model attribute on a worker: `model`; DecoderModels elsewhere are the drafters'
    models = [n for n, owners in _written_attributes(ENGINE / "worker.py").items() if n in ("model", "draft", "head") and "Worker" in owners]
    assert models == ["model"], models


def _reference_layout(batch, slots, block_size):
    """A step's rows read straight off the engine's Sequences, the old way (rank 0 built its tensors from
    them): the rows of each sequence in the builder's order (prefills first, then decodes and
    verifications; each part grouped by adapter slot), their token (None where a drafter fills it on
    the device), position, cache slot, adapter slot, and which rows are sampled."""
    from kvpilot.server.engine.sequence import PLACEHOLDER_TOKEN

    slots = slots or [-1] * len(batch.seqs)
    order = sorted(range(len(batch.seqs)), key=lambda i: (batch.num_new_tokens[i] == 1 or batch.seqs[i].num_spec_tokens > 0, slots[i]))
    ids, positions, cache_slots, row_slots, sampled = [], [], [], [], []
    for i in order:
        seq, n = batch.seqs[i], batch.num_new_tokens[i]
        start = seq.num_computed_tokens
        known = seq.prompt_token_ids + seq.output_token_ids + [PLACEHOLDER_TOKEN] * seq.num_placeholders
        tokens = known + (list(seq.spec_token_ids) or [None] * seq.num_spec_tokens)
        first = len(ids)
        ids += tokens[start:start + n]
        positions += range(start, start + n)
        cache_slots += [seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]
        row_slots += [slots[i]] * n
        if seq.num_spec_tokens:
            sampled += range(first, first + n)
        elif start + n == seq.num_tokens:
            sampled.append(first + n - 1)
    return ids, positions, cache_slots, row_slots, sampled


def _check_every_step(engine, seen):
    """Compare each launched step's ModelInput (built by the worker from the message) with the reference."""
    step, launch = engine.messenger.step, engine.worker.launch
    expected = []

    def message(batch, previous, num_previous_tokens=0, adapter_slots=None, *rest):
        expected.append(_reference_layout(batch, adapter_slots, engine.config.block_size))
        seen["preempted"] += sum(seq.num_preemptions > 0 for seq in batch.seqs)
        seen["guided"] += sum(seq.guide is not None for seq in batch.seqs)
        return step(batch, previous, num_previous_tokens, adapter_slots, *rest)

    def launched(inp, previous=None, proposal=None):
        ids, positions, cache_slots, row_slots, sampled = expected.pop()
        assert inp.positions.tolist() == positions and inp.slot_mapping.tolist() == cache_slots
        assert inp.logits_indices.tolist() == sampled
        assert [a for a, b in zip(inp.input_ids.tolist(), ids) if b is not None] == [b for b in ids if b is not None]
        assert (inp.lora.token_slots.tolist() if inp.lora is not None else [-1] * len(row_slots)) == row_slots
        seen["steps"] += 1
        seen["drafted"] += ids.count(None)
        seen["proposed"] += len(sampled) - (0 if inp.sampling is None else len(inp.sampling.row_counts))
        seen["masked"] += 0 if inp.sampling is None or inp.sampling.guided_rows is None else inp.sampling.guided_rows.numel()
        seen["adapter rows"] += sum(s >= 0 for s in row_slots)
        return launch(inp, previous, proposal)

    engine.messenger.step, engine.worker.launch = message, launched


def _run(engine, requests):
    for i, (prompt, params, lora) in enumerate(requests):
        engine.add_request(prompt, params, request_id=f"r{i}", lora_request=lora)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    return finals


@pytest.mark.timeout(300)
def test_rank_0_builds_from_the_message_what_the_sequences_say(lora_peft_case, model_path, tmp_path):
    """Chunked prefill, preemption, prefix hits, a LoRA adapter, a structured row and n-gram proposals
    in one engine; then draft-model (async: placeholders and shifted rows) and EAGLE-3 proposals: every
    step's tensors, built by rank 0's worker from the Step message, are the layout the engine's
    Sequences give."""
    from collections import Counter

    from eagle_factory import write_eagle3_head
    from kvpilot.server.adapters import LoRARequest
    from kvpilot.server.config import EngineConfig
    from kvpilot.server.engine.llm_engine import LLMEngine
    from kvpilot.server.engine.structured import StructuredOutput
    from kvpilot.server.gguf_loader import write_truncated
    from kvpilot.server.loading import open_model

    paths = lora_peft_case[0]
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    repeat = "one two three " * 7  # over a block: its second run finds it cached
    seen = Counter()
    engine = LLMEngine(EngineConfig(num_threads=1, kv_cache_memory="6MiB", max_num_batched_tokens=16, enable_lora=True, max_loras=2,
                                    max_lora_rank=16, speculative_method="ngram", speculative_disable_batch_size=0,
                                    speculative_min_acceptance=0.0), show_progress=False)
    _check_every_step(engine, seen)
    adapter = LoRARequest("all7-r8", 1, str(paths["all7-r8"]))
    coded = SamplingParams(temperature=0, max_tokens=12, structured=StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,8}"))
    requests = [(repeat, greedy, None), ("The capital of France is Paris, and the capital of", greedy, adapter),
                ("A code like 123-abc:", coded, None), (repeat + " four", SamplingParams(temperature=0.8, seed=2, max_tokens=24), None),
                ("Hello, my name is", greedy, adapter)]
    _run(engine, requests)
    _run(engine, requests[:2])  # their prompts' blocks are cached now: prefix hits
    assert engine.block_manager.prefix_hits > 0 and engine.scheduler.num_preemptions > 0
    assert seen["preempted"] and seen["guided"] and seen["masked"] and seen["adapter rows"] and seen["proposed"]

    draft = write_truncated(model_path, tmp_path / "draft4.gguf", 4)
    weights, tokenizer = open_model(model_path)
    head = write_eagle3_head(tmp_path / "head", weights.config, sorted(set(tokenizer.encode(repeat)) | set(range(8))))
    drafted = {}
    for method, extra in (("draft", {"speculative_model": str(draft), "async_scheduling": "on"}), ("eagle3", {"speculative_model": str(head)})):
        seen = Counter()
        engine = LLMEngine(EngineConfig(num_threads=1, kv_cache_memory="16MiB", max_num_batched_tokens=32, speculative_method=method,
                                        speculative_disable_batch_size=0, speculative_min_acceptance=0.0, **extra), show_progress=False)
        _check_every_step(engine, seen)
        _run(engine, [(repeat, greedy, None), ("1, 2, 3, 4,", SamplingParams(temperature=1.0, seed=1, max_tokens=16), None),
                      ("Penalised:", SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.2), None)])
        drafted[method] = seen["drafted"]
        assert seen["steps"] > 5
    assert drafted["draft"] > 0 and drafted["eagle3"] > 0
