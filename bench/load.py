"""Model load: time and resident memory of loading the bundled SmolLM2-135M as its GGUF (Q4_1/Q8_0,
dequantized at load) and as Hugging Face checkpoints of the same weights (safetensors, fp32 and bf16),
kvpilot beside HF transformers' own from_pretrained on the same checkpoint, each in a fresh process.

The checkpoints are written once (under the kvpilot cache) from the GGUF's dequantized weights, so
every row holds the same numbers. Memory: VmHWM (peak) and VmRSS after the load, minus VmRSS after
the imports; the engine's KV cache is kept at 16 MiB so that it does not blur the figures.

    python bench/load.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, refuse_if_busy, table  # noqa: E402

MEASURE = r"""
import json, sys, time
def status(key):
    return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith(key))) * 1024
import torch
torch.set_num_threads(1)
from kvpilot.server.config import EngineConfig
from kvpilot.server.engine.llm_engine import LLMEngine
import transformers
base = status("VmRSS")
t = time.perf_counter()
if sys.argv[2] == "kvpilot":
    engine = LLMEngine(EngineConfig(model=sys.argv[1], kv_cache_memory="16MiB", num_threads=1), show_progress=False)
else:
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
seconds = time.perf_counter() - t
print(json.dumps({"seconds": seconds, "peak": status("VmHWM") - base, "after": status("VmRSS") - base}))
"""


def write_checkpoints(workdir: Path) -> dict[str, Path]:
    """fp32 and bf16 checkpoints of the bundled GGUF's weights (transformers names and layout)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from kvpilot.server.gguf_loader import GGUFFile
    from kvpilot.server.model_files import resolve_model_path

    gguf_path = resolve_model_path("smollm2-135m")
    out = {}
    for dtype in ("float32", "bfloat16"):
        d = workdir / f"smollm2-135m-{dtype}"
        out[dtype] = d
        if (d / "config.json").is_file():
            continue
        d.mkdir(parents=True, exist_ok=True)
        g = GGUFFile(gguf_path)
        c = g.config
        save_file({n: g.load(n).to(getattr(torch, dtype)).contiguous() for n in sorted(g.checkpoint_names())}, str(d / "model.safetensors"))
        AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(d))
        (d / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_norm_eps,
            "max_position_embeddings": c.max_position, "tie_word_embeddings": c.tie_word_embeddings, "hidden_act": "silu",
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": dtype}, indent=2))
    return out


def measure(model: str, loader: str, repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        r = subprocess.run([sys.executable, "-c", MEASURE, model, loader], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
        if r.returncode != 0:
            sys.exit(f"bench: loading {model} with {loader} failed:\n{r.stderr[-3000:]}")
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    best = min(runs, key=lambda x: x["seconds"])
    return {"seconds": best["seconds"], "peak": max(x["peak"] for x in runs), "after": max(x["after"] for x in runs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    from kvpilot.kernels.cache import cache_root
    from kvpilot.server.model_files import resolve_model_path

    checkpoints = write_checkpoints(cache_root() / "bench-load")
    gguf_path = resolve_model_path("smollm2-135m")
    cases = [("kvpilot", "GGUF Q4_1/Q8_0 (dequantized to fp32)", gguf_path, gguf_path.stat().st_size),
             *[("kvpilot", f"checkpoint {dt}", d, (d / "model.safetensors").stat().st_size) for dt, d in checkpoints.items()],
             *[("transformers", f"checkpoint {dt}", d, (d / "model.safetensors").stat().st_size) for dt, d in checkpoints.items()]]
    rows = []
    for loader, what, path, size in cases:
        m = measure(str(path), loader, args.repeats)
        rows.append({"loader": loader, "model files": what, "weights on disk": f"{size / 2**20:.0f} MiB", "load s": f"{m['seconds']:.2f}",
                     "peak RSS growth": f"{m['peak'] / 2**20:.0f} MiB", "RSS after load": f"{m['after'] / 2**20:.0f} MiB"})
        print(rows[-1], flush=True)
    print(f"\nmachine: {machine()}; best of {args.repeats} (time), worst of {args.repeats} (memory); fp32 compute\n")
    print(table(rows, ["loader", "model files", "weights on disk", "load s", "peak RSS growth", "RSS after load"]))


if __name__ == "__main__":
    main()
