"""bench/gpu.py's smoke test on CPU (`run --quick --device cpu`, the GPU issue's script, so that what a lent GPU machine's
few minutes run has run here first): the Llama-3-8B shape (dummy weights; at --quick its structure at 1/16 width)
through every part — HF's model of the same dummy weights as the checks' oracle, every kvpilot run's rates with the
roofline beside the single stream, HF, the plain graph step, the quantized-matmul rows —, and the bundled model's shape
through its checks (the random-weight GGUF, gguf blocks equal to HF's dequantized ones; EAGLE-3, the FP8 KV cache, LoRA,
structured outputs, a tiny Qwen3-MoE against HF, the host KV tier) — each with the packages the GPU
machine's image lacks unimportable (beyond the wheels `bundle` carries). Figures are not asserted (a CPU at --quick sizes
measures nothing); their presence and the checks' verdicts are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# bench/gpu.py run as on the GPU machine: the packages its image lacks (gpu.NOT_THERE) unimportable
AS_THERE = """
import importlib.abc, runpy, sys
sys.path.insert(0, {bench!r})
from gpu import NOT_THERE
class NotThere(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in NOT_THERE:
            raise ImportError(f"{{name}}: not on the GPU machine (bench/gpu.py's NOT_THERE)")
sys.meta_path.insert(0, NotThere())
sys.argv = ["gpu.py", *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


# the Triton kernels against their float32 references (float16 in the interpreter: bfloat16 on the GPU)
KERNELS = {f"fp16 {name} vs fp32 reference" for name in ("rms_norm", "paged decode attention", "paged decode attention (split-K)",
                                                         "paged prefill attention", "rotary_qkv_", "gguf_linear Q4_1", "gguf_linear F8 W8A8",
                                                         "lora_add_ (2 slots, rank 8)", "fused_experts (dense)", "fused_experts (Q4_1 blocks)")}


def gpu_bench(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "gpu_bench.json"
    wrapper = AS_THERE.format(bench=str(ROOT / "bench"), script=str(ROOT / "bench" / "gpu.py"))
    done = subprocess.run([sys.executable, "-c", wrapper, "run", "--quick", "--device", "cpu", "--json", str(out), *args],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(300)
def test_the_8b_shape_runs_every_part_on_dummy_weights(tmp_path):
    result = gpu_bench(tmp_path, "--model-shape", "llama3-8b")
    assert result["model_shape"] == "llama3-8b" and result["copy_bandwidth_bytes_per_s"] > 0
    greedy = [c for c in result["checks"] if c["check"].startswith("fp32 greedy vs HF")]
    assert [c["check"].removeprefix("fp32 greedy vs HF, kvpilot ") for c in greedy] == \
        ["default", "enforce_eager", "async_scheduling off", "reference kernels"]
    assert all(c["result"].startswith("10/10") for c in greedy)
    assert KERNELS <= {c["check"] for c in result["checks"]} and all(c["pass"] for c in result["checks"]), result["checks"]
    rates = {(r["engine"], r["workload"]): r for r in result["rates"]}
    for run in ("default", "enforce_eager", "async_scheduling off", "int4"):
        single, full = rates[(f"kvpilot ({run})", "single stream (32 + 256)")], rates[(f"kvpilot ({run})", "256 requests (512 / 256)")]
        assert float(single["output tok/s"]) > 0 and float(full["output tok/s"]) > 0
        assert float(single["roofline tok/s"]) > 0 and single["of roofline"].endswith("%")
    # int4's decode step reads about a quarter of the float32 weights (its embedding and head int8): a roofline ~3-4x higher
    ratio = float(rates[("kvpilot (int4)", "single stream (32 + 256)")]["roofline tok/s"]) / \
        float(rates[("kvpilot (default)", "single stream (32 + 256)")]["roofline tok/s"])
    assert 3 < ratio < 5, ratio
    assert any(e.startswith("HF transformers") for e, _ in rates) and any(e.startswith("plain PyTorch") for e, _ in rates)
    assert {row["shape"] for row in result["quantized_matmul"]} == {"small 256x128"}


@pytest.mark.timeout(300)
def test_the_bundled_shape_checks_its_gguf_blocks_against_hf(tmp_path):
    result = gpu_bench(tmp_path, "--only", "checks")
    assert result["model_shape"] == "smollm2-135m" and result["rates"] == []
    assert [c["check"].removeprefix("fp32 greedy vs HF, kvpilot ") for c in result["checks"] if c["check"] not in KERNELS] == \
        ["default", "enforce_eager", "async_scheduling off", "gguf", "reference kernels",
         "EAGLE-3 (random head, 3 tokens) greedy vs plain", "FP8 KV cache vs float32 cache",
         "LoRA (rank 8, 7 targets): default kernels vs reference kernels", "structured outputs (a JSON schema)",
         "Qwen3-MoE (tiny, 8 experts) fp32 greedy vs HF", "host KV tier: an evicted prompt back from host memory"]
    assert all(c["pass"] for c in result["checks"]), result["checks"]
