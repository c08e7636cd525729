"""The engine with its Triton kernels forced (KVPILOT_KERNELS=triton) on CPU tensors, in Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1): what CI can check of the GPU path without a
GPU. The kernels one by one: tests/test_triton_gguf.py, tests/test_triton_attention.py."""

import pytest
import torch

from kvpilot.kernels.ops import KERNELS_ENV, ops_for


def test_cuda_runs_every_op_on_its_triton_kernel_and_forcing_swaps_the_table(monkeypatch):
    """So that the Triton kernels cannot exist unused: they are what CUDA gets by default."""
    from kvpilot.kernels import triton_attention, triton_layers
    from kvpilot.kernels.linear import gguf_linear_class
    from kvpilot.kernels.ops import REFERENCE
    from kvpilot.kernels.triton_gguf import TritonGGUFLinear

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for forced, device in (("default", cuda), ("triton", cpu)):
        monkeypatch.setenv(KERNELS_ENV, forced)
        ops = ops_for(device)
        assert ops.name == "triton" and ops.graph_safe and ops.paged_attention is triton_attention.paged_attention
        assert ops.rms_norm is triton_layers.rms_norm and ops.rotary_qkv_ is triton_layers.rotary_qkv_
        assert gguf_linear_class(device) is TritonGGUFLinear
    monkeypatch.setenv(KERNELS_ENV, "default")
    assert ops_for(cpu).name == "cpu-c++" and not ops_for(cpu).graph_safe
    monkeypatch.setenv(KERNELS_ENV, "reference")
    assert ops_for(cuda) is REFERENCE and ops_for(cpu) is REFERENCE and not REFERENCE.graph_safe
    monkeypatch.setenv(KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match="KVPILOT_KERNELS must be one of default, triton, reference, not 'cuda'"):
        ops_for(cpu)


@pytest.mark.timeout(300)
def test_engine_with_the_triton_kernels_forced_matches_the_cpp_kernels(monkeypatch, family_checkpoints):
    """End to end through the engine (a tiny 2-layer Qwen2 checkpoint, int4-quantized at load: Q4_1
    projections, the tied embedding/head int8 = Q8_0): attention (prefill and decode) and every projection and the
    head, RMSNorm and RoPE with the cache store on the Triton kernels, in the interpreter, give the C++ kernels' greedy tokens and
    logprobs within float32 summation-order noise. The Triton runs' decode steps go through the CUDA
    graphs' static buffers (not captured: no GPU), a padding row included, as they would on CUDA; a long
    prompt is prefilled in 16-token chunks (the prefill kernel after a cached prefix). A
    third run computes in float16, as quantized weights run on CUDA (half activations into the GGUF-block
    kernels, a half KV cache): logprobs within half precision up to where its greedy path leaves the
    float32 one, which only a near-tie may cause (the random model's top two within 0.05)."""
    from kvpilot.kernels.triton_gguf import TritonGGUFLinear
    from kvpilot.server import LLM, SamplingParams

    directory = family_checkpoints["qwen2"][0]  # q/k/v biases and a tied head: every form of projection
    # 256-column tiles: the interpreter's cost is per program (the head's 49,152 columns are 192 of
    # them, not 768); projections narrower than a tile run masked. The default tile: test_triton_gguf.py.
    monkeypatch.setattr(TritonGGUFLinear, "block_n", 256)
    # 16-token steps: the long prompt is prefilled in chunks, each after the cached part before it.
    prompts = ["The capital of France is", "One, two, three,", "def main():", "The quick brown fox jumps over the lazy dog. " * 4]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2) for n in (4, 4, 2, 2)]
    runs = {}
    for kernels, dtype in (("default", "float32"), ("triton", "float32"), ("triton", "float16")):
        monkeypatch.setenv(KERNELS_ENV, kernels)
        llm = LLM(model=str(directory), quantization="int4", dtype=dtype, show_progress=False, num_threads=1, kv_cache_memory="8MiB",
                  max_num_batched_tokens=16)
        model = llm.engine.worker.model
        triton_layers = sum(isinstance(m, TritonGGUFLinear) for m in model.modules())
        assert (triton_layers > 0) == (kernels == "triton")
        assert {layer.attn.ops.name for layer in model.layers} == {"triton" if kernels == "triton" else "cpu-c++"}
        assert llm.engine.worker.kv_caches[0][0].dtype == getattr(torch, dtype)
        if kernels == "triton":
            llm.engine.worker.start_decode_graphs(llm.engine.max_model_len, capture=False)
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        runs[kernels, dtype] = [(o.token_ids, o.logprobs) for o in outs]
        del llm
    default, triton32, triton16 = runs.values()
    top = lambda run: torch.tensor([max(step.values()) for _, steps in run for step in steps])  # noqa: E731
    assert [t for t, _ in triton32] == [t for t, _ in default]
    torch.testing.assert_close(top(triton32), top(default), atol=1e-4, rtol=1e-4)
    for (tokens16, steps16), (tokens, steps) in zip(triton16, default):
        same = next((i for i, (a, b) in enumerate(zip(tokens16, tokens)) if a != b), len(tokens))
        torch.testing.assert_close(torch.tensor([steps16[i][t] for i, t in enumerate(tokens16[:same])]),
                                   torch.tensor([steps[i][t] for i, t in enumerate(tokens[:same])]), atol=3e-2, rtol=3e-2)
        if same < len(tokens):  # the half-precision path took the float32 path's runner-up at a near-tie
            assert tokens16[same] in steps[same] and steps[same][tokens[same]] - steps[same][tokens16[same]] < 0.05


def test_a_block_size_the_triton_kernels_cannot_take_is_refused_at_load(monkeypatch):
    """On CUDA (or forced) block size 8 fails at load with the fix in the message, not at a request's first step."""
    from kvpilot.server import LLM

    monkeypatch.setenv(KERNELS_ENV, "triton")
    with pytest.raises(ValueError, match=r"power-of-two head_dim and block size of at least 16, not 64 and 8 \(use --block-size 16 or 32\)"):
        LLM(block_size=8, show_progress=False, num_threads=1, kv_cache_memory="16MiB")
