"""Pre-quantized checkpoints of the bundled model (GPTQ, AWQ, compressed-tensors, FP8) against the int4 path
that quantizes the float checkpoint at load and against symmetric GPTQ (the targets: act order and
asymmetric schemes at >= 0.9x of it), and FP8 weights against the float checkpoint in float32 and bfloat16,
same run: single-stream decode and 16-client throughput, the projections' bytes and the rest's (embedding,
norms, an unquantized LM head; a tied one counted once). The checkpoints are written by tests/quant_factory.py (round to nearest, each packer's
layout; group 128) from the bundled model saved as a float32 Hugging Face checkpoint by transformers,
cached under ${XDG_CACHE_HOME:-~/.cache}/kvpilot/bench-quant-checkpoints.

    .venv/bin/python bench/quant_checkpoints.py [--force] [--rounds 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from kvpilot.server.threads import OPENMP_ENV  # noqa: E402

os.environ.update({k: os.environ.get(k, v) for k, v in OPENMP_ENV.items()})

from common import machine, refuse_if_busy, table  # noqa: E402

GROUP = 128
SCHEMES = {  # name -> quantization_config (tests/quant_factory.py's spelling), act order
    "gptq 4-bit sym": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True}, False),
    "gptq 4-bit asym": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": False}, False),
    "gptq 4-bit desc_act": ({"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": False, "desc_act": True}, True),
    "awq 4-bit": ({"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}, False),
    "ct W8A16 channel": ({"quant_method": "compressed-tensors", "format": "pack-quantized", "bits": 8, "group_size": -1, "sym": True}, False),
    "ct FP8 weights": ({"quant_method": "compressed-tensors", "format": "float-quantized"}, False),
    "fp8 block 128": ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, False),
}
BASE, SYM = "int4 at load (float checkpoint, group 128)", "gptq 4-bit sym"


def float_checkpoint(root: Path) -> Path:
    """The bundled model as a float32 Hugging Face checkpoint (transformers reads the GGUF and saves it)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpilot.server.model_files import resolve_model_path

    out = root / "float"
    if (out / "config.json").is_file():
        return out
    gguf = resolve_model_path("smollm2-135m")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # (transformers will not save_pretrained a model it read from a GGUF: its tensors and config, written directly)
    out.mkdir(parents=True, exist_ok=True)
    state = {n: t.contiguous() for n, t in model.state_dict().items() if not (n == "lm_head.weight" and model.config.tie_word_embeddings)}
    save_file(state, str(out / "model.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
    return out


def run(model: Path, threads: int, **kw) -> dict[str, float]:
    from kvpilot.server import LLM, SamplingParams

    llm = LLM(model=str(model), num_threads=threads, show_progress=False, kv_cache_memory="256MiB", **kw)
    llm.generate([list(range(100, 132))], SamplingParams(max_tokens=4))  # warm-up
    t = time.perf_counter()
    one = llm.generate([list(range(200, 232))], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))[0]
    single = len(one.outputs[0].token_ids) / (time.perf_counter() - t)
    prompts = [list(range(300 + 40 * i, 364 + 40 * i)) for i in range(16)]
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    batch = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    model_ = llm.engine.worker.model
    projections = sum(p.numel() * p.element_size() for layer in model_.layers for p in [*layer.attn.parameters(), *layer.mlp.parameters(),
                                                                                          *layer.attn.buffers(), *layer.mlp.buffers()])
    everything = sum(t.numel() * t.element_size() for t in {id(t): t for t in [*model_.parameters(), *model_.buffers()]}.values())
    from kvpilot.kernels.quantized import GGUFLinear

    kinds = sorted({m.kind for m in model_.layers.modules() if isinstance(m, GGUFLinear)}) or [str(llm.engine.worker.dtype).removeprefix("torch.")]
    llm.engine.close()
    return {"single": single, "batch": batch, "proj_mib": projections / 2**20, "rest_mib": (everything - projections) / 2**20,
            "kinds": "+".join(kinds)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--only", nargs="*", default=None, help="the schemes whose name contains one of these (the int4 and gptq sym rows always run)")
    args = ap.parse_args()
    refuse_if_busy(force=args.force)
    from quant_factory import quantized_pair

    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvpilot" / "bench-quant-checkpoints"
    source = float_checkpoint(root)
    models: dict[str, tuple[Path, dict]] = {BASE: (source, {"quantization": "int4", "quantization_group_size": GROUP}),
                                            "float checkpoint, float32": (source, {}),
                                            "float checkpoint, bfloat16": (source, {"dtype": "bfloat16"})}
    if args.only is not None:
        models = {n: models[n] for n in models if n == BASE or any(part in n for part in args.only)}
    for name, (scheme, act_order) in SCHEMES.items():
        if args.only is not None and name != SYM and not any(part in name for part in args.only):
            continue
        dest = root / name.replace(" ", "-")
        if not (dest / "quantized" / "config.json").is_file():
            quantized_pair(source, dest, scheme, act_order=act_order)
        models[name] = (dest / "quantized", {})
    results: dict[str, list[dict[str, float]]] = {name: [] for name in models}
    for _ in range(args.rounds):  # interleaved
        for name, (path, kw) in models.items():
            results[name].append(run(path, args.threads, **kw))
    median = {name: {k: statistics.median(r[k] for r in runs) for k in ("single", "batch")} for name, runs in results.items()}
    rows = []
    for name, runs in results.items():
        single, batch = median[name]["single"], median[name]["batch"]
        rows.append({"weights": name, "kept as": runs[0]["kinds"], "1 stream tok/s": f"{single:.1f}",
                     "vs int4": f"{single / median[BASE]['single']:.2f}×", "vs gptq sym": f"{single / median[SYM]['single']:.2f}×",
                     "16 clients tok/s": f"{batch:.1f}", "vs int4 ": f"{batch / median[BASE]['batch']:.2f}×",
                     "vs gptq sym ": f"{batch / median[SYM]['batch']:.2f}×", "projections MiB": f"{runs[0]['proj_mib']:.1f}",
                     "rest MiB": f"{runs[0]['rest_mib']:.1f}"})
    print(f"machine: {machine()}; threads {args.threads}; rounds {args.rounds} (median); 128 tokens from a 32-token prompt; 16 × 64 tokens")
    print(table(rows, ["weights", "kept as", "1 stream tok/s", "vs int4", "vs gptq sym", "16 clients tok/s", "vs int4 ", "vs gptq sym ",
                       "projections MiB", "rest MiB"]))


if __name__ == "__main__":
    main()
