"""HF checkpoints of the Llama, Mistral, Qwen2, Qwen3 and Gemma 3 families (tiny random models written by
transformers itself): kvpilot's greedy ids and prompt logprobs equal HF transformers' on the same
checkpoint (vLLM's N-1 exact + top-5 rule; logprobs within 2e-4), one prompt at a time and batched;
a GGUF of the same weights loads to the same outputs; the tokenizer files give HF's chat template."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from checkpoint_factory import CASES
from oracle import ORACLE_PROMPTS, HFOracle, compare_greedy

PROMPTS = ORACLE_PROMPTS[:5]
STEPS = 16
LOGPROB_BOUND = 2e-4  # fp32 both sides; only the summation order differs
# bfloat16 both sides: each side rounds its activations to 8 significant bits at different points (kvpilot
# after each fused projection, transformers after every op), ~0.4 % per rounding
BF16_LOGPROB_BOUND = 0.15


class CheckpointOracle(HFOracle):
    """HF transformers on a checkpoint directory (not cached: a tiny model runs in a second)."""

    def __init__(self, directory: Path, dtype: str = "float32"):
        super().__init__(directory)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(directory))
        self._model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype).eval()

    def run(self, prompts=PROMPTS, steps=STEPS):
        return [self._greedy(p, steps) for p in prompts]


def llm(model: Path, **kw):
    from kvpilot.server import LLM

    return LLM(model=str(model), num_threads=1, show_progress=False, kv_cache_memory="32MiB", **kw)


def greedy(engine, batched: bool):
    from kvpilot.server import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=5)
    outs = engine.generate(PROMPTS, params) if batched else [engine.generate(p, params)[0] for p in PROMPTS]
    tokens = [o.outputs[0].token_ids for o in outs]
    topk = [[sorted(e, key=e.get, reverse=True)[:5] for e in o.outputs[0].logprobs] for o in outs]
    return outs, tokens, topk


def prompt_logprobs(engine, prompt_ids: list[list[int]]) -> list[list[float]]:
    from kvpilot.server import SamplingParams

    outs = engine.generate(prompt_ids, SamplingParams(max_tokens=1, prompt_logprobs=0))
    return [[entry[t] for entry, t in zip(o.prompt_logprobs[1:], ids[1:])] for o, ids in zip(outs, prompt_ids)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(CASES))
def test_checkpoint_matches_transformers(family_checkpoints, family):
    directory, _ = family_checkpoints[family]
    oracle = CheckpointOracle(directory).run()
    assert len({tuple(r.tokens) for r in oracle}) == len(oracle) and all(len(set(r.tokens)) > 3 for r in oracle)  # not a degenerate model
    engine = llm(directory)
    assert engine.engine.model_config.family.architecture == CASES[family].architecture
    # the windowed families' layers through their pool (block_manager.WindowPool): Gemma 3's beside global ones, Mistral's all
    assert (engine.engine.block_manager.window is not None) == (family in ("mistral", "gemma3"))
    if CASES[family].dtype != "float32":  # stored in bf16, computed in fp32 (as HF's oracle does)
        from safetensors import safe_open

        with safe_open(str(next(directory.glob("*.safetensors"))), framework="pt") as f:
            assert str(f.get_tensor(next(iter(f.keys()))).dtype) == f"torch.{CASES[family].dtype}"
    holds_to_oracle(engine, oracle, family, LOGPROB_BOUND, all_but_one_exact=True)


def holds_to_oracle(engine, oracle, label: str, logprob_bound: float, all_but_one_exact: bool) -> None:
    """vLLM's greedy rule one prompt at a time and batched (where the two part, each side's token in the other's
    top 5), all but one prompt's ids equal if asked, and every prompt logprob within the bound."""
    for batched in (False, True):
        outs, tokens, topk = greedy(engine, batched)
        assert [o.prompt_token_ids for o in outs] == [r.prompt_ids for r in oracle]
        result = compare_greedy(tokens, topk, oracle)
        print(f"{label} ({'batched' if batched else 'one at a time'}): {result}")
        assert not result["violations"], result
        assert not all_but_one_exact or result["exact"] >= result["total"] - 1, result
    ours = prompt_logprobs(engine, [r.prompt_ids for r in oracle])
    worst = max(abs(a - b) for mine, r in zip(ours, oracle) for a, b in zip(mine, r.prompt_logprobs))
    print(f"{label}: max |prompt logprob - HF| = {worst:.2e}")
    assert worst < logprob_bound


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama3", "qwen2", "mistral", "gemma3"])
def test_bfloat16_compute_matches_transformers_in_bfloat16(family_checkpoints, family):
    """--dtype bfloat16 on CPU (the projections on kvpilot's AVX512-BF16 kernel where the CPU has it, else oneDNN's
    or torch's; q/k/v biases, sliding windows and Gemma's norms included) against transformers computing in
    bfloat16 on the same checkpoint: vLLM's own rule for bfloat16 (where the greedy ids part, each side's token in
    the other's top 5) and every prompt logprob within bfloat16's rounding. Not "all but one prompt equal", as in
    float32: the rounding points differ by CPU (a fused residual add, the GEMM's blocking by row count), and these
    random tiny models' top tokens sit so close that transformers' own bfloat16 run keeps its float32 run's 16 ids
    on only about two of the five prompts."""
    import torch

    from kvpilot.kernels.linear import Linear, default_layout

    directory, _ = family_checkpoints[family]
    oracle = CheckpointOracle(directory, dtype="bfloat16").run()
    engine = llm(directory, dtype="bfloat16")
    layouts = {m.layout for m in engine.engine.worker.model.modules() if isinstance(m, Linear)}
    assert layouts == {default_layout(torch.zeros(1, 2, dtype=torch.bfloat16))}
    holds_to_oracle(engine, oracle, f"{family} bfloat16", BF16_LOGPROB_BOUND, all_but_one_exact=False)


@pytest.mark.timeout(120)
def test_gemma_norms_in_bfloat16_round_as_transformers_does(family_checkpoints):
    """Gemma's RMSNorms in bfloat16 (each layer's four, the per-head q/k norms, the final one) give transformers'
    Gemma3RMSNorm rows: the normalised row times 1 + w in float32, rounded once. (Rounding 1 + w to bfloat16, as
    kvpilot did, drops every |w| under 2^-8 and left about a third of each norm's outputs one bfloat16 step off,
    which compounds over the layers: its prompt logprobs were 0.12 off transformers' on this model, 0 now.)"""
    import torch
    from transformers import AutoModelForCausalLM

    directory, _ = family_checkpoints["gemma3"]
    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype="bfloat16").eval()
    model = llm(directory, dtype="bfloat16").engine.worker.model
    x = (torch.randn(9, hf.config.hidden_size, generator=torch.Generator().manual_seed(0)) * 3).bfloat16()
    heads = x.view(9, -1, hf.config.head_dim)[:, :1]  # one head's rows for the per-head norms
    ours_theirs = [(model.norm, hf.model.norm, x)]
    for mine, theirs in zip(model.layers, hf.model.layers):
        ours_theirs += [(mine.attn_norm, theirs.input_layernorm, x), (mine.post_attn_norm, theirs.post_attention_layernorm, x),
                        (mine.mlp_norm, theirs.pre_feedforward_layernorm, x), (mine.post_mlp_norm, theirs.post_feedforward_layernorm, x),
                        (mine.attn.q_norm, theirs.self_attn.q_norm, heads), (mine.attn.k_norm, theirs.self_attn.k_norm, heads)]
    with torch.no_grad():
        for mine, theirs, rows in ours_theirs:
            got, want = mine(rows), theirs(rows)
            assert got.dtype == torch.bfloat16 and (got == want).float().mean() > 0.99
            torch.testing.assert_close(got, want, atol=0, rtol=2 ** -7)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(CASES))
def test_gguf_of_the_same_weights_gives_the_same_outputs(family_checkpoints, family):
    directory, gguf_path = family_checkpoints[family]
    from_checkpoint, from_gguf = llm(directory), llm(gguf_path)
    assert from_gguf.engine.model_config.family.gguf_architecture == from_checkpoint.engine.model_config.family.gguf_architecture
    assert from_gguf.engine.model_config.rope_scaling is not None or CASES[family].config.get("rope_scaling") is None
    _, tokens_ckpt, _ = greedy(from_checkpoint, batched=True)
    _, tokens_gguf, _ = greedy(from_gguf, batched=True)
    assert tokens_gguf == tokens_ckpt
    ids = [from_gguf.engine.tokenizer.encode(p) for p in PROMPTS]
    for a, b in zip(prompt_logprobs(from_checkpoint, ids), prompt_logprobs(from_gguf, ids)):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5


def test_chat_template_and_stop_ids_from_the_tokenizer_files(family_checkpoints, tmp_path):
    from transformers import AutoTokenizer

    from kvpilot.server.tokenizer import Tokenizer

    directory, _ = family_checkpoints["llama3"]
    conversations = [[{"role": "user", "content": "Hi there"}],
                     [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                      {"role": "user", "content": "And 3+3?"}]]
    # chat_template.jinja (transformers 5), then the same template inside tokenizer_config.json (older checkpoints)
    moved = tmp_path / "moved"
    shutil.copytree(directory, moved)
    template = (moved / "chat_template.jinja").read_text()
    (moved / "chat_template.jinja").unlink()
    tk_config = json.loads((moved / "tokenizer_config.json").read_text())
    (moved / "tokenizer_config.json").write_text(json.dumps({**tk_config, "chat_template": template}))
    for d in (directory, moved):
        ours, hf = Tokenizer.from_checkpoint(d), AutoTokenizer.from_pretrained(str(d))
        for messages in conversations:
            for gen in (True, False):
                assert ours.apply_chat_template(messages, add_generation_prompt=gen) == hf.apply_chat_template(
                    messages, add_generation_prompt=gen, tokenize=False)
        assert ours.encode("Hello, world! 12345") == hf("Hello, world! 12345").input_ids
    # generation_config.json's eos list (Llama 3 stops on several ids), after the tokenizer's own EOS
    assert Tokenizer.from_checkpoint(directory).eos_token_ids == (2, 0)
    assert Tokenizer.from_checkpoint(family_checkpoints["qwen3"][0]).eos_token_ids == (2,)


def test_generation_stops_at_any_eos_id(family_checkpoints, tmp_path):
    """Every EOS id of generation_config.json ends a request (finish_reason stop), not only the first."""
    from kvpilot.server import SamplingParams

    directory, _ = family_checkpoints["llama3"]
    free = llm(directory).generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))[0].outputs[0].token_ids
    stops = tmp_path / "stops"
    shutil.copytree(directory, stops)
    (stops / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, free[2]]}))  # the model's own third token
    out = llm(stops).generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=STEPS))[0].outputs[0]
    assert free[2] not in free[:2] and out.token_ids == free[:3] and out.finish_reason == "stop"


def test_sliding_window_models_serve_past_their_window(family_checkpoints):
    """Mistral's and Gemma 3's windows are attention masks now, not context limits: the context is the model's,
    and the prompts the family tests compare with transformers run past the window (their equality with it is
    what test_checkpoint_matches_transformers checks)."""
    from checkpoint_factory import SMALL_WINDOW
    from kvpilot.server.checkpoint import Checkpoint
    from kvpilot.server.gguf_loader import GGUFFile

    for family in ("mistral", "gemma3"):
        directory, gguf_path = family_checkpoints[family]
        for config in (Checkpoint(directory).config, GGUFFile(gguf_path).config):  # each file's windows, read as the engine reads them
            assert config.sliding_window == SMALL_WINDOW
            assert [config.window(i) for i in range(config.num_layers)] == \
                ([SMALL_WINDOW] * 2 if family == "mistral" else [SMALL_WINDOW] * 5 + [0])
    # Mistral's every layer windowed: the window pool holds the whole cache, the block table is bookkeeping over no memory;
    # a decoding sequence holds at most window / block size + 1 blocks, and the context is still the model's
    engine = llm(family_checkpoints["mistral"][1], max_model_len=200)
    worker, bm = engine.engine.worker, engine.engine.block_manager
    assert engine.engine.max_model_len == 200 and worker.bookkeeping_table and bm.window is not None
    assert {k.shape[0] for k, _ in worker.kv_caches} == {worker.num_window_blocks + 1}
    held, allocate = [], bm.allocate

    def spy(seq, num_new_tokens, *rest):
        done = allocate(seq, num_new_tokens, *rest)
        if done and num_new_tokens == 1:
            held.append(bm.window.held(seq))
        return done

    bm.allocate = spy
    _, tokens, _ = greedy(engine, batched=True)
    assert held and max(held) <= -(-SMALL_WINDOW // 16) + 1, held
    lengths = [len(engine.engine.tokenizer.encode(p)) for p in PROMPTS]
    assert sum(n > SMALL_WINDOW for n in lengths) >= 2 and all(n + STEPS > SMALL_WINDOW for n in lengths), lengths
    # Gemma 3's local layers beside its global one: a pool of their own (block_manager.WindowPool), the same outputs with the
    # step after scheduled while one runs (async scheduling: the window tables change under a step in flight)
    plain = llm(directory)
    assert plain.engine.worker.num_window_blocks > 0 and plain.engine.block_manager.window is not None
    _, tokens, _ = greedy(plain, batched=True)
    ahead = llm(directory, async_scheduling="on")
    assert ahead.engine.async_scheduling and greedy(ahead, batched=True)[1] == tokens


def test_unsupported_or_incomplete_checkpoints_are_clear_errors(family_checkpoints, tmp_path):
    import torch
    from safetensors.torch import save_file

    from kvpilot.server.model_config import ModelFormatError

    directory, _ = family_checkpoints["qwen3"]

    def variant(name: str, edit) -> Path:
        d = tmp_path / name
        shutil.copytree(directory, d)
        edit(d)
        return d

    def set_config(**changes):
        def edit(d):
            cfg = json.loads((d / "config.json").read_text())
            (d / "config.json").write_text(json.dumps({**cfg, **changes}))
        return edit

    cases = [
        (set_config(architectures=["GPT2LMHeadModel"]), "architecture 'GPT2LMHeadModel' is not supported.*LlamaForCausalLM, MistralForCausalLM, "
                                                        "Qwen2ForCausalLM, Qwen3ForCausalLM"),
        (set_config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}), "RoPE scaling 'yarn' is not supported"),
        (set_config(quantization_config={"quant_method": "bitsandbytes"}), "pre-quantized checkpoints .quant_method 'bitsandbytes'"),
        (lambda d: save_file({"model.layers.0.self_attn.o_proj.bias": torch.zeros(128)}, str(d / "extra.safetensors")),
         "weights the model does not use.*o_proj.bias"),
        (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer.json"),
        (lambda d: [f.unlink() for f in d.glob("*.safetensors")], r"no \*.safetensors"),
    ]
    for i, (edit, message) in enumerate(cases):
        with pytest.raises(ModelFormatError, match=message):
            llm(variant(f"v{i}", edit))


# A config.json's attention that the checks below vary one field of (4 heads of 16 over a hidden size of 64).
HEADS_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 256}


@pytest.mark.parametrize("changes,message", [
    # each divided by zero (ZeroDivisionError at start) or built attention that cannot split its rows into heads
    ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads=0 (a count of heads is a positive integer)"),
    ({"num_attention_heads": 0}, "num_attention_heads=0 (a count of heads is a positive integer)"),
    ({"num_attention_heads": -4}, "num_attention_heads=-4 (a count of heads is a positive integer)"),
    ({"num_attention_heads": 4.0}, "num_attention_heads=4.0 (a count of heads is a positive integer)"),
    ({"num_key_value_heads": 0}, "num_key_value_heads=0 (a count of heads is a positive integer)"),
    ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"head_dim": 0}, "head_dim=0 (a head's size is a positive integer)"),
    ({"num_attention_heads": 3, "num_key_value_heads": None, "head_dim": None},
     "hidden_size 64 is not a multiple of num_attention_heads=3 (and no head_dim is given)"),
])
def test_attention_heads_that_do_not_fit_are_refused_by_name(tmp_path, capsys, changes, message):
    """As an EAGLE-3 head's are (tests/test_eagle.py): a ModelFormatError naming the field, which `kvpilot
    generate` / `serve` turn into `kvpilot: error: ...` and exit 2."""
    from kvpilot.server.cli import main
    from kvpilot.server.model_config import ModelFormatError, config_from_hf

    with pytest.raises(ModelFormatError, match=re.escape(f"config.json: {message}")):
        config_from_hf({**HEADS_CONFIG, **changes}, "m", "config.json")
    (tmp_path / "config.json").write_text(json.dumps({**HEADS_CONFIG, **changes}))
    assert main(["generate", "Hello", "--model", str(tmp_path), "--num-threads", "1", "--kv-cache-memory", "16MiB"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"kvpilot: error: {tmp_path / 'config.json'}: {message}"


def test_absent_head_counts_default():
    """num_key_value_heads and head_dim absent (or null): as many K/V heads as query heads, hidden_size / heads wide."""
    from kvpilot.server.model_config import config_from_hf

    config = config_from_hf({**HEADS_CONFIG, "num_key_value_heads": None, "head_dim": None}, "m", "config.json")
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 4, 16)
    config = config_from_hf({k: v for k, v in HEADS_CONFIG.items() if k not in ("num_key_value_heads", "head_dim")}, "m", "config.json")
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 4, 16)


def test_draft_checkpoint_for_speculative_decoding(family_checkpoints):
    """A checkpoint directory serves as the draft model too (here: the GGUF of the same weights as
    target, the checkpoint as draft): greedy output is unchanged and the draft's tokens are accepted."""
    from kvpilot.server import SamplingParams

    directory, gguf_path = family_checkpoints["qwen3"]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm(gguf_path).generate(PROMPTS, params)]
    spec = llm(gguf_path, speculative_method="draft", speculative_model=str(directory), num_speculative_tokens=3,
               speculative_disable_batch_size=0)
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params)] == plain
    stats = spec.engine.proposer.stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens  # the same model proposes what it verifies


def test_serve_a_checkpoint_directory(family_checkpoints):
    """`kvpilot serve --model DIR`: served under the directory's name, chat through its template."""
    import httpx

    from server_harness import ServerProcess

    directory, _ = family_checkpoints["qwen2"]
    server = ServerProcess("--model", str(directory), "--kv-cache-memory", "32MiB").wait_ready()
    try:
        models = httpx.get(server.url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["qwen2"]
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": "qwen2", "messages": [{"role": "user", "content": "Hi"}],
                                                                  "max_tokens": 5, "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
    finally:
        assert server.terminate() == 0
