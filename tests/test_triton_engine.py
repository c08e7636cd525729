"""The engine with its Triton kernels forced (KVPILOT_KERNELS=triton) on CPU tensors, in Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1): what CI can check of the GPU path without a
GPU. The kernels one by one: tests/test_triton_gguf.py, tests/test_triton_attention.py."""

import pytest
import torch

from kvpilot.kernels.ops import KERNELS_ENV, ops_for


def test_forcing_triton_swaps_the_dispatch_table(monkeypatch):
    from kvpilot.kernels import triton_attention, triton_layers

    monkeypatch.setenv(KERNELS_ENV, "triton")
    ops = ops_for(torch.device("cpu"))
    assert ops.name == "triton" and ops.paged_attention is triton_attention.paged_attention
    assert ops.rms_norm is triton_layers.rms_norm and ops.rotary_qkv_ is triton_layers.rotary_qkv_
    monkeypatch.setenv(KERNELS_ENV, "default")
    assert ops_for(torch.device("cpu")).name == "cpu-c++"


@pytest.mark.timeout(300)
def test_engine_with_the_triton_kernels_forced_matches_the_cpp_kernels(monkeypatch, family_checkpoints):
    """End to end through the engine (a tiny 2-layer Qwen2 checkpoint, int4-quantized at load: Q4_1
    projections, the tied embedding/head int8 = Q8_0): attention (prefill and decode) and every projection and the
    head, RMSNorm and RoPE with the cache store on the Triton kernels, in the interpreter, give the C++ kernels' greedy tokens and
    logprobs within float32 summation-order noise."""
    from kvpilot.kernels.triton_gguf import TritonGGUFLinear
    from kvpilot.server import LLM, SamplingParams

    directory = family_checkpoints["qwen2"][0]  # q/k/v biases and a tied head: every form of projection
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    runs = {}
    for kernels in ("default", "triton"):
        monkeypatch.setenv(KERNELS_ENV, kernels)
        llm = LLM(model=str(directory), quantization="int4", show_progress=False, num_threads=1, kv_cache_memory="8MiB")
        model = llm.engine.runner.model
        triton_layers = sum(isinstance(m, TritonGGUFLinear) for m in model.modules())
        assert (triton_layers > 0) == (kernels == "triton")
        assert {layer.attn.ops.name for layer in model.layers} == {"triton" if kernels == "triton" else "cpu-c++"}
        out = llm.generate("The capital of France is", params)[0].outputs[0]
        runs[kernels] = (out.token_ids, [max(step.values()) for step in out.logprobs])
        del llm
    assert runs["triton"][0] == runs["default"][0]
    torch.testing.assert_close(torch.tensor(runs["triton"][1]), torch.tensor(runs["default"][1]), atol=1e-4, rtol=1e-4)
