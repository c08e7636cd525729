"""Sampler: exact masks on hand-built logits, penalties, seeds, stop strings, n, validation."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpilot.server.engine.model_io import InputBuffers, SamplingTensors
from kvpilot.server.engine.sampler import Sampler, apply_penalties, filter_logits, processed_logits
from kvpilot.server.engine.sampling_params import SamplingParams
from kvpilot.server.engine.sequence import Sequence
from kvpilot.server.engine.step_message import BatchSeq

NEG = float("-inf")


def kept(logits: torch.Tensor) -> list[int]:
    return torch.nonzero(logits > NEG).flatten().tolist()


def test_top_k_mask_exact():
    x = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    assert kept(filter_logits(x, 2, 1.0, 0.0)) == [1, 3]
    assert kept(filter_logits(x, 0, 1.0, 0.0)) == [0, 1, 2, 3, 4]


def test_top_p_mask_exact():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    x = probs.log()
    assert kept(filter_logits(x, 0, 0.5, 0.0)) == [0]        # 0.5 already reaches 0.5
    assert kept(filter_logits(x, 0, 0.6, 0.0)) == [0, 1]
    assert kept(filter_logits(x, 0, 0.81, 0.0)) == [0, 1, 2]
    assert kept(filter_logits(x, 0, 0.01, 0.0)) == [0]       # the top token always stays


def test_min_p_mask_exact():
    x = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert kept(filter_logits(x, 0, 1.0, 0.5)) == [0, 1]     # keep p >= 0.25
    assert kept(filter_logits(x, 0, 1.0, 0.2)) == [0, 1, 2]  # keep p >= 0.1

def test_top_k_bound_orders_only_the_best_tokens_and_keeps_what_the_full_sort_keeps():
    """With every row's top-k known (SamplingTensors.top_k_bound), the filter takes the best `bound`
    tokens instead of sorting the vocabulary: the same logits out, with top-p on top; a token past them
    that ties a row's k-th logit is kept (the whole row set is sorted then); masked -inf ties are not."""
    from kvpilot.server.engine.sampler import filter_logits_batch

    torch.manual_seed(0)
    x = torch.randn(6, 1000) * 3
    x[4, :12] = 20.0  # 12 tokens tie for the top: top-k 5 keeps all of them
    x[5, 3:] = NEG   # a constrained row: 3 allowed tokens under top-k 5
    k, top_p = torch.tensor([1, 5, 9, 9, 5, 5]), torch.tensor([1.0, 0.9, 0.5, 1.0, 1.0, 1.0])
    full = filter_logits_batch(x, k, top_p, torch.zeros(6), use_min_p=False)
    bounded = filter_logits_batch(x, k, top_p, torch.zeros(6), use_min_p=False, top_k_bound=9)
    assert torch.equal(bounded, full)
    assert [len(kept(row)) for row in bounded[[0, 3, 4, 5]]] == [1, 9, 12, 3]
    assert tensors([seq([1], top_k=3), seq([1], temperature=1.0, top_k=7)]).top_k_bound == 7
    assert tensors([seq([1], top_k=3, temperature=1.0), seq([1], temperature=1.0)]).top_k_bound == 0  # a row without top-k



def tensors(seqs, eos_token_ids=()) -> SamplingTensors:
    return SamplingTensors.build(seqs, eos_token_ids, torch.float32, InputBuffers(torch.device("cpu")))


def sample(logits, seqs, eos_token_ids=()):
    return Sampler()(logits, tensors(seqs, eos_token_ids))


def seq(prompt, output=(), **params):
    """A sequence as a worker's batch holds it (what the sampling tensors read)."""
    return BatchSeq(0, list(prompt) + list(output), len(prompt), [], SamplingParams(**params))


def test_penalties_exact():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0, 0.5]])
    s = seq([0], [1, 2, 2], repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits.clone(), tensors([s]).penalties)
    # token 0 (prompt): 2/2 = 1; token 1 (out x1): -2*2 - 0.5 - 0.25; token 2 (out x2): 1/2 - 1.0 - 0.25
    assert torch.allclose(out, torch.tensor([[1.0, -4.75, -0.75, 1.0, 0.5]]))


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.zeros(1, 6)
    s = seq([0], [4], min_tokens=3, stop_token_ids=[5])
    logits, _ = processed_logits(logits, tensors([s], eos_token_ids=(2,)))
    assert logits[0, 2] == NEG and logits[0, 5] == NEG and kept(logits[0]) == [0, 1, 3, 4]


def test_greedy_and_temperature_zero():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    assert sample(logits, [seq([0], temperature=0), seq([0], temperature=0)]).token_ids == [[1], [0]]


def test_seeded_sampling_reproducible_and_follows_distribution():
    logits = torch.tensor([[0.0, math.log(3.0), NEG]])  # probs 0.25, 0.75, 0

    def draw(seed, n=400):
        s = seq([0], temperature=1.0, seed=seed)
        s.generator = torch.Generator().manual_seed(seed)
        return [sample(logits, [s]).token_ids[0][0] for _ in range(n)]

    a, b, c = draw(7), draw(7), draw(8)
    assert a == b and a != c
    assert 2 not in a
    assert 0.65 < a.count(1) / len(a) < 0.85


def test_logprobs_top_n():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    r = sample(logits, [seq([0], temperature=0, logprobs=2)])
    ref = torch.log_softmax(logits[0], -1)
    assert r.logprobs[0][0] == pytest.approx({2: float(ref[2]), 1: float(ref[1])})
    assert r.logprobs[0][0][r.token_ids[0][0]] == pytest.approx(float(ref[2])) and r.token_ids[0] == [2]


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n"), ({"min_p": 2.0}, "min_p"), ({"top_k": -5}, "top_k"),
    ({"logprobs": 21}, "logprobs"), ({"stop": [""]}, "stop"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"), ({"min_p": float("nan")}, "min_p"),
])
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


# --- engine-level behaviour (real model) -------------------------------------------------------

@pytest.fixture(scope="module")
def llm():
    from kvpilot.server import LLM

    return LLM(num_threads=1, show_progress=False)


def test_stop_string_across_tokens(llm):
    prompt = "The capital of France is"
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    tok = llm.get_tokenizer()
    # A stop string that spans a token boundary: the tail of one token + the head of the next.
    pieces = [tok.decode([t]) for t in full.token_ids]
    i = next(k for k in range(2, len(pieces) - 1) if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 2)
    stop = pieces[i][-2:] + pieces[i + 1][:2]
    expected = full.text[: full.text.index(stop)]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.text == expected and out.finish_reason == "stop" and out.stop_reason == stop
    kept_ = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True))[0].outputs[0]
    assert kept_.text == expected + stop


def test_stop_token_ids_and_eos(llm):
    full = llm.generate("1, 2, 3,", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    target = full.token_ids[3]
    out = llm.generate("1, 2, 3,", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[target]))[0].outputs[0]
    assert out.token_ids == full.token_ids[: full.token_ids.index(target) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target
    chat = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=200))[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] == 2 and "<|im_end|>" not in chat.text


def test_n_and_seed(llm):
    p = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=123, ignore_eos=True)
    a = llm.generate("Tell me a story", p)[0]
    b = llm.generate("Tell me a story", p)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in a.outputs)


def test_min_tokens_and_max_tokens(llm):
    out = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, min_tokens=40, max_tokens=40))[0].outputs[0]
    assert len(out.token_ids) == 40 and 2 not in out.token_ids and out.finish_reason == "length"


def test_prompt_too_long_and_empty(llm):
    with pytest.raises(ValueError, match="maximum context"):
        llm.generate([5] * 9000, SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([10**6], SamplingParams())


extreme_unit = st.one_of(st.just(5e-324), st.just(2.225073858507203e-309), st.just(1e-45), st.just(1 - 1e-9),
                         st.floats(min_value=0, max_value=1))


@settings(max_examples=200, deadline=None)
@given(temperature=st.one_of(st.just(1e-300), st.just(5e-324), st.just(1e300), st.floats(min_value=0, max_value=1e6)),
       top_p=extreme_unit.filter(lambda v: v > 0), min_p=extreme_unit, top_k=st.integers(-1, 40),
       scale=st.sampled_from([1.0, 1e4, 1e30]), seed=st.integers(0, 2**31))
def test_any_valid_params_sample_a_real_token(temperature, top_p, min_p, top_k, scale, seed):
    """Extreme but valid values (denormal top_p, tiny temperature, huge logits) never give NaN probabilities."""
    params = dict(temperature=temperature, top_p=top_p, min_p=min_p, top_k=top_k, seed=seed)
    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(seed)) * scale
    logits[1, 3] = NEG  # a masked entry, as min_tokens leaves it
    r = sample(logits, [seq([0], **params), seq([0], **params)], eos_token_ids=(3,))
    assert all(0 <= t < 32 for [t] in r.token_ids) and r.token_ids[1] != [3]


def test_seeded_request_is_identical_alone_and_inside_a_batch(llm):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, repetition_penalty=1.1, seed=2024, max_tokens=24, ignore_eos=True)
    alone = llm.generate(["Once upon a time"], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=t, max_tokens=m, ignore_eos=True, presence_penalty=0.5) for t, m in ((1.0, 30), (0.0, 12), (0.7, 40))]
    prompts = ["Once upon a time", "The weather today", "List three fruits:", "In 1492,"]
    batched = llm.generate(prompts, [seeded, *others])
    assert batched[0].outputs[0].token_ids == alone and len(alone) == 24


def test_batched_processing_equals_row_by_row():
    """Rows with different parameters in one batch get exactly what each would get alone."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    rows = [seq([1, 2], [3, 3, 4], temperature=0.7, top_k=5, repetition_penalty=1.5),
            seq([5], [], temperature=1.3, top_p=0.6, min_tokens=2, stop_token_ids=[7], max_tokens=8),
            seq([9], [9, 9], temperature=0.0, frequency_penalty=1.0),
            seq([0], [1], temperature=2.0, min_p=0.2, presence_penalty=-1.0)]
    together = processed_logits(logits.clone(), tensors(rows, eos_token_ids=(3,)))
    random_rows = tensors(rows).random_rows
    assert random_rows == [0, 1, 3]
    for i, s in enumerate(rows):
        alone = processed_logits(logits[i:i + 1].clone(), tensors([s], eos_token_ids=(3,)))
        assert torch.equal(together[0][i], alone[0][0])
        if i in random_rows:
            assert torch.equal(together[1][random_rows.index(i)], alone[1][0])


def test_several_tokens_appended_at_once_stop_at_the_first_stop(llm):
    """What speculative decoding will do: a run of tokens appended in one step ends the sequence at the
    first token that stops it (a stop token id here, max_tokens next, a stop string in the output
    assembler last, which tells the engine), and nothing after it is kept."""
    from kvpilot.server.engine.output_assembler import OutputAssembler
    from kvpilot.server.engine.output_processor import OutputProcessor
    from kvpilot.server.engine.scheduler import Scheduler

    engine = llm.engine
    tok = llm.get_tokenizer()
    ids = tok.encode("one two three four five six")
    out = OutputProcessor(Scheduler(engine.block_manager, 4, 64), tok.eos_token_ids)

    told = []

    def run(params, tokens):
        s = Sequence(0, "r", 0, [1, 2], params)
        out.add("r", [s], 0.0)
        out.scheduler.add(s)
        assembler = OutputAssembler(tok, lambda *stop: told.append(stop), told.append)
        assembler.add("r", None, [1, 2], params)
        out.append(s, tokens, None, 0.0)
        return assembler.apply(out.delta("r")).outputs[0]

    stopped = run(SamplingParams(max_tokens=10, stop_token_ids=[ids[2]]), ids)
    assert stopped.token_ids == ids[:3] and stopped.finish_reason == "stop" and stopped.stop_reason == ids[2]
    assert stopped.text == tok.decode(ids[:3])
    capped = run(SamplingParams(max_tokens=2), ids)
    assert capped.token_ids == ids[:2] and capped.finish_reason == "length"
    whole = run(SamplingParams(max_tokens=10, stop=[" four"]), ids)
    assert whole.finish_reason == "stop" and whole.text == "one two three" and len(whole.token_ids) <= 4
    assert told == [("r", 0, " four")]
