"""The FP8 KV cache's per-layer scales (kv_cache_dtype fp8): the cache holds K / k_scale and V / v_scale
as float8_e4m3fn (kernels/paged_attention.py), so a scale sets which magnitudes keep e4m3's 3-bit
mantissa (2^-6 to 448 times it) and where values saturate.

A checkpoint's own `k_scale` / `v_scale` (compressed-tensors' kv_cache_scheme) are used as they are.
Otherwise they are calibrated once at start: one prefill of CALIBRATION_TEXT over a throwaway cache in
the compute dtype, and each layer's scale = HEADROOM x its largest |K| (|V|) / 448 rounded up to a power
of two, so a prompt whose keys run up to HEADROOM (to twice that) times the calibration's still does not
saturate. The text is fixed, the
forward deterministic: every replica and restart computes the same scales, which the prefix cache's
keys (and KV tier files) depend on (they are part of the engine's KV identity)."""

from __future__ import annotations

import math

import torch

from kvpilot.kernels.paged_attention import FP8_MAX, AttentionMetadata

HEADROOM = 2.0
# Prose, code, numbers, a list and a dialogue: the kinds of text whose keys and values the engine will hold.
CALIBRATION_TEXT = """\
The river ran past the old mill, where the wheel had not turned for forty years. In the spring of 1987 the
village council voted 7 to 2 to restore it; the work took three summers and cost 412,000 euros.

def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

Ingredients: 2 cups of flour, 1 teaspoon of salt, 3/4 cup of warm water (about 40 °C), and a spoon of olive oil.
User: What is the capital of Australia, and why is it not Sydney?
Assistant: Canberra. It was chosen in 1908 as a compromise between Sydney and Melbourne, the two largest cities.
{"name": "kvpilot", "replicas": 3, "resources": {"gpu": 1}, "tags": ["serving", "llm"]}
SELECT city, COUNT(*) FROM orders WHERE total > 99.5 GROUP BY city ORDER BY 2 DESC LIMIT 10;
"""


def kv_calibration_ids(config, tokenizer) -> list[int] | None:
    """CALIBRATION_TEXT's token ids when the engine's cache is FP8 (the worker calibrates from them
    unless the checkpoint has its scales), else None."""
    from kvpilot.server.config import FP8_KV_NAMES

    return tokenizer.encode(CALIBRATION_TEXT) if config.kv_cache_dtype in FP8_KV_NAMES else None


def scale_for(values: torch.Tensor) -> float:
    """HEADROOM x max |values| / 448, rounded up to a power of two: dividing by it is exact (only e4m3's
    rounding remains), and kernels whose float32 sums differ in their last bits (C++, Triton, another
    CPU's vector width) still agree on it, so their replicas share prefix keys and tier files."""
    amax = max(float(values.abs().max()), 1e-6)  # an all-zero layer still gets a usable scale
    return 2.0 ** math.ceil(math.log2(amax * HEADROOM / FP8_MAX))


@torch.inference_mode()
def calibrate(model, token_ids: list[int], block_size: int) -> list[tuple[float, float]]:
    """(k_scale, v_scale) per layer of `model` (a DecoderModel), from one prefill of token_ids. Every
    tensor-parallel rank runs it at the same point of its start (the forward's collectives pair up)
    and gets the scales of its own heads."""
    c = model.config
    n = min(len(token_ids), c.max_position)
    blocks = -(-n // block_size)
    device = model.norm.weight.device
    shape = (blocks, block_size, model.num_kv_heads, c.head_dim)
    caches = [(torch.zeros(shape, dtype=model.dtype, device=device), torch.zeros(shape, dtype=model.dtype, device=device))
              for _ in range(c.num_layers)]
    meta = AttentionMetadata.one_prefill(n, block_size, device)
    model(torch.tensor(token_ids[:n], device=device), torch.arange(n, device=device), caches, meta)
    return [(scale_for(k), scale_for(v)) for k, v in caches]
