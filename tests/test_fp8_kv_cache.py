"""The FP8 KV cache through the engine (kv_cache_dtype fp8; kernels: tests/test_fp8_kv_kernels.py):
capacity, per-layer scales (calibrated, deterministic, part of the KV identity, the checkpoint's own
when it has them), the C++, reference and Triton kernels agreeing, a prefix hit reading back what a
miss computes, a disk-tier hit, and the quality against a float32 cache on the oracle prompts."""

from __future__ import annotations

import math

import pytest
import torch

from kvpilot.kernels.ops import KERNELS_ENV
from kvpilot.kernels.paged_attention import FP8_KV


def _llm(**kwargs):
    from kvpilot.server import LLM

    return LLM(**{"quantization": "gguf", "num_threads": 1, "show_progress": False, "kv_cache_memory": "32MiB", **kwargs})


def _greedy(llm, prompts, tokens, logprobs=None):
    from kvpilot.server import SamplingParams

    return llm.generate(list(prompts), SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, logprobs=logprobs))


@pytest.mark.timeout(300)
def test_fp8_cache_holds_four_times_float32_and_stays_close_to_it(monkeypatch, row_invariant_gguf_kernels):
    """In the same kv_cache_memory an FP8 cache has ≥ 4x float32's blocks (2x bfloat16's, less the scratch
    block); its per-layer scales are calibrated, identical at every start, and part of the prefix
    cache's root key. Over the oracle prompts as one text, the next-token distributions are within a
    mean KL of 1e-2 of the float32 cache's (the issue's bound; measured 9.0e-3 here, 6.8e-3 over
    bench/kv_cache_dtype.py's text: e4m3 keeps 3 mantissa bits). The reference kernels give the C++ kernels' tokens; prefix
    caching, chunked prefill and preemption change nothing: a prompt whose prefix is cached, the same
    prompt prefilled 16 tokens a step, and prompts preempted for want of blocks give the tokens of the
    plain run (a prefill rounds its new K/V as the cache stores them, so every path reads the same values)."""
    from oracle import ORACLE_PROMPTS

    monkeypatch.setenv(KERNELS_ENV, "default")
    base = _llm(enable_prefix_caching=False)
    blocks = {"auto": base.engine.worker.num_blocks}
    text = base.engine.tokenizer.encode(" ".join(ORACLE_PROMPTS))
    float_logits = base.engine.worker.score(text)
    base.engine.close()
    bf16 = _llm(kv_cache_dtype="bfloat16")
    blocks["bfloat16"] = bf16.engine.worker.num_blocks
    bf16_salt = bf16.engine.block_manager.salt
    bf16.engine.close()

    fp8 = _llm(kv_cache_dtype="fp8")
    runner = fp8.engine.worker
    assert {t.dtype for pair in runner.kv_caches for t in pair} == {FP8_KV}
    blocks["fp8"] = runner.num_blocks
    assert blocks["fp8"] + 1 >= 4 * (blocks["auto"] + 1) and blocks["fp8"] + 1 >= 2 * (blocks["bfloat16"] + 1)
    scales = runner.kv_scales
    assert len(scales) == 30 and all(0 < s < 1 and math.isfinite(s) for pair in scales for s in pair)
    assert [layer.attn.kv_scales for layer in runner.model.layers] == scales
    assert all(math.log2(s).is_integer() for pair in scales for s in pair)  # powers of two: dividing by them is exact
    assert len({v for _, v in scales}) >= 3  # per layer (V's range grows with depth here), not one constant
    assert fp8.engine.block_manager.salt != bf16_salt

    p, q = torch.log_softmax(float_logits.double(), -1), torch.log_softmax(runner.score(text).double(), -1)
    kl = (p.exp() * (p - q)).sum(-1)
    print(f"mean KL(float32 || fp8) over {len(kl)} positions: {kl.mean():.2e}")
    assert len(kl) > 100 and kl.mean() < 1e-2, kl.mean()

    prompts = ORACLE_PROMPTS[:3]
    cpp = [o.outputs[0].token_ids for o in _greedy(fp8, prompts, 12)]
    long = ORACLE_PROMPTS[0] + " " + "and then the river ran on past the old mill " * 6 + "Tell me more."
    miss = _greedy(fp8, [long], 12, logprobs=1)[0]
    hit = _greedy(fp8, [long], 12, logprobs=1)[0]
    assert miss.num_cached_tokens == 0 and hit.num_cached_tokens >= 64
    assert hit.outputs[0].token_ids == miss.outputs[0].token_ids
    t = miss.outputs[0].token_ids
    assert max(abs(a[i] - b[i]) for a, b, i in zip(miss.outputs[0].logprobs, hit.outputs[0].logprobs, t)) < 1e-3
    fp8.engine.close()
    chunked = _llm(kv_cache_dtype="fp8", max_num_batched_tokens=16, enable_prefix_caching=False)
    assert _greedy(chunked, [long], 12)[0].outputs[0].token_ids == t
    chunked.engine.close()
    small = _llm(kv_cache_dtype="fp8", kv_cache_memory="1MiB", enable_prefix_caching=False)  # 4 blocks for three sequences of 2
    outs = _greedy(small, prompts, 12)
    assert sum(o.metrics.num_preemptions for o in outs) > 0 and [o.outputs[0].token_ids for o in outs] == cpp
    small.engine.close()

    monkeypatch.setenv(KERNELS_ENV, "reference")
    ref = _llm(kv_cache_dtype="fp8")
    assert ref.engine.worker.kv_scales == scales  # calibration is deterministic (and kernel-independent here)
    assert [o.outputs[0].token_ids for o in _greedy(ref, prompts, 12)] == cpp
    ref.engine.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kv", ["fp8", "bfloat16"])
def test_triton_kernels_on_a_narrower_cache_match_the_cpp_kernels(monkeypatch, family_checkpoints, kv):
    """The GPU path in the interpreter (a tiny 2-layer Qwen2): an FP8 cache, and a bfloat16 cache under
    float32 compute (CUDA takes it now: the kernels widen it before tl.dot), give the C++ kernels'
    greedy tokens; logprobs within 0.02 for FP8 (float32 noise, and the odd value rounded to the other
    side of an e4m3 step) and 0.05 for bfloat16 (the C++ path's prefill attends over its new tokens'
    K/V unrounded, the Triton kernel reads them back from the cache: measured 0.03 on this random model).
    A long prompt prefilled in 16-token chunks reads its earlier chunks from the cache."""
    from kvpilot.server import LLM, SamplingParams

    directory = family_checkpoints["qwen2"][0]
    prompts = ["The capital of France is", "One, two, three,", "The quick brown fox jumps over the lazy dog. " * 4]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    runs = {}
    for kernels in ("default", "triton"):
        monkeypatch.setenv(KERNELS_ENV, kernels)
        llm = LLM(model=str(directory), kv_cache_dtype=kv, show_progress=False, num_threads=1, kv_cache_memory="8MiB", max_num_batched_tokens=16)
        assert llm.engine.worker.kv_caches[0][0].dtype == (FP8_KV if kv == "fp8" else torch.bfloat16)
        assert {layer.attn.ops.name for layer in llm.engine.worker.model.layers} == {"triton" if kernels == "triton" else "cpu-c++"}
        runs[kernels] = llm.generate(prompts, params)
        llm.engine.close()
    for a, b in zip(runs["default"], runs["triton"]):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        t = a.outputs[0].token_ids
        assert max(abs(x[i] - y[i]) for x, y, i in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, t)) < (0.02 if kv == "fp8" else 0.05)


@pytest.mark.timeout(240)
def test_an_fp8_disk_tier_hit_equals_plain_fp8_decoding(tmp_path):
    """Blocks saved from an FP8 cache and read back (the engine's own cache evicted in between, and in a
    restarted engine) give the plain FP8 engine's tokens; an engine with other scales (a bfloat16 cache)
    shares nothing with them."""
    from test_kv_tiers import PROMPTS, greedy

    plain = _llm(quantization="none", kv_cache_dtype="fp8", enable_prefix_caching=False)
    reference = greedy(plain, PROMPTS)
    plain.engine.close()
    tiered = lambda: _llm(quantization="none", kv_cache_dtype="fp8", kv_cache_memory="4MiB", kv_offload_dir=str(tmp_path))
    llm = tiered()
    tier = llm.engine.kv_connector.disk
    assert [greedy(llm, [p])[0] for p in PROMPTS] == reference  # one by one: each evicts the ones before it
    tier.drain()
    assert tier.stats.saved_blocks >= 4 * 8
    assert greedy(llm, [PROMPTS[0]]) == reference[:1] and tier.stats.hit_blocks >= 8
    llm.engine.close()
    restarted = tiered()
    assert greedy(restarted, PROMPTS[1:3]) == reference[1:3] and restarted.engine.kv_connector.disk.stats.hit_blocks >= 16
    restarted.engine.close()
    other = _llm(quantization="none", kv_cache_dtype="bfloat16", kv_cache_memory="8MiB", kv_offload_dir=str(tmp_path))
    greedy(other, PROMPTS[:1])
    assert other.engine.kv_connector.disk.stats.hit_blocks == 0


@pytest.mark.timeout(120)
def test_a_checkpoints_own_kv_scales_are_used_and_bad_ones_refused(tmp_path, family_checkpoints):
    """A checkpoint with `self_attn.k_scale` / `v_scale` (llm-compressor's kv_cache_scheme): an FP8 cache
    takes them as they are (no calibration); without fp8 they are not reported as unused weights; an
    int kv_cache_scheme, scales for some layers only, or a non-positive scale are refused by name."""
    import json
    import shutil

    from quant_factory import compressed_config
    from safetensors.torch import save_file

    from kvpilot.server import LLM
    from kvpilot.server.model_config import ModelFormatError

    source = family_checkpoints["qwen2"][0]
    layers = json.loads((source / "config.json").read_text())["num_hidden_layers"]

    def with_scales(name, scales, scheme=None):
        path = tmp_path / name
        shutil.copytree(source, path)
        save_file({f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor([s[j]]) for i, s in enumerate(scales) for j, kind in enumerate("kv")},
                  str(path / "kv_scales.safetensors"))
        if scheme:  # (a compressed-tensors config whose weight scheme no module here uses)
            cfg = json.loads((path / "config.json").read_text())
            quantization = {**compressed_config({"format": "pack-quantized", "bits": 4, "group_size": 32}), "kv_cache_scheme": scheme}
            (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quantization}))
        return path

    def start(path, kv="fp8"):
        return LLM(model=str(path), kv_cache_dtype=kv, show_progress=False, num_threads=1, kv_cache_memory="4MiB")

    wanted = [(0.03125 * (i + 1), 0.0078125 * (i + 1)) for i in range(layers)]
    good = with_scales("good", wanted)
    llm = start(good)
    assert llm.engine.worker.kv_scales == wanted and [layer.attn.kv_scales for layer in llm.engine.worker.model.layers] == wanted
    assert llm.generate("One, two,")[0].outputs[0].token_ids
    llm.engine.close()
    start(good, kv="auto").engine.close()  # the scales are not "weights the model never read"

    fp8_scheme = with_scales("fp8-scheme", wanted, {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False})
    llm = start(fp8_scheme)
    assert llm.engine.worker.kv_scales == wanted
    llm.engine.close()
    for name, scales, scheme, message in (
            ("int8", wanted, {"type": "int", "num_bits": 8}, "kv_cache_scheme 'int' 8 bits is not run"),
            ("partial", wanted[:1], None, f"k_scale / v_scale for only 1 of {layers} layers"),
            ("zero", [(0.0, 1.0)] * layers, None, "not a positive finite number")):
        with pytest.raises(ModelFormatError, match=message):
            start(with_scales(name, scales, scheme))
