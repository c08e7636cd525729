"""EAGLE-3 heads (server/models/eagle.py): the layout our loader reads, pinned to a reference loader's
source; the target hidden states a head reads, against transformers' own; heads that do not fit the
target refused by name at start. (Exactness with a head: tests/test_spec_decode.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from eagle_factory import write_eagle3_head
from kvpilot.server.model_config import ModelFormatError

# The tensors vLLM's EAGLE-3 loader takes (vllm/model_executor/models/llama_eagle3.py at commit
# 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190): `LlamaDecoderLayer` (qkv over 2 x hidden_size; its
# input_layernorm, hidden_norm and post_attention_layernorm; the Llama MLP), `LlamaModel` (fc over
# 3 x target_hidden_size, norm; "midlayer." renamed to "layers.0."; embed_tokens only when present) and
# `Eagle3LlamaForCausalLM.load_weights` (lm_head of draft_vocab_size rows; d2t -> draft_id_to_target_id;
# t2d skipped). Written here from that source, not from our loader.
REFERENCE_LAYOUT = {
    "fc.weight": lambda h, t, i, q, kv, dv, v: (h, 3 * t),
    "midlayer.input_layernorm.weight": lambda h, t, i, q, kv, dv, v: (h,),
    "midlayer.hidden_norm.weight": lambda h, t, i, q, kv, dv, v: (h,),
    "midlayer.self_attn.q_proj.weight": lambda h, t, i, q, kv, dv, v: (q, 2 * h),
    "midlayer.self_attn.k_proj.weight": lambda h, t, i, q, kv, dv, v: (kv, 2 * h),
    "midlayer.self_attn.v_proj.weight": lambda h, t, i, q, kv, dv, v: (kv, 2 * h),
    "midlayer.self_attn.o_proj.weight": lambda h, t, i, q, kv, dv, v: (h, q),
    "midlayer.post_attention_layernorm.weight": lambda h, t, i, q, kv, dv, v: (h,),
    "midlayer.mlp.gate_proj.weight": lambda h, t, i, q, kv, dv, v: (i, h),
    "midlayer.mlp.up_proj.weight": lambda h, t, i, q, kv, dv, v: (i, h),
    "midlayer.mlp.down_proj.weight": lambda h, t, i, q, kv, dv, v: (h, i),
    "norm.weight": lambda h, t, i, q, kv, dv, v: (h,),
    "lm_head.weight": lambda h, t, i, q, kv, dv, v: (dv, h),
    "d2t": lambda h, t, i, q, kv, dv, v: (dv,),
    "t2d": lambda h, t, i, q, kv, dv, v: (v,),
    "embed_tokens.weight": lambda h, t, i, q, kv, dv, v: (v, h),
}


@pytest.fixture(scope="module")
def target(model_path):
    from kvpilot.server.loading import open_model

    return open_model(model_path)[0].config


def test_layout_is_the_reference_loaders(target, tmp_path):
    from kvpilot.server.models.eagle import OPTIONAL, head_tensor_shapes, read_head_config

    config = read_head_config(write_eagle3_head(tmp_path / "h", target, list(range(100))), target)
    c = config
    args = (c.hidden_size, c.target_hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
            c.draft_vocab_size, c.vocab_size)
    assert head_tensor_shapes(config) == {name: shape(*args) for name, shape in REFERENCE_LAYOUT.items()}
    assert OPTIONAL == {"embed_tokens.weight", "t2d"}
    # vLLM's default target layers when the head names none: (2, L // 2, L - 3)
    assert config.aux_layers == (2, target.num_layers // 2, target.num_layers - 3)


def test_the_head_reads_the_hidden_states_transformers_numbers_as_the_layer_ids(target, model_path, hf_oracle_session):
    """vLLM's aux layer id j is the residual stream entering layer j: transformers' hidden_states[j]
    (hidden_states[0] the embeddings)."""
    from kvpilot.kernels.paged_attention import AttentionMetadata
    from kvpilot.server.config import EngineConfig
    from kvpilot.server.engine.worker import Worker
    from kvpilot.server.loading import open_model

    weights, tokenizer = open_model(model_path)
    runner = Worker(EngineConfig(num_threads=1, kv_cache_memory="16MiB"), weights, show_progress=False)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog")
    n = len(ids)
    meta = AttentionMetadata.one_prefill(n, runner.block_size, runner.device)
    runner.model.declare_aux_output((0, 2, 29))
    with torch.inference_mode():
        _, aux = runner.model(torch.tensor(ids), torch.arange(n), runner.kv_caches, meta)
        hf = hf_oracle_session.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for k, layer in enumerate((0, 2, 29)):
        ours = aux[:, k * target.hidden_size:(k + 1) * target.hidden_size]
        torch.testing.assert_close(ours, hf[layer][0].float(), rtol=1e-3, atol=1e-3)
        assert not torch.allclose(ours, hf[layer + 1][0].float(), rtol=1e-2, atol=1e-2)  # one layer off is far off


@pytest.mark.parametrize(("change", "message"), [
    (dict(hidden_size=512), "no embed_tokens.weight, and its hidden size 512 is not the target's 576"),
    (dict(vocab_size=1000), "vocab_size 1000 is not the target's 49152"),
    (dict(aux_layers=[2, 15, 30]), "must be three of the target's layers 0..29"),
    (dict(aux_layers=[2, 15, 15]), "names a layer twice"),
    (dict(config={"num_hidden_layers": 2}), "num_hidden_layers=2"),
    (dict(config={"architectures": ["LlamaForCausalLM"]}), "is not ['LlamaForCausalLMEagle3']"),
    (dict(config={"target_hidden_size": 960}), "its target hidden size is 960, the target's is 576"),
    (dict(tensors={"lm_head.weight": torch.zeros(7, 576)}), "lm_head.weight has shape (7, 576), the target needs (100, 576)"),
    (dict(tensors={"midlayer.extra.weight": torch.zeros(3)}), "not in the EAGLE-3 layout: midlayer.extra.weight"),
    (dict(tensors={"d2t": torch.full((100,), 49100, dtype=torch.long)}), "d2t does not map the draft vocabulary onto distinct target ids"),
    # head counts: each would divide by zero or build attention that cannot split its rows into heads
    (dict(config={"num_attention_heads": 0, "head_dim": None}), "num_attention_heads=0 (a count of heads is a positive integer)"),
    (dict(config={"num_attention_heads": 0}), "num_attention_heads=0 (a count of heads is a positive integer)"),
    (dict(config={"num_attention_heads": -9}), "num_attention_heads=-9 (a count of heads is a positive integer)"),
    (dict(config={"num_attention_heads": 9.0}), "num_attention_heads=9.0 (a count of heads is a positive integer)"),
    (dict(config={"num_key_value_heads": 0}), "num_key_value_heads=0 (a count of heads is a positive integer)"),
    (dict(config={"head_dim": -64}), "head_dim=-64 (a head's size is a positive integer)"),
    (dict(config={"num_key_value_heads": 2}), "num_attention_heads=9 is not a multiple of num_key_value_heads=2"),
    (dict(config={"num_attention_heads": 7, "num_key_value_heads": None, "head_dim": None}), "hidden_size 576 is not a multiple of num_attention_heads=7 (and no head_dim is given)"),
    # non-finite weights, refused by name as an adapter's are (engine/lora.py)
    (dict(tensors={"fc.weight": torch.full((576, 1728), float("nan"))}), "fc.weight holds non-finite values"),
    (dict(tensors={"midlayer.mlp.down_proj.weight": torch.zeros(576, 1536).index_fill_(1, torch.tensor([3]), float("inf"))}),
     "midlayer.mlp.down_proj.weight holds non-finite values"),
])
def test_heads_that_do_not_fit_are_refused_by_name(target, tmp_path, change, message):
    from safetensors.torch import load_file, save_file

    from kvpilot.server.models.eagle import load_head

    head = write_eagle3_head(tmp_path / "head", target, list(range(100)), **{k: v for k, v in change.items() if k in ("hidden_size", "vocab_size", "aux_layers")})
    if "config" in change:
        config = json.loads((head / "config.json").read_text())
        (head / "config.json").write_text(json.dumps({**config, **change["config"]}))
    if "tensors" in change:
        tensors = load_file(str(head / "model.safetensors"))
        save_file({**tensors, **change["tensors"]}, str(head / "model.safetensors"))
    with pytest.raises(ModelFormatError) as e:
        load_head(head, target, None, torch.device("cpu"), torch.float32)
    assert message in str(e.value)


def test_a_bad_head_stops_the_engine_at_start(target, tmp_path):
    from kvpilot.server.config import EngineConfig
    from kvpilot.server.engine.llm_engine import LLMEngine

    head = write_eagle3_head(tmp_path / "head", target, list(range(100)), vocab_size=1000)
    with pytest.raises(ModelFormatError, match="vocab_size 1000"):
        LLMEngine(EngineConfig(num_threads=1, kv_cache_memory="16MiB", speculative_method="eagle3", speculative_model=str(head)), show_progress=False)
    with pytest.raises(ValueError, match="eagle3 needs speculative_model"):
        EngineConfig(speculative_method="eagle3")
    # (over several ranks it runs on rank 0: tests/test_spec_lora_tp.py)
    assert EngineConfig(speculative_method="eagle3", speculative_model=str(head), tensor_parallel_size=2).tensor_parallel_size == 2


@pytest.mark.parametrize(("config", "tensors", "message"), [
    ({"num_attention_heads": 0, "head_dim": None}, {}, "num_attention_heads=0 (a count of heads is a positive integer)"),
    ({}, {"lm_head.weight": torch.full((100, 576), float("-inf"))}, "lm_head.weight holds non-finite values"),
])
def test_a_bad_head_ends_start_up_with_exit_2_naming_what_is_wrong(target, model_path, tmp_path, capsys, config, tensors, message):
    """What `kvpilot generate` / `kvpilot serve` return (cli.main is the console script's exit code)."""
    from safetensors.torch import load_file, save_file

    from kvpilot.server.cli import main

    head = write_eagle3_head(tmp_path / "head", target, list(range(100)))
    (head / "config.json").write_text(json.dumps({**json.loads((head / "config.json").read_text()), **config}))
    save_file({**load_file(str(head / "model.safetensors")), **tensors}, str(head / "model.safetensors"))
    assert main(["generate", "Hello", "--model", str(model_path), "--num-threads", "1", "--kv-cache-memory", "16MiB",
                 "--speculative-method", "eagle3", "--speculative-model", str(head)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"kvpilot: error: EAGLE-3 head {head}: {message}"  # after the target's loading bar


def test_training_math_is_the_serving_heads(target, model_path, tmp_path):
    """kvpilot train-eagle's differentiable head and the engine's serving head compute the same thing:
    a head written by the trainer, loaded by the engine, gives step 1's logits over a prompt as the
    trainer's module does (the same RoPE layout, norms, GQA grouping and draft-vocabulary mapping)."""
    from kvpilot.kernels.paged_attention import AttentionMetadata
    from kvpilot.server.config import EngineConfig
    from kvpilot.server.eagle_training import TrainingHead, _dense_embedding, save
    from kvpilot.server.engine.drafters import Eagle3
    from kvpilot.server.engine.worker import Worker
    from kvpilot.server.loading import open_model

    weights, tokenizer = open_model(model_path)
    runner = Worker(EngineConfig(num_threads=1, kv_cache_memory="16MiB"), weights, show_progress=False)
    torch.manual_seed(0)
    draft_ids = sorted(torch.randperm(target.vocab_size)[:500].tolist())
    trainer = TrainingHead(target, _dense_embedding(runner.model), len(draft_ids), runner.model.rotary.cos, runner.model.rotary.sin)
    with torch.no_grad():
        for p in trainer.parameters():
            p.copy_((p + 0.1 * torch.randn_like(p)).half().float())  # norms not all ones; what the float16 file will hold
    aux_layers = (2, 15, 27)
    save(trainer, target, draft_ids, aux_layers, tmp_path / "head", {})
    ids = tokenizer.encode("Write three short facts about the moon and the tides.")
    n = len(ids)
    meta = AttentionMetadata.one_prefill(n, runner.block_size, runner.device)
    drafter = Worker(EngineConfig(num_threads=1, kv_cache_memory="16MiB", speculative_method="eagle3", speculative_model=str(tmp_path / "head")),
                     weights, show_progress=False, drafter=lambda worker: Eagle3(worker, str(tmp_path / "head"))).drafter
    head = drafter.head
    assert head.config.aux_layers == aux_layers
    runner.model.declare_aux_output(aux_layers)
    with torch.inference_mode():
        _, aux = runner.model(torch.tensor(ids), torch.arange(n), runner.kv_caches, meta)
        # the engine's rows: position p takes the token at p + 1 (the last row's is a dummy here and left out)
        next_ids = torch.tensor(ids[1:] + [0])
        normed, _ = head(next_ids, torch.arange(n), head.fc(aux), drafter.kv_cache, meta)
        served = head.logits(normed)[:-1][:, torch.tensor(draft_ids)]
        trained, _ = trainer(next_ids[None, :-1], aux[None, :-1].float(), torch.arange(n - 1)[None])
    torch.testing.assert_close(served, trained[0], rtol=1e-3, atol=1e-3)


def test_train_eagle_writes_a_head_the_engine_serves_exactly(tmp_path):
    """A tiny `kvpilot train-eagle` (four prompts, a few seconds): the head it writes loads, drafts, and
    greedy output with it is plain decoding's."""
    from kvpilot.server.cli import main
    from kvpilot.server.engine.sampling_params import SamplingParams
    from kvpilot.server.llm import LLM

    out = tmp_path / "head"
    assert main(["train-eagle", str(out), "--prompts", "4", "--written-prompts", "2", "--max-tokens", "12", "--draft-vocab", "128",
                 "--epochs", "2", "--threads", "1"]) == 0
    provenance = json.loads((out / "TRAINING.json").read_text())
    assert provenance["prompts"] == 4 and provenance["written_prompts"] == 2
    assert provenance["command"].startswith("kvpilot train-eagle OUT --model smollm2-135m --prompts 4")
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] <= 128
    prompts = ["Tell me about the sea.", "Repeat this sentence exactly: the cat sat on the mat."]
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = [o.outputs[0].token_ids for o in LLM(num_threads=1, show_progress=False, kv_cache_memory="16MiB").generate(prompts, params)]
    llm = LLM(num_threads=1, show_progress=False, kv_cache_memory="16MiB", speculative_method="eagle3", speculative_model=str(out),
              speculative_disable_batch_size=0, speculative_min_acceptance=0.0)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    assert llm.engine.proposer.stats.num_draft_tokens > 0


def test_the_model_writes_distinct_requests_the_same_every_time(tmp_path, monkeypatch):
    """Magpie-style requests: the chat template's opening of a user turn, sampled with a seed per request;
    whole turns only (ended by the model), three words or more, no repeats; the same list on a fresh cache."""
    from kvpilot.kernels import cache
    from kvpilot.server.eagle_training import written_prompts
    from kvpilot.server.llm import LLM

    llm = LLM(num_threads=1, show_progress=False, kv_cache_memory="16MiB")
    monkeypatch.setattr(cache, "cache_root", lambda: tmp_path / "a")  # after the engine is up: its kernels' build lives there too
    first = written_prompts(llm, 4, seed=3, max_tokens=32)
    assert len(first) == 4 == len(set(first))
    assert all(len(p.split()) >= 3 and "<|im_" not in p and p == p.strip() for p in first), first
    assert len(list((tmp_path / "a" / "eagle-texts").glob("*.json"))) == 1
    monkeypatch.setattr(cache, "cache_root", lambda: tmp_path / "b")
    assert written_prompts(llm, 4, seed=3, max_tokens=32) == first


def test_the_head_learns_only_to_draft_inside_answers():
    """Training labels: row p predicts the model's choice after position p + 1; rows whose token to
    predict is in the prompt or is the answer's first (the target samples that one) do not count. The
    soft labels are the model's likeliest tokens there, as draft ids, renormalised over those the draft
    vocabulary has."""
    from kvpilot.server.eagle_training import SOFT_TOP, Example, _pad

    tokens = torch.arange(10)
    choice = torch.arange(1, 11)  # the model's choice after position i: token i + 1 here
    top_ids = torch.stack([torch.arange(i + 1, i + 1 + SOFT_TOP) for i in range(10)]).to(torch.int32)  # the choice, then the next ids
    top_p = torch.zeros(10, SOFT_TOP, dtype=torch.float16)
    top_p[:, :3] = torch.tensor([0.5, 0.25, 0.125], dtype=torch.float16)
    example = Example(tokens, torch.zeros(10, 6), choice, top_ids, top_p, answer_start=6)
    to_draft = torch.full((64,), -100, dtype=torch.long)
    to_draft[:10] = torch.arange(10) + 20  # ids 0-9 are draft ids 20-29; 10 and up are outside the draft vocabulary
    got_tokens, _, labels, (soft_ids, soft_p) = _pad([example], to_draft)
    assert got_tokens[0].tolist() == list(range(1, 10))
    # row p takes token p + 1 and predicts choice[p + 1] = token p + 2; the first counted predicts token 7 = answer_start + 1
    assert labels[0].tolist() == [-100] * 5 + [27, 28, 29, -100]
    assert soft_ids[0, 5, :3].tolist() == [27, 28, 29] and soft_p[0, 5, :3].tolist() == pytest.approx([4 / 7, 2 / 7, 1 / 7])
    assert soft_ids[0, 7, 0] == 29 and soft_p[0, 7].tolist() == pytest.approx([1.0] + [0.0] * (SOFT_TOP - 1))  # 10, 11 dropped
