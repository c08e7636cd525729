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
OUTPUT_STATE = {"text", "emitted_text_len", "logprobs", "prompt_logprobs", "cumulative_logprob", "detokenizer", "stop_reason", "error",
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
