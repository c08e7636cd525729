"""Mixtures of experts (kernels/fused_moe.py, server/layers/moe.py): the router's top-k and renormalisation as
transformers does them, the fused-experts op against a token-by-token loop for skewed routings, and the tiny
Qwen3-MoE and Mixtral checkpoints (tests/checkpoint_factory.py) in prefill chunks and with prefix hits, greedy equal to
transformers (one at a time, batched, GGUF and tensor parallelism: test_model_families.py, test_tensor_parallel_families.py)."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels.fused_moe import fused_experts_ref, route


def per_token(x, w13, w2, weights, ids, act="silu"):
    """Each token through its experts one by one: the definition the op must equal."""
    out = torch.zeros_like(x, dtype=torch.float64)
    inner = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            gate, up = h[:inner], h[inner:]
            gated = (torch.nn.functional.gelu(gate, approximate="tanh") if act == "gelu_tanh" else torch.nn.functional.silu(gate)) * up
            out[t] += float(weights[t, j]) * (w2[e].double() @ gated)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("routing", ["random", "all_to_one", "one_unused"])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_fused_experts_equals_each_token_through_its_experts(routing, act):
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, inner, experts, k = 13, 48, 24, 6, 2
    x = torch.randn(tokens, hidden, generator=gen)
    w13, w2 = torch.randn(experts, 2 * inner, hidden, generator=gen) / 7, torch.randn(experts, hidden, inner, generator=gen) / 5
    weights, ids = route(torch.randn(tokens, experts, generator=gen), k, renormalize=True)
    if routing == "all_to_one":  # every token's both slots on expert 3 (its weights read once, for 26 rows)
        ids = torch.full_like(ids, 3)
    elif routing == "one_unused":  # no token for expert 0
        ids = torch.where(ids == 0, torch.ones_like(ids), ids)
    got = fused_experts_ref(x, w13, w2, weights, ids, act)
    assert got.dtype == torch.float32 and torch.allclose(got.double(), per_token(x, w13, w2, weights, ids, act), atol=1e-4)


def test_route_takes_the_top_k_of_the_float32_softmax_renormalised_where_the_model_does():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0]], dtype=torch.bfloat16)
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits.float(), -1)
    assert weights.dtype == torch.float32 and ids.tolist() == [[0, 1], [2, 3]]
    assert torch.equal(weights, torch.stack([probs[0, [0, 1]], probs[1, [2, 3]]]))
    renormalised, same = route(logits, 2, renormalize=True)
    assert torch.equal(same, ids) and torch.allclose(renormalised.sum(-1), torch.ones(2)) and torch.allclose(renormalised, weights / weights.sum(-1, keepdim=True))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["qwen3moe", "mixtral"])
def test_moe_checkpoints_in_prefill_chunks_and_with_prefix_hits_equal_transformers(family_checkpoints, family):
    """16-token prefill chunks (a step's tokens routed apart from the next step's), then the same prompts again from the
    prefix cache: greedy ids equal transformers' by the family tests' rule."""
    from test_model_families import CheckpointOracle, greedy, llm

    from oracle import compare_greedy

    directory, _ = family_checkpoints[family]
    oracle = CheckpointOracle(directory).run()
    engine = llm(directory, max_num_batched_tokens=16)
    assert engine.engine.model_config.num_experts == 8 and engine.engine.model_config.is_moe(0)
    for run in ("chunked", "prefix hits"):
        hits = engine.engine.block_manager.prefix_hits
        _, tokens, topk = greedy(engine, batched=True)
        result = compare_greedy(tokens, topk, oracle)
        assert result["exact"] >= result["total"] - 1 and not result["violations"], (run, result)
    full_blocks = sum((len(r.prompt_ids) - 1) // 16 * 16 for r in oracle)  # every prompt's full blocks but its last token's
    assert full_blocks >= 32 and engine.engine.block_manager.prefix_hits - hits == full_blocks


def isas() -> list[str]:
    from kvpilot.kernels import cpu_extension

    here = cpu_extension.require().gguf_linear_isa()
    every = ["amx", "avx512-vnni", "avx512", "avx2", "scalar"]
    return every[every.index(here):]


ROUTINGS = ["random", "all_to_one", "one_unused"]


def routed(routing: str, tokens: int, experts: int, k: int, gen):
    weights, ids = route(torch.randn(tokens, experts, generator=gen), k, renormalize=True)
    if routing == "all_to_one":
        ids = torch.full_like(ids, experts - 1)
    elif routing == "one_unused":
        ids = torch.where(ids == 0, torch.ones_like(ids), ids)
    return weights, ids


@pytest.mark.timeout(120)
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("kernel,dtype", [("c++", torch.float32), ("c++", torch.bfloat16), ("triton", torch.float32), ("triton", torch.float16)])
def test_fused_experts_kernels_on_dense_weights_equal_each_token_through_its_experts(kernel, dtype, routing):
    """The C++ op (kernels/csrc/moe_cpu.cpp) on float32 and bfloat16 experts, and the Triton kernel (kernels/triton_moe.py:
    blocks of one expert's rows, padded) under TRITON_INTERPRET=1 on float32 and float16 ones: an expert with no token,
    every token on one expert (more rows than a block); SiLU and GeGLU; within the half types' rounding."""
    from functools import partial

    from kvpilot.kernels import cpu_extension
    from kvpilot.kernels.fused_moe import Experts, fused_experts_cpu
    from kvpilot.kernels.triton_moe import fused_experts

    op = partial(fused_experts_cpu, cpu_extension.require()) if kernel == "c++" else fused_experts
    gen = torch.Generator().manual_seed(1)
    tokens, hidden, inner, experts, k = 19, 64, 32, 8, 2
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inner, hidden, generator=gen) / 8).to(dtype)
    w2 = (torch.randn(experts, hidden, inner, generator=gen) / 6).to(dtype)
    weights, ids = routed(routing, tokens, experts, k, gen)
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 2e-2}[dtype]
    for act in ("silu", "gelu_tanh"):
        got = op(x, Experts(inner, w13, w2), weights, ids, act)
        want = per_token(x.float(), w13.float(), w2.float(), weights, ids, act)
        assert got.dtype == dtype and torch.allclose(got.double(), want, atol=tolerance, rtol=tolerance), (act, (got.double() - want).abs().max())


def quantized_experts(kind: str, experts: int, hidden: int, inner: int, seed: int):
    """(gate, up, down: each expert's GGUFWeight, inner) of random weights in GGUF-style blocks: int8 as Q8_0, int4 as Q4_1,
    a Q4_K file's (whose 256-column super-blocks make the inner size 256)."""
    import numpy as np

    from gguf_factory import encode_k_quant
    from kvpilot.kernels.quantized import GGUFWeight, quantize_int4, quantize_int8

    rng = np.random.default_rng(seed)
    inner = 256 if kind == "Q4_K" else inner

    def blocks(out: int, cols: int) -> GGUFWeight:
        w = rng.standard_normal((out, cols)).astype(np.float32) / 8
        if kind == "Q8_0":
            return quantize_int8(torch.from_numpy(w))
        if kind == "Q4_1":
            return quantize_int4(torch.from_numpy(w), 32)
        raw = torch.from_numpy(np.ascontiguousarray(encode_k_quant("Q4_K", w)))
        return GGUFWeight.from_blocks("Q4_K", raw.view(torch.uint8), out)

    gate, up = ([blocks(inner, hidden) for _ in range(experts)] for _ in range(2))
    return gate, up, [blocks(hidden, inner) for _ in range(experts)], inner


@pytest.mark.timeout(120)
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q4_K"])
def test_cpp_fused_experts_on_block_panels_equal_the_reference_on_every_isa(routing, kind, monkeypatch):
    """Experts in GGUF-style blocks (int8 as Q8_0, int4 as Q4_1, a Q4_K file's): the C++ op on each instruction set the CPU
    has equals the reference on the same blocks dequantized (within the VNNI path's 16-bit activations)."""
    from kvpilot.kernels import cpu_extension
    from kvpilot.kernels.fused_moe import ExpertPanels, Experts, fused_experts_cpu, fused_experts_reference

    ext, gen = cpu_extension.require(), torch.Generator().manual_seed(2)
    tokens, hidden, experts, k = 17, 256, 6, 2
    gate, up, down, inner = quantized_experts(kind, experts, hidden, 64, seed=3)
    panels = Experts(inner, panels=(ExpertPanels.of(gate), ExpertPanels.of(up), ExpertPanels.of(down)))
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = routed(routing, tokens, experts, k, gen)
    want = fused_experts_reference(x, panels, weights, ids).double()
    for isa in isas():
        monkeypatch.setenv("KVPILOT_GGUF_ISA", isa)
        got = fused_experts_cpu(ext, x, panels, weights, ids).double()
        assert torch.allclose(got, want, atol=2e-3 * want.abs().max().item(), rtol=2e-3), (isa, (got - want).abs().max())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,routing", [("Q8_0", "all_to_one"), ("Q4_1", "random"), ("Q4_K", "random")])
def test_triton_fused_experts_on_gguf_blocks_equal_the_reference(kind, routing):
    """The Triton kernel (TRITON_INTERPRET=1) on experts kept in their blocks (ExpertBlocks: gate and up rows fused per
    expert, each tile dequantized in registers) equals the reference on the same blocks dequantized: float32 activations
    to float32 rounding, float16 ones (the interpreter has no bfloat16) within theirs."""
    from kvpilot.kernels.fused_moe import ExpertBlocks, Experts, fused_experts_reference
    from kvpilot.kernels.quantized import cat_rows
    from kvpilot.kernels.triton_moe import fused_experts

    gen = torch.Generator().manual_seed(4)
    tokens, hidden, experts, k = 9, 256, 4, 2  # (all_to_one: 18 rows, two blocks of one expert)
    gate, up, down, inner = quantized_experts(kind, experts, hidden, 64, seed=5)
    blocks = Experts(inner, blocks=(ExpertBlocks.of([cat_rows([g, u]) for g, u in zip(gate, up)]), ExpertBlocks.of(down)))
    x = torch.randn(tokens, hidden, generator=gen)
    weights, ids = routed(routing, tokens, experts, k, gen)
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.float16, 2e-2)):
        want = fused_experts_reference(x.to(dtype).float(), blocks, weights, ids).double()
        got = fused_experts(x.to(dtype), blocks, weights, ids)
        assert got.dtype == dtype
        assert torch.allclose(got.double(), want, atol=tolerance * want.abs().max().item(), rtol=tolerance), (dtype, (got.double() - want).abs().max())


@pytest.mark.timeout(300)
def test_experts_in_a_ggufs_blocks_stay_in_them_and_give_the_dequantized_models_tokens(family_checkpoints, model_path, tmp_path, monkeypatch, caplog):
    """A Qwen3-MoE GGUF whose experts are Q8_0 blocks: quantization=gguf keeps them in panels (the C++ op's) and greedy
    tokens equal those of the same file dequantized at load (quantization=none: the same weights, dense matmuls); on the
    Triton kernels (KVPILOT_KERNELS=triton, the CUDA path in the interpreter) it keeps them in stacked blocks, with the
    same tokens; on the reference ones, dense, with one warning for the model."""
    from test_model_families import PROMPTS, greedy, llm

    from checkpoint_factory import write_family_gguf
    from kvpilot.server import SamplingParams

    directory, _ = family_checkpoints["qwen3moe"]
    stacked = {f"model.layers.0.mlp.experts.{k}_proj.weight": "Q8_0" for k in ("gate", "up", "down")}
    path = write_family_gguf(directory, model_path, tmp_path / "experts-q8.gguf", types=stacked)
    kept, dense = llm(path, quantization="gguf"), llm(path)
    moe = kept.engine.worker.model.layers[0].mlp
    assert moe.experts.panels is not None and {p.kind for p in moe.experts.panels} == {"Q8_0"}
    assert dense.engine.worker.model.layers[0].mlp.experts.panels is None
    _, tokens_kept, _ = greedy(kept, batched=True)
    _, tokens_dense, _ = greedy(dense, batched=True)
    assert sum(a == b for a, b in zip(tokens_kept, tokens_dense)) >= len(PROMPTS) - 1, (tokens_kept, tokens_dense)
    monkeypatch.setenv("KVPILOT_KERNELS", "triton")
    on_triton = llm(path, quantization="gguf")
    moe = on_triton.engine.worker.model.layers[0].mlp
    assert moe.experts.panels is None and {b.kind for b in moe.experts.blocks} == {"Q8_0"}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    run = lambda engine: [o.outputs[0].token_ids for o in engine.generate(PROMPTS[:2], params)]  # noqa: E731
    assert run(on_triton) == run(dense)
    monkeypatch.setenv("KVPILOT_KERNELS", "reference")  # no kernel of its own for the blocks: dense, said once for the model
    caplog.clear()
    on_reference = llm(path, quantization="gguf")
    moe = on_reference.engine.worker.model.layers[0].mlp
    assert moe.experts.panels is None and moe.experts.blocks is None
    [said] = [r.getMessage() for r in caplog.records if "kept dense" in r.getMessage()]
    assert "(Q8_0)" in said and f"in 1 of {len(on_reference.engine.worker.model.layers)} layers" in said


@pytest.mark.timeout(300)
def test_an_engine_on_the_triton_kernels_gives_the_cpp_kernels_tokens(family_checkpoints, monkeypatch):
    """KVPILOT_KERNELS=triton (the CUDA path, in the interpreter): the tiny Qwen3-MoE's greedy tokens, batched, are the
    C++ kernels' (its Triton fused experts beside the Triton attention, RMSNorm and RoPE)."""
    from test_model_families import PROMPTS, llm

    from kvpilot.server import SamplingParams

    directory, _ = family_checkpoints["qwen3moe"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    run = lambda engine: [o.outputs[0].token_ids for o in engine.generate(PROMPTS[:3], params)]  # noqa: E731
    want = run(llm(directory))
    monkeypatch.setenv("KVPILOT_KERNELS", "triton")
    engine = llm(directory)
    assert engine.engine.worker.model.ops.name == "triton"
    assert run(engine) == want
