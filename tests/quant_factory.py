"""Pre-quantized checkpoints written from a float checkpoint, the way each packer lays them out: GPTQ
(v1/v2 zero points, act order), AWQ (GEMM) and compressed-tensors (packed by that library itself). The
weights are rounded to nearest per group (the format matters here, not the quantization algorithm); each
quantized checkpoint comes with the same model holding the dequantized weights in float32. Used by
tests/test_quant_checkpoints.py and bench/quant_checkpoints.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from kvpilot.server.quant_checkpoint import AWQ_ORDER

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def int32(x: torch.Tensor) -> torch.Tensor:
    return ((x.to(torch.int64) + 2**31) % 2**32 - 2**31).to(torch.int32)


def quantize_rtn(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor):
    """Round to nearest per group (of columns g_idx names): codes [N, K], zero points and float16 scales [N, G]."""
    top = 2**bits - 1
    groups = int(g_idx.max()) + 1
    scales, zeros = torch.empty(w.shape[0], groups), torch.empty(w.shape[0], groups, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            s = (cols.abs().amax(1) / (2 ** (bits - 1) - 1)).half().float().clamp(min=1e-4)
            z = torch.full((w.shape[0],), 2 ** (bits - 1))
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = ((hi - lo) / top).half().float().clamp(min=1e-4)
            z = torch.round(-lo / s).clamp(0, top).long()
        scales[:, g], zeros[:, g] = s, z
    codes = (torch.round(w / scales[:, g_idx]) + zeros[:, g_idx]).clamp(0, top).long()
    return codes, zeros, scales.half()


def pack_gptq(codes, zeros, scales, g_idx, bits: int, v1: bool) -> dict[str, torch.Tensor]:
    per = 32 // bits
    shifts = torch.arange(per) * bits
    n, k = codes.shape
    qweight = (codes.T.reshape(k // per, per, n) << shifts[None, :, None]).sum(1)         # along the input dimension
    stored = (zeros - (1 if v1 else 0)) & (2**bits - 1)
    qzeros = (stored.T.reshape(-1, n // per, per) << shifts).sum(-1)                       # along the output dimension
    return {"qweight": int32(qweight), "qzeros": int32(qzeros), "scales": scales.T.contiguous(), "g_idx": g_idx.to(torch.int32)}


def pack_awq(codes, zeros, scales) -> dict[str, torch.Tensor]:
    shifts = torch.arange(8) * 4
    order = torch.tensor(AWQ_ORDER)

    def words(m: torch.Tensor) -> torch.Tensor:  # [rows, out] -> [rows, out / 8]: slot i holds column 8w + AWQ_ORDER[i]
        return int32((m.reshape(m.shape[0], -1, 8)[:, :, order] << shifts).sum(-1))
    return {"qweight": words(codes.T), "qzeros": words(zeros.T), "scales": scales.T.contiguous()}


def pack_compressed(codes, zeros, scales, scheme: dict) -> dict[str, torch.Tensor]:
    """compressed-tensors' layouts, packed by the library itself (compressed_tensors 0.20's pack_to_int32)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32


    bits, offset = scheme["bits"], 1 << (scheme["bits"] - 1)
    signed, signed_zeros = (codes - offset).to(torch.int8), (zeros - offset).to(torch.int8)
    if scheme["format"] == "pack-quantized":
        parts = {"weight_packed": pack_to_int32(signed, bits), "weight_shape": torch.tensor(list(codes.shape)), "weight_scale": scales}
        if not scheme["sym"]:
            parts["weight_zero_point"] = pack_to_int32(signed_zeros, bits, packed_dim=0)
        return parts
    parts = {"weight": signed, "weight_scale": scales}
    if not scheme["sym"]:
        parts["weight_zero_point"] = signed_zeros
    return parts


def compressed_config(scheme: dict) -> dict:
    """A quantization_config as llm-compressor writes it."""
    float8 = scheme["format"] == "float-quantized"
    weights = {"num_bits": 8 if float8 else scheme["bits"], "type": "float" if float8 else "int", "symmetric": scheme.get("sym", True),
               "strategy": "channel" if scheme.get("group_size", -1) == -1 else "group", "dynamic": False}
    if weights["strategy"] == "group":
        weights["group_size"] = scheme["group_size"]
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False} if float8 else None
    return {"quant_method": "compressed-tensors", "format": scheme["format"], "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}}}


def quantized_pair(source: Path, dest: Path, scheme: dict, act_order: bool = False, seed: int = 0) -> tuple[Path, Path]:
    """(a quantized checkpoint, the same model with its dequantized weights as float32) from a float checkpoint."""
    from safetensors.torch import load_file, save_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(source.glob("*.safetensors")):
        state.update(load_file(str(f)))
    quantized, dense = dict(state), dict(state)
    gen = torch.Generator().manual_seed(seed)
    orders: dict[str, torch.Tensor] = {}
    bits, group = scheme.get("bits", 8), scheme.get("group_size", -1)
    for name in [n for n in state if n.endswith(".weight") and any(p in n for p in PROJECTIONS)]:
        w = state[name].float()
        k = w.shape[1]
        g = k if group == -1 else group
        if act_order:  # columns taken in a permuted order, grouped in that order: one order per input (as GPTQ's Hessian)
            shared_input = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
            perm = orders.setdefault(shared_input, torch.randperm(k, generator=gen))
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perm] = torch.arange(k) // g
        else:
            g_idx = torch.arange(k) // g
        prefix = name.removesuffix(".weight")
        del quantized[name]
        if scheme["quant_method"] == "fp8":  # transformers' / vLLM's: a weight_scale_inv per block, or one weight_scale
            block = scheme.get("weight_block_size")
            if block:
                rows, cols = block
                grid = w.new_zeros(-(-w.shape[0] // rows), -(-w.shape[1] // cols))
                for i in range(grid.shape[0]):
                    for j in range(grid.shape[1]):
                        grid[i, j] = w[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].abs().max() / 448
                grid = grid.clamp(min=1e-6)
                spread = grid.repeat_interleave(rows, 0)[:w.shape[0]].repeat_interleave(cols, 1)[:, :w.shape[1]]
                fp8 = (w / spread).to(torch.float8_e4m3fn)
                quantized.update({f"{prefix}.weight": fp8, f"{prefix}.weight_scale_inv": grid})
            else:
                spread = (w.abs().max() / 448).clamp(min=1e-6)
                fp8 = (w / spread).to(torch.float8_e4m3fn)
                quantized.update({f"{prefix}.weight": fp8, f"{prefix}.weight_scale": spread.reshape(()), f"{prefix}.input_scale": torch.tensor(0.02)})
            dense[name] = fp8.float() * spread
            continue
        if scheme.get("format") == "float-quantized":
            scale = (w.abs().amax(1, keepdim=True) / 448).clamp(min=1e-6)  # E4M3's largest value
            fp8 = (w / scale).to(torch.float8_e4m3fn)
            quantized.update({f"{prefix}.weight": fp8, f"{prefix}.weight_scale": scale, f"{prefix}.input_scale": torch.ones(1)})
            dense[name] = fp8.float() * scale
            continue
        codes, zeros, scales = quantize_rtn(w, bits, g, scheme.get("sym", False), g_idx)
        if scheme["quant_method"] == "gptq":
            parts = pack_gptq(codes, zeros, scales, g_idx, bits, v1=scheme.get("checkpoint_format", "gptq") == "gptq")
        elif scheme["quant_method"] == "awq":
            parts = pack_awq(codes, zeros, scales)
        else:
            scales = scales.to(getattr(torch, scheme.get("scale_dtype", "float16")))
            parts = pack_compressed(codes, zeros, scales, scheme)
        quantized.update({f"{prefix}.{p}": t for p, t in parts.items()})
        dense[name] = (codes - zeros[:, g_idx]).float() * scales.float()[:, g_idx]
    if scheme["quant_method"] == "compressed-tensors":
        scheme = compressed_config(scheme)
    out = []
    for path, tensors, config_extra in ((dest / "quantized", quantized, {"quantization_config": scheme}), (dest / "dense", dense, {})):
        shutil.copytree(source, path, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json"))
        save_file({n: t.contiguous() for n, t in tensors.items()}, str(path / "model.safetensors"))
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, **config_extra}))
        out.append(path)
    return out[0], out[1]


def library_dequantized(quantized: Path) -> dict[str, torch.Tensor] | None:
    """The checkpoint's projection weights as compressed-tensors dequantizes them (float32), the library
    as an independent reader: its own dequantizer for compressed-tensors checkpoints, its AutoAWQ
    converter first for AWQ ones; None for the others (the library has no GPTQ reader: the GPTQ bit orders
    are pinned by literal words instead; transformers reads `quant_method: fp8`). Scales are widened to float32 before the library multiplies, so that
    its (code − zero)·scale is exact, as ours is: the comparison is then one of values, not of roundings."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    from safetensors.torch import load_file

    config = json.loads((quantized / "config.json").read_text())["quantization_config"]
    if config["quant_method"] not in ("awq", "compressed-tensors"):
        return None
    # the projections' tensors only: without the model, the library cannot tell a Linear's `weight` from a norm's
    tensors = {n: t for n, t in load_file(str(quantized / "model.safetensors")).items() if any(f"{p}." in n for p in PROJECTIONS)}
    stub = quantized
    if config["quant_method"] == "awq":
        converter = AutoAWQConverter.from_autoawq_config(config)
        tensors = converter.process(tensors)
        stub = quantized.parent / "awq-as-compressed-tensors"
        stub.mkdir(exist_ok=True)
        (stub / "config.json").write_text(json.dumps({"quantization_config": converter.update_config(None).model_dump(mode="json")}))
    tensors = {n: t.float() if n.endswith(".weight_scale") else t for n, t in tensors.items()}
    dequantizer = CompressedTensorsDequantizer(stub, dtype=torch.float32)
    for group in dequantizer.quant_config.config_groups.values():  # the checkpoint's format, not the one the library infers from the
        group.format = dequantizer.quant_config.format                 # scheme (which takes a naive-quantized W8 for pack-quantized)
    dense = dequantizer.process(tensors)
    return {n: t for n, t in dense.items() if n.endswith(".weight") and any(p in n for p in PROJECTIONS)}
