"""K-quant weights in `--quantization gguf`: what they cost in memory and per call, this CPU.

    .venv/bin/python bench/k_quants.py [--force]

1. Memory: Llama-3-8B as llama.cpp's Q4_K_M rules quantize it (attn_v and ffn_down Q6_K in the layers
   its `use_more_bits` picks, the output Q6_K, every other matrix Q4_K): the bytes gguf mode keeps
   against the file's tensor bytes, for the layouts the loader has had (arithmetic on the shapes).
2. Speed: the panel kernel (GGUFLinear, 2 threads) on random Q4_K weights in the K4 layout against the
   same values in the K8 layout (int8 codes, float32 scale and min per 16: Q4_K's layout before K4),
   µs per call at decode and prefill row counts (the best of 7 timings of 20 calls).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from common import best_us, machine, refuse_if_busy, table  # noqa: E402

# Llama-3-8B: layers, hidden, kv width, FFN width, vocabulary.
LLAMA3_8B = (32, 4096, 1024, 14336, 128256)
FILE_BITS = {"Q4_K": 144 * 8 / 256, "Q6_K": 210 * 8 / 256}
LAYOUT_BITS = {"K8 for Q4_K and Q6_K": {"Q4_K": 12, "Q6_K": 10}, "K4 with float32 scales, K8": {"Q4_K": 6, "Q6_K": 10},
               "K4 with the file's scales, K8 (now)": {"Q4_K": 4 + 16 / 32 + 32 / 256, "Q6_K": 10}}


def q4_k_m_weights(layers: int, hidden: int, kv: int, ffn: int, vocab: int) -> dict[str, int]:
    """Weights per type in a Q4_K_M file, by llama.cpp's rule for attn_v / ffn_down (use_more_bits)."""
    more = {i for i in range(layers) if i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2}
    count = {"Q4_K": vocab * hidden, "Q6_K": vocab * hidden}  # token_embd, output
    for i in range(layers):
        count["Q4_K"] += 2 * hidden * hidden + hidden * kv + 2 * hidden * ffn  # q, o, k, gate, up
        count["Q6_K" if i in more else "Q4_K"] += hidden * kv + ffn * hidden  # v, down
    return count


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    import torch

    from gguf_factory import k_quant_blocks
    from kvpilot.kernels.gguf_dequant import k_quant_parts
    from kvpilot.kernels.quantized import GGUFLinear, GGUFWeight

    count = q4_k_m_weights(*LLAMA3_8B)
    file_bits = sum(n * FILE_BITS[kind] for kind, n in count.items())
    print(f"Llama-3-8B Q4_K_M: {count['Q6_K'] / sum(count.values()):.1%} of the weights Q6_K, {file_bits / 8 / 2**30:.2f} GiB of tensors")
    print(table([{"layout": name, "kept / file": f"{sum(n * bits[kind] for kind, n in count.items()) / file_bits:.3f}x"}
                 for name, bits in LAYOUT_BITS.items()], ["layout", "kept / file"]))

    torch.set_num_threads(2)
    rows = []
    for n, k in [(1536, 768), (768, 1536), (4096, 4096)]:
        raw = torch.from_numpy(k_quant_blocks("Q4_K", n, k // 256, seed=1, scale=0.002))
        k4 = GGUFWeight.from_blocks("Q4_K", raw, n)
        codes, d, m = k_quant_parts("Q4_K", raw)
        k8 = GGUFWeight("Q5_K", codes.view(torch.uint8), d, m)  # Q5_K's layout is K8 with mins: Q4_K's values as they were kept
        assert torch.equal(k4.dequantize(), k8.dequantize())
        new, old = GGUFLinear(k4), GGUFLinear(k8)
        for m_rows in (1, 16, 128):
            x = torch.randn(m_rows, k)
            t_new, t_old = best_us(lambda: new(x), 20, 7), best_us(lambda: old(x), 20, 7)  # noqa: B023 — timed within this iteration
            rows.append({"shape": f"{n}x{k}", "M": m_rows, "K4 µs": f"{t_new:.1f}", "K8 µs": f"{t_old:.1f}",
                         "K8 / K4 time": f"{t_old / t_new:.2f}x", "MiB K4 / K8": f"{k4.nbytes / 2**20:.1f} / {k8.nbytes / 2**20:.1f}"})
    print(f"machine: {machine()}")
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
