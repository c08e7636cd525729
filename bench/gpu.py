"""The GPU benchmark and correctness check (the GPU-path issue), one command on a GPU machine.

    here:   .venv/bin/python bench/gpu.py bundle    # .gpu/: the model's metadata skeleton + wheels (~5 MB)
    there:  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/wheels/*.whl \\
              && PYTHONPATH=/tmp/site python3 bench/gpu.py run          # (device tool: carry [".gpu"])

The GPU machine cannot download and at most 64 MiB travel, so the bundled GGUF (98 MB) stays here:
`bundle` keeps its metadata (architecture, hyper-parameters, tokenizer) and its tensors' names and
shapes in a tensor-free GGUF, and fetches the wheels that machine lacks (the engine config's pydantic,
the GGUF reader); `run` writes a GGUF of those shapes with seeded random weights in the bundled file's block formats (Q4_1, the embedding Q8_0), then:

1. correctness: kvpilot on the device in float32 vs HF transformers on the device in float32 (TF32
   off), 64 greedy tokens from each oracle prompt, judged by the project's rule (all but one exact,
   the first divergence inside each other's top 5), for kvpilot's default (Triton on CUDA, decode
   steps in CUDA graphs, async scheduling), --enforce-eager, --async-scheduling off, --quantization gguf (the file's Q4_1/Q8_0 blocks kept, as
   HF dequantizes them) and the torch reference kernels;
2. each Triton kernel in bfloat16 against its float32 torch reference (stated tolerances; float16 in the CPU smoke test);
   on the bundled shapes also EAGLE-3 with a random head, the FP8 KV cache, LoRA, structured outputs, the host KV tier,
   and the tests' tiny Qwen3-MoE against HF (its fused experts in Triton);
3. throughput (output tok/s, one table): single stream (32 + 256 tokens), 64 requests (bench/offline.py's
   workload), 256 requests (nano-vllm's protocol, max_num_seqs 256) — kvpilot (default, with
   --enforce-eager: the CUDA graphs' share, with --async-scheduling off: the host/device overlap's
   share, and with --quantization gguf) vs HF static batches vs a plain-PyTorch decode step (fused QKV and gate/up, RoPE, SDPA
   over a static cache, a sampled token) captured as one CUDA graph;
4. the quantization issue's kernel micro-benchmark: the Triton int4 / int8 GGUF-block matmul vs the
   bf16 matmul at Llama-3-8B's layer shapes, M = 1 and 16, weights generated on the GPU.

`--model-shape llama3-8b` runs the same on a Llama-3-8B-shaped model (32 layers, hidden 4096, GQA 32:8, FFN 14336,
vocabulary 128,256, RoPE base 500,000) with no file: a config.json and the engine's `--load-format dummy` (seeded
random weights made on the device; HF's model of the config gets the same tensors for the checks), bf16 and int4 (an
FP8 rate needs an FP8 checkpoint's packed weights, which dummy weights are not); its workloads are the issue's: single
stream (32 + 256) and 256 requests (prompts 512, outputs 256); int4 replaces gguf in its runs. Every single-stream rate
is printed beside the HBM roofline in tokens per second: the device's measured copy bandwidth over the weight bytes a
decode step reads (the engine's weights but the embedding table).

`run --quick --device cpu` shrinks every workload, and the 8B shape to its structure at 1/16 width and two layers (a
smoke test of the script itself, no figures; tests/test_gpu_bench.py runs every part of it on the 8B shape and the checks
on the bundled one).
A device command has ten minutes; split a run with `--only` (e.g. the 8B shape: `--only checks`, then `--only kvpilot`,
then `--only hf --only graph --only quant`; a kvpilot workload is stopped after `--deadline` seconds and rated on what
it made). Every figure goes to $OUT/gpu_bench-<shape>.json (or --json), the tables to the screen.
Figures go to bench/RESULTS.md with this command; without a GPU: "GPU not measured".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / ".gpu"
SKELETON = BUNDLE / "skeleton.gguf"
TOKENIZER = BUNDLE / "tokenizer"
WHEELS = BUNDLE / "wheels"
TENSORS_KEY = "kvpilot.bench.tensors"  # JSON {name: numpy shape} of the bundled model's tensors
# What the GPU machine's image lacks for the offline engine (the device README's package list): the GGUF reader, the
# engine config's pydantic, the step outputs' msgspec, structured outputs' llguidance (the engine builds its compiler).
CARRIED = ["gguf", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "msgspec", "llguidance"]
# The engine's and the tests' other dependencies that image lacks and this script must not need (tests/test_gpu_bench.py
# runs it with them unimportable): the HTTP server's, prefill/decode transfer's, the operator's, the tests' clients.
NOT_THERE = ["fastapi", "uvicorn", "starlette", "zmq", "nixl", "kopf", "kubernetes", "openai", "jsonschema", "schemathesis",
             "compressed_tensors"]
PARTS = ["checks", "kvpilot", "hf", "graph", "quant"]  # what `run` does, in order
PLATFORMS = ["manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
ABIS = ["cp312", "abi3", "none"]  # (llguidance ships one abi3 wheel)


def _copy_metadata(reader, writer) -> None:
    """Every key/value of a GGUF into a writer, but the reader's header entries and the architecture
    (the writer makes those) and this script's tensor list."""
    import gguf

    from kvpilot.server.gguf_loader import _field_value

    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", TENSORS_KEY):
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(name, _field_value(field), gguf.GGUFValueType.ARRAY, sub_type=field.types[-1])
        else:
            writer.add_key_value(name, _field_value(field), field.types[0])


def write_skeleton(dest: Path) -> Path:
    """The bundled model's metadata and tensor list in a tensor-free GGUF."""
    import gguf

    from kvpilot.server.gguf_loader import _field_value
    from kvpilot.server.model_files import resolve_model_path

    reader = gguf.GGUFReader(resolve_model_path("smollm2-135m"))
    writer = gguf.GGUFWriter(str(dest), str(_field_value(reader.fields["general.architecture"])))
    _copy_metadata(reader, writer)
    writer.add_string(TENSORS_KEY, json.dumps({t.name: [int(n) for n in reversed(t.shape.tolist())] for t in reader.tensors}))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return dest


def write_tokenizer(dest: Path) -> Path:
    """The bundled model's tokenizer as transformers saves it (the 8B shape's checkpoint directory reads it)."""
    from transformers import AutoTokenizer

    from kvpilot.server.model_files import resolve_model_path

    gguf_path = resolve_model_path("smollm2-135m")
    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(dest))
    return dest


def bundle() -> None:
    BUNDLE.mkdir(exist_ok=True)
    write_skeleton(SKELETON)
    write_tokenizer(TOKENIZER)
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    WHEELS.mkdir(exist_ok=True)
    for name in CARRIED:
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)] + [arg for abi in ABIS for arg in ("--abi", abi)]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                        "--implementation", "cp", *platforms, "-d", str(WHEELS), f"{name}=={pins[name]}"], check=True)
    size = sum(f.stat().st_size for f in BUNDLE.rglob("*") if f.is_file())
    print(f"{BUNDLE}: {size / 2**20:.1f} MiB (skeleton {SKELETON.stat().st_size / 2**20:.1f} MiB, tokenizer, {len(list(WHEELS.glob('*.whl')))} wheels)")


def _import_kvpilot() -> None:
    """kvpilot from this checkout without installing it: a namespace package of symlinks (as setup.py maps the folders)."""
    try:
        import kvpilot.server  # noqa: F401
    except ImportError:
        shim = Path(tempfile.mkdtemp()) / "kvpilot"
        shim.mkdir()
        for folder in ("server", "kernels", "operator"):
            (shim / folder).symlink_to(ROOT / folder)
        sys.path.insert(0, str(shim.parent))


def make_gguf(dest: Path, skeleton: Path, seed: int = 0) -> Path:
    """The bundled model's architecture and tokenizer with seeded random weights N(0, 0.02) in the
    bundled file's formats: the token embedding Q8_0, the other matrices Q4_1, norms 1 (F32). The
    weights HF dequantizes are then exactly the ones --quantization gguf keeps."""
    import gguf
    import numpy as np

    from kvpilot.server.gguf_loader import _field_value

    reader = gguf.GGUFReader(skeleton)
    shapes = json.loads(str(_field_value(reader.fields[TENSORS_KEY])))
    writer = gguf.GGUFWriter(str(dest), str(_field_value(reader.fields["general.architecture"])))
    _copy_metadata(reader, writer)
    rng = np.random.default_rng(seed)
    for name, shape in shapes.items():
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, np.float32))
        else:
            kind = gguf.GGMLQuantizationType.Q8_0 if name == "token_embd.weight" else gguf.GGMLQuantizationType.Q4_1
            blocks = gguf.quants.quantize(rng.standard_normal(shape, dtype=np.float32) * 0.02, kind)
            writer.add_tensor(name, blocks, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


# name -> (kernels, engine settings)
KVPILOT_RUNS = {"default": ("default", {}), "enforce_eager": ("default", {"enforce_eager": True}),
                "async_scheduling off": ("default", {"async_scheduling": "off"}), "gguf": ("default", {"quantization": "gguf"})}
# Llama-3-8B's config.json (its tokenizer aside: the bundled model's, whose ids are all inside this vocabulary)
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
             "bos_token_id": 1, "eos_token_id": 2}
# --quick: its structure (GQA 4:1, the untied head, the vocabulary) at 1/16 width and two layers
LLAMA3_8B_QUICK = {**LLAMA3_8B, "hidden_size": 256, "intermediate_size": 896, "num_hidden_layers": 2, "num_attention_heads": 8,
                   "num_key_value_heads": 2, "head_dim": 32}
# (requests, prompt lengths, output lengths, max_num_seqs) per workload, and HF's static batch for it
WORKLOADS = {
    "smollm2-135m": {"single stream (32 + 256)": ((1, (32, 32), (256, 256), 1), 1),
                     "64 requests (32-512 / 32-256)": ((64, (32, 512), (32, 256), 64), 64),
                     "256 requests (100-1024 / 100-1024)": ((256, (100, 1024), (100, 1024), 256), 128)},
    "llama3-8b": {"single stream (32 + 256)": ((1, (32, 32), (256, 256), 1), 1),
                  "256 requests (512 / 256)": ((256, (512, 512), (256, 256), 256), 64)},
}
SINGLE_STREAM = "single stream (32 + 256)"


@dataclass
class Subject:
    """The model a run measures: what the engine is given (a random-weight GGUF, or a config.json with dummy weights), the
    settings every engine gets for it, its shape, and the kvpilot runs that apply to it."""

    shape: str
    path: Path
    engine: dict
    config: object  # kvpilot.server.model_config.ModelConfig
    runs: dict[str, tuple[str, dict]]  # rated
    checked: tuple[str, ...]  # of those, the runs whose fp32 greedy tokens must be HF's (not a quantization HF does not hold)
    seed: int = 0

    @property
    def dummy(self) -> bool:
        return self.engine.get("load_format") == "dummy"

    def hf_tokenizer(self):
        from transformers import AutoTokenizer

        if self.dummy:
            return AutoTokenizer.from_pretrained(str(self.path))
        return AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name)

    def hf_model(self, dtype, device: str):
        """HF transformers' model of the same weights: the GGUF dequantized, or the config's model holding the dummy
        weights the engine makes (made on the device one at a time: no host copy of 8B)."""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        if not self.dummy:
            return AutoModelForCausalLM.from_pretrained(str(self.path.parent), gguf_file=self.path.name, dtype=dtype).to(device).eval()
        from kvpilot.server.dummy_weights import DummyWeights

        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(self.path)), dtype=dtype).eval()
        weights = DummyWeights.of(self.path, self.seed).on(torch.device(device), dtype)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights.load(name))
        return model


def subject(shape: str, work: Path, quick: bool) -> Subject:
    from kvpilot.server.gguf_loader import GGUFFile

    if shape == "smollm2-135m":
        skeleton = SKELETON if SKELETON.is_file() else write_skeleton(work / "skeleton.gguf")  # (here: from the bundled file)
        path = make_gguf(work / "smollm2-135m-random.gguf", skeleton)
        return Subject(shape, path, {}, GGUFFile(path).config, KVPILOT_RUNS, tuple(KVPILOT_RUNS))  # (gguf: HF holds the same blocks)
    from kvpilot.server.checkpoint import read_json
    from kvpilot.server.model_config import config_from_hf

    path = work / "llama3-8b-shaped"
    shutil.copytree(TOKENIZER if TOKENIZER.is_dir() else write_tokenizer(work / "tokenizer"), path)
    (path / "config.json").write_text(json.dumps(LLAMA3_8B_QUICK if quick else LLAMA3_8B, indent=1))
    runs = {name: run for name, run in KVPILOT_RUNS.items() if name != "gguf"}
    return Subject(shape, path, {"load_format": "dummy"}, config_from_hf(read_json(path / "config.json"), shape, str(path)),
                   runs | {"int4": ("default", {"quantization": "int4"})}, tuple(runs))


def _kvpilot(subject: Subject, device: str, dtype: str, kernels: str, **engine):
    from kvpilot.server import LLM

    os.environ["KVPILOT_KERNELS"] = kernels  # read when the model is built
    threads = {"num_threads": 2} if device == "cpu" else {}
    return LLM(model=str(subject.path), device=device, dtype=dtype, show_progress=False, seed=subject.seed, **threads, **subject.engine, **engine)


def decode_weight_bytes(llm) -> int:
    """The weight bytes a single-stream decode step reads: every weight of the model but the embedding table (one row of
    it is read), unless the table is the head too."""
    import torch

    model = llm.engine.worker.model
    total = model.weight_bytes()
    if not model.config.tie_word_embeddings and model.embed is not None:
        embed = model.embed
        total -= embed.nbytes if not isinstance(embed, torch.Tensor) else embed.untyped_storage().nbytes()
    return total


def copy_bandwidth(device: str) -> float:
    """Bytes per second a device-to-device copy moves (read + write), the best of 5 timings of 10 copies of 1 GiB (64 MiB on a
    CPU): the memory's practical limit."""
    import torch

    n = (1 << 30) if device == "cuda" else (1 << 26)
    a, b = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    b.copy_(a)
    return max(2 * n * 10 / _timed(partial(_repeat, partial(b.copy_, a), 10)) for _ in range(5))


def _hf_greedy(model, ids: list[int], steps: int, device: str):
    """HF's greedy continuation of one prompt with its KV cache, and the top 5 at each step (an OracleResult)."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from oracle import TOPK, OracleResult

    out = model(torch.tensor([ids], device=device), use_cache=True)
    past, last = out.past_key_values, out.logits[0, -1].float()
    tokens, topk = [], []
    for _ in range(steps):
        topk.append(torch.topk(last, TOPK).indices.tolist())
        tokens.append(int(last.argmax()))
        out = model(torch.tensor([[tokens[-1]]], device=device), past_key_values=past, use_cache=True)
        past, last = out.past_key_values, out.logits[0, -1].float()
    return OracleResult(ids, tokens, topk, prompt_logprobs=[])


def correctness(subject: Subject, device: str, steps: int, runs: dict[str, tuple[str, dict]]) -> list[dict]:
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from oracle import ORACLE_PROMPTS

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tokenizer, model = subject.hf_tokenizer(), subject.hf_model(torch.float32, device)
    with torch.inference_mode():
        refs = [_hf_greedy(model, tokenizer(prompt).input_ids, steps, device) for prompt in ORACLE_PROMPTS]
    del model
    _release()

    def run(kernels: str, settings: dict, check: str) -> dict:
        llm = _kvpilot(subject, device, "float32", kernels, **settings)
        _, tokens, topks = _greedy_run(llm, ORACLE_PROMPTS, steps)
        llm.engine.close()
        return _verdict(check, tokens, topks, refs)

    return [_guarded(f"fp32 greedy vs HF, kvpilot {name}", partial(run, kernels, settings, f"fp32 greedy vs HF, kvpilot {name}"))
            for name, (kernels, settings) in runs.items()]


def _moe_check(device: str, work: Path, steps: int) -> dict:
    """The tests' tiny Qwen3-MoE (8 experts, two a token, a dense second layer; tests/checkpoint_factory.py, with the bundled
    tokenizer): kvpilot's fp32 greedy tokens — the fused experts in Triton on CUDA — against HF's on the device."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from checkpoint_factory import CASES, build_checkpoint
    from oracle import ORACLE_PROMPTS

    directory = build_checkpoint(CASES["qwen3moe"], work / "qwen3moe", TOKENIZER if TOKENIZER.is_dir() else write_tokenizer(work / "tokenizer"))
    llm = _kvpilot(Subject("qwen3moe", directory, {}, None, {}, ()), device, "float32", "default")
    _, tokens, topks = _greedy_run(llm, ORACLE_PROMPTS[:4], steps)
    llm.engine.close()
    del llm
    _release()
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    with torch.inference_mode():
        refs = [_hf_greedy(model, tokenizer(prompt).input_ids, steps, device) for prompt in ORACLE_PROMPTS[:4]]
    del model
    _release()
    return _verdict("Qwen3-MoE (tiny, 8 experts) fp32 greedy vs HF", tokens, topks, refs)


def _release() -> None:
    """Hand a closed engine's or a dropped model's device memory back (an 8B-shaped one is 16-32 GB: the next one's
    KV cache is sized from what is free)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _verdict(check: str, tokens: list[list[int]], topks: list[list[list[int]]], refs) -> dict:
    """A check's row by the project's greedy rule (all but one token exact, the first divergence inside the other's top 5)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from oracle import compare_greedy

    verdict = compare_greedy(tokens, topks, refs)
    return {"check": check, "result": f"{verdict['exact']}/{verdict['total']} exact, violations {verdict['violations']}",
            "pass": verdict["exact"] >= verdict["total"] - 1 and not verdict["violations"]}


def _greedy_run(llm, prompts, steps: int, **request):
    """(the OracleResults of a greedy run, as the rule compares them, and its tokens and top-5s)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from kvpilot.server import SamplingParams
    from oracle import TOPK, OracleResult

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=TOPK), **request)
    tokens = [o.outputs[0].token_ids for o in outs]
    topks = [[sorted(e, key=e.get, reverse=True)[:TOPK] for e in o.outputs[0].logprobs] for o in outs]
    return [OracleResult(o.prompt_token_ids, t, k, []) for o, t, k in zip(outs, tokens, topks)], tokens, topks


def feature_checks(subject: Subject, device: str, steps: int) -> list[dict]:
    """The features the defaults switch on beside plain decoding, on the device in float32: EAGLE-3 with a random head
    (greedy equal to plain decoding: speculation changes no token; on CUDA its pass runs in the decode graphs), the FP8 KV
    cache (mean KL of its next-token distributions from the float32 cache's ≤ 1e-2), a LoRA adapter (the default
    kernels' tokens — Triton's on CUDA — equal the torch reference kernels', and differ from the base model's), structured
    outputs (a JSON schema's output parses and matches it), a mixture of experts (the tests' tiny Qwen3-MoE against HF), the
    host KV tier (a prompt evicted from the device's cache comes back from host memory — the pinned side stream on CUDA —
    with the same tokens)."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from eagle_factory import write_eagle3_head
    from kvpilot.server import SamplingParams
    from kvpilot.server.adapters import LoRARequest
    from kvpilot.server.engine.sampling_params import StructuredOutput
    from lora_factory import save_adapter
    from oracle import ORACLE_PROMPTS

    work, prompts = Path(tempfile.mkdtemp()), ORACLE_PROMPTS[:4]
    plain = _kvpilot(subject, device, "float32", "default")
    refs, _, _ = _greedy_run(plain, prompts, steps)
    text = plain.engine.tokenizer.encode(" ".join(ORACLE_PROMPTS))
    float_logits = plain.engine.worker.score(text).float()
    plain.engine.close()
    del plain
    _release()

    def closed(llm, result):
        llm.engine.close()
        return result

    def eagle3() -> dict:
        head = write_eagle3_head(work / "eagle3", subject.config, seed=1)
        llm = _kvpilot(subject, device, "float32", "default", speculative_method="eagle3", speculative_model=str(head), num_speculative_tokens=3)
        _, tokens, topks = _greedy_run(llm, prompts, steps)
        return closed(llm, _verdict("EAGLE-3 (random head, 3 tokens) greedy vs plain", tokens, topks, refs))

    def fp8_kv() -> dict:
        llm = _kvpilot(subject, device, "float32", "default", kv_cache_dtype="fp8")
        logits = llm.engine.worker.score(text).float()
        kl = torch.nn.functional.kl_div(logits.log_softmax(-1), float_logits.log_softmax(-1), log_target=True, reduction="batchmean").item()
        return closed(llm, {"check": "FP8 KV cache vs float32 cache", "result": f"mean KL {kl:.2e} over {len(text)} positions (bound 1e-2)",
                            "pass": kl <= 1e-2})

    def lora() -> dict:
        base = subject.hf_model(torch.float32, "cpu")  # (peft adapts a copy on the host; the engine reads the saved files)
        _, adapter = save_adapter(base, "all7-r8", work / "lora")
        request = {"lora_request": LoRARequest("all7-r8", 1, str(adapter))}
        by_kernels = {}
        for kernels in ("default", "reference"):
            llm = _kvpilot(subject, device, "float32", kernels, enable_lora=True, max_loras=1, max_lora_rank=8)
            by_kernels[kernels] = closed(llm, _greedy_run(llm, prompts, steps, **request))
            del llm
            _release()
        row = _verdict("LoRA (rank 8, 7 targets): default kernels vs reference kernels", *by_kernels["default"][1:], by_kernels["reference"][0])
        moved = sum(a != r.tokens for a, r in zip(by_kernels["default"][1], refs))
        return {**row, "result": f"{row['result']}; {moved} of {len(prompts)} prompts differ from the base model's", "pass": row["pass"] and moved > 0}

    def structured() -> dict:
        schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
                  "required": ["answer", "sure"], "additionalProperties": False}
        llm = _kvpilot(subject, device, "float32", "default")
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, structured=StructuredOutput("json", schema)))
        valid = 0
        for o in outs:
            try:
                value = json.loads(o.outputs[0].text)
                valid += set(value) == {"answer", "sure"} and value["answer"] in ("yes", "no") and isinstance(value["sure"], bool)
            except ValueError:
                pass
        return closed(llm, {"check": "structured outputs (a JSON schema)", "result": f"{valid}/{len(outs)} outputs parse and match it",
                            "pass": valid == len(outs)})

    def host_tier() -> dict:
        # 6 MiB of float32 K/V: 8 blocks of 16 tokens, a prompt and its output, so that the later prompts evict the first
        llm = _kvpilot(subject, device, "float32", "default", kv_cache_memory="6MiB", kv_host_offload_size="64MiB")
        long_prompts = [" ".join(ORACLE_PROMPTS[i:i + 3]) for i in range(0, 9, 3)]  # (several full blocks each)
        first = [_greedy_run(llm, [p], steps)[1][0] for p in long_prompts]  # (one at a time: the later ones evict the first)
        llm.engine.kv_connector.drain()
        again = _greedy_run(llm, long_prompts[:1], steps)[1][0]
        hits = llm.engine.kv_connector.host.stats.hit_blocks
        return closed(llm, {"check": "host KV tier: an evicted prompt back from host memory", "result": f"{hits} blocks hit, tokens "
                            f"{'equal' if again == first[0] else 'differ'}", "pass": hits > 0 and again == first[0]})

    checks = {"EAGLE-3 (random head, 3 tokens) greedy vs plain": eagle3, "FP8 KV cache vs float32 cache": fp8_kv,
              "LoRA (rank 8, 7 targets): default kernels vs reference kernels": lora, "structured outputs (a JSON schema)": structured,
              "Qwen3-MoE (tiny, 8 experts) fp32 greedy vs HF": partial(_moe_check, device, work, steps),
              "host KV tier: an evicted prompt back from host memory": host_tier}
    return [_guarded(name, check) for name, check in checks.items()]


def _guarded_rows(name: str, checks) -> list[dict]:
    """A part's rows, or one failing row naming what it raised."""
    rows = _guarded(name, checks)
    return rows if isinstance(rows, list) else [rows]


def _guarded(name: str, check) -> dict:
    """A check's row, or a failing one naming what it raised: a device run goes on to the next check (its minutes are few)."""
    try:
        return check()
    except Exception as e:  # (any failure is this check's result)
        return {"check": name, "result": f"raised {type(e).__name__}: {str(e)[:300]}", "pass": False}
    finally:
        _release()


def half_kernels(device: str) -> list[dict]:
    """Each Triton kernel in bfloat16 (float16 in Triton's interpreter on a CPU, whose bfloat16 is broken: the smoke test)
    against its float32 torch reference."""
    import torch

    from kvpilot.kernels import ops, triton_attention, triton_layers
    from kvpilot.kernels.paged_attention import decode_attention_ref

    g = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    rows = []
    half = torch.bfloat16 if device == "cuda" else torch.float16
    label = "bf16" if half == torch.bfloat16 else "fp16"

    def check(name: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
        err = (got.float() - want.float()).abs().max().item()
        rows.append({"check": f"{label} {name} vs fp32 reference", "result": f"max |error| {err:.2e} (tolerance {atol:g})", "pass": err <= atol})

    x, w = rnd(64, 576), rnd(576)
    check("rms_norm", triton_layers.rms_norm(x.to(half), w.to(half), 1e-5), ops.rms_norm_ref(x, w, 1e-5), 0.1)
    heads, kv_heads, d, bs, blocks = 9, 3, 64, 16, 64
    q, k, v = rnd(8, heads, d), rnd(blocks, bs, kv_heads, d), rnd(blocks, bs, kv_heads, d)
    tables = torch.randperm(blocks, generator=g)[:8 * 8].reshape(8, 8).to(device)
    lens = torch.tensor([1, 5, 16, 17, 63, 100, 127, 128], device=device)
    want = decode_attention_ref(q, k, v, tables, lens, d ** -0.5)
    check("paged decode attention", triton_attention.paged_decode_attention(q.to(half), k.to(half), v.to(half), tables, lens, d ** -0.5), want, 0.05)
    check("paged decode attention (split-K)", triton_attention.paged_decode_attention(q.to(half), k.to(half), v.to(half), tables, lens,
                                                                                     d ** -0.5, split_tokens=32), want, 0.05)
    # Prefill: the 8 sequences' last n tokens as queries (n up to the context: plain and after a prefix).
    new = torch.tensor([1, 5, 16, 3, 63, 100, 20, 128], device=device)
    starts = torch.cumsum(new, 0) - new
    qp = rnd(int(new.sum()), heads, d)
    want = torch.cat([decode_attention_ref(qp[s:s + n], k, v, tables[i:i + 1].expand(n, -1), torch.arange(ctx - n + 1, ctx + 1, device=device),
                                           d ** -0.5) for i, (s, n, ctx) in enumerate(zip(starts.tolist(), new.tolist(), lens.tolist()))])
    check("paged prefill attention", triton_attention.paged_prefill_attention(qp.to(half), k.to(half), v.to(half), tables, starts, new,
                                                                              lens, d ** -0.5, int(new.max())), want, 0.05)
    qkv = rnd(8, (heads + 2 * kv_heads) * d)
    positions = torch.arange(8, device=device) * 37
    angles = torch.arange(2048, device=device)[:, None].float() * (10000 ** (-torch.arange(0, d, 2, device=device).float() / d))
    rope = ops.Rope(positions, angles.cos(), angles.sin(), torch.float32)
    ref = qkv.clone()
    ops.rotary_qkv_ref_(ref, rope, heads, kv_heads, d)
    got = qkv.to(half)
    triton_layers.rotary_qkv_(got, ops.Rope(positions, angles.cos(), angles.sin(), half), heads, kv_heads, d)
    check("rotary_qkv_", got, ref, 0.05)
    failed = _guarded(f"{label} kernels written since the last GPU run", partial(_newer_kernels, device, half, rnd, check))
    return rows + ([failed] if failed else [])


def _newer_kernels(device: str, half, rnd, check) -> None:
    """The kernels written after the last GPU run: the GGUF-block matmul (Q4_1) and FP8 W8A8 (on FP8 tensor cores where the
    GPU has them), the LoRA shrink/expand, the fused experts on dense and on Q4_1-block experts."""
    import torch

    from kvpilot.kernels.fused_moe import ExpertBlocks, Experts, fused_experts_reference, route
    from kvpilot.kernels.lora import LoRABatch, lora_add_ref_
    from kvpilot.kernels.quantized import FP8Activations, GGUFWeight, cat_rows, quantize_int4
    from kvpilot.kernels.triton_gguf import fp8_activations, gguf_linear
    from kvpilot.kernels.triton_lora import lora_add_
    from kvpilot.kernels.triton_moe import fused_experts

    x, w = rnd(16, 256), rnd(96, 256) * 0.05
    q4 = quantize_int4(w, 32)
    check("gguf_linear Q4_1", gguf_linear(x.to(half), q4), x @ q4.dequantize().T, 0.05)
    codes = torch.randint(0, 256, (96, 256), dtype=torch.uint8, generator=torch.Generator().manual_seed(2)).to(device)
    f8 = GGUFWeight("F8", codes & 0x77, torch.rand(96, 8, device=device) * 1e-2, act=FP8Activations())  # (& 0x77: no NaN bytes)
    check("gguf_linear F8 W8A8", gguf_linear(x.to(half), f8), fp8_activations(x.to(half).float(), f8.act) @ f8.dequantize().T, 0.05)
    slots = torch.tensor([0, 1, -1, 1] * 4, device=device)
    a, b = rnd(2, 256, 8) * 0.1, rnd(2, 8, 96) * 0.1
    want = torch.zeros(16, 96, device=device)
    lora_add_ref_(want, x, a, b, LoRABatch(slots, None))
    got = torch.zeros(16, 96, device=device, dtype=half)
    lora_add_(got, x.to(half), a.to(half).contiguous(), b.to(half).contiguous(), LoRABatch(slots, None))
    check("lora_add_ (2 slots, rank 8)", got, want, 0.02)
    experts, inner, hidden = 8, 64, 256
    w13, w2 = rnd(experts, 2 * inner, hidden) * hidden ** -0.5, rnd(experts, hidden, inner) * inner ** -0.5
    weights, ids = route(rnd(16, experts), 2, renormalize=True)
    want = fused_experts_reference(x, Experts(inner, w13, w2), weights, ids)
    check("fused_experts (dense)", fused_experts(x.to(half), Experts(inner, w13.to(half), w2.to(half)), weights, ids), want, 0.05)
    gate, up, down = ([quantize_int4(m, 32) for m in ws] for ws in (w13[:, :inner], w13[:, inner:], w2))
    blocks = Experts(inner, blocks=(ExpertBlocks.of([cat_rows([g, u]) for g, u in zip(gate, up)]), ExpertBlocks.of(down)))
    check("fused_experts (Q4_1 blocks)", fused_experts(x.to(half), blocks, weights, ids), fused_experts_reference(x, blocks, weights, ids), 0.05)


def _timed(fn) -> float:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t


def kvpilot_rates(subject: Subject, device: str, kernels: str, engine_settings: dict, workloads: dict, deadline: float) -> dict[str, tuple[str, int]]:
    """Output tok/s per workload, with the weight bytes a decode step reads. A workload still running after `deadline`
    seconds is stopped there and its rate is of the tokens made so far (marked "stopped"): a device command has ten minutes."""
    import torch

    from kvpilot.server import SamplingParams

    rates = {}
    for name, (prompts, outputs, max_seqs) in workloads.items():
        llm = _kvpilot(subject, device, "auto", kernels, max_num_seqs=max_seqs, max_num_batched_tokens=max(2048, max(map(len, prompts))),
                       **engine_settings)
        llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4))  # warm-up (Triton compiles here)
        engine, made = llm.engine, {}
        for p, o in zip(prompts, outputs):
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=o, ignore_eos=True))
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        while engine.has_unfinished_requests() and time.perf_counter() - t < deadline:
            for out in engine.step():
                made[out.request_id] = len(out.outputs[0].token_ids)
        if device == "cuda":
            torch.cuda.synchronize()
        dt, stopped = time.perf_counter() - t, engine.has_unfinished_requests()
        rates[name] = (f"{sum(made.values()) / dt:.0f}" + (f" (stopped at {deadline:.0f} s)" if stopped else ""), decode_weight_bytes(llm))
        engine.close()
        del llm, engine
        _release()
    return rates


def hf_rates(subject: Subject, device: str, workloads: dict, batch: dict[str, int]) -> dict[str, float]:
    import torch

    model = subject.hf_model(torch.bfloat16 if device == "cuda" else torch.float32, device)
    rates = {}
    with torch.inference_mode():
        for name, (prompts, outputs, _) in workloads.items():
            rates[name] = sum(outputs) / _timed(partial(_hf_static_batches, model, prompts, outputs, batch[name], device))
    del model
    _release()
    return rates


def _hf_static_batches(model, prompts: list[list[int]], outputs: list[int], bs: int, device: str) -> None:
    """HF generate over batches of `bs` prompts of similar length (left-padded), each to its longest output."""
    import torch

    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    for start in range(0, len(order), bs):
        idx = order[start:start + bs]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.tensor([[0] * (width - len(prompts[i])) + prompts[i] for i in idx], device=device)
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx], device=device)
        steps = max(outputs[i] for i in idx)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                       eos_token_id=None, pad_token_id=0)


# Llama-3-8B's projections (N, K): fused QKV, o, fused gate/up, down.
LLAMA3_8B_LAYER = {"qkv 6144x4096": (6144, 4096), "o 4096x4096": (4096, 4096), "gate_up 28672x4096": (28672, 4096),
                   "down 4096x14336": (4096, 14336)}


def quantized_matmul_rows(device: str, shapes: dict[str, tuple[int, int]], rows: list[int], iters: int) -> list[dict]:
    """The quantization issue's GPU micro-benchmark: the Triton GGUF-block kernel (int4 = Q4_1 group 32,
    int8 = Q8_0, and the K-quant layouts the loader makes of a Q4_K_M file: Q4_K as K4 — nibbles, float32
    scale and min per 32 —, Q6_K as K8 — int8 codes, float32 scale per 16; the pre-quantized checkpoints' Z4
    — a GPTQ/AWQ asymmetric 4-bit weight, byte zero points — and F8 — FP8 E4M3 bytes, weight-only and with
    dynamic per-token FP8 activations) against the bf16 matmul
    (F.linear) at M activation rows, weights generated on the device; µs per call (the median of 5 timings of `iters` back-to-back calls: a single call timed
    between two synchronisations would mostly measure the launch and the sync), and the speed-up over
    bf16."""
    import torch
    import torch.nn.functional as F

    from kvpilot.kernels.quantized import FP8Activations, GGUFWeight, quantize_int4, quantize_int8
    from kvpilot.kernels.triton_gguf import gguf_linear

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=dtype) * 0.02
        forms = {"bf16" if device == "cuda" else "fp32": partial(F.linear, weight=w)}
        rand = lambda cols: torch.rand(n, cols, device=device) * 1e-3  # noqa: E731, B023 — used in this iteration only
        codes = lambda cols: torch.randint(0, 256, (n, cols), device=device, dtype=torch.uint8)  # noqa: E731, B023
        for label, quantized in (("int4", quantize_int4(w, 32)), ("int8", quantize_int8(w)),
                                 ("Q4_K", GGUFWeight("Q4_K", codes(k // 2), rand(k // 32), -rand(k // 32))),
                                 ("Q6_K", GGUFWeight("Q6_K", codes(k), rand(k // 16))),
                                 ("Z4", GGUFWeight("Z4", codes(k // 2), rand(k // 32).half(), codes(k // 32) & 0x0F)),
                                 ("F8", GGUFWeight("F8", codes(k) & 0x77, rand(k // 32))),  # (& 0x77: no NaN bytes)
                                 ("F8 W8A8", GGUFWeight("F8", codes(k) & 0x77, rand(k // 32), act=FP8Activations()))):
            forms[label] = partial(gguf_linear, w=quantized)
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=dtype)
            times = {}
            for label, fn in forms.items():
                fn(x)  # compile / warm up
                samples = sorted(_timed(partial(_repeat, partial(fn, x), iters)) / iters for _ in range(5))
                times[label] = samples[2] * 1e6
            base = next(iter(times.values()))
            out.append({"shape": name, "M": m, **{f"{label} µs": f"{t:.1f}" for label, t in times.items()},
                        **{f"{label} speed-up": f"{base / t:.2f}x" for label, t in list(times.items())[1:]}})
        del w, forms
    return out


def graph_step_rates(c, device: str, batches: list[int], context: int, steps: int) -> tuple[dict[int, float], int]:
    """A plain-PyTorch decode step of the model's shapes (ModelConfig `c`) — fused QKV and gate/up matmuls, RMSNorm, RoPE
    on q and k, SDPA with GQA over a static [B, kv_heads, context, d] cache, the head and a
    sample (Gumbel-max at temperature 0.8) — captured as one CUDA graph (eager on CPU): (tokens per
    second at each batch size, the weight bytes a step reads)."""
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(1)  # (made on the device: an 8B-shaped step's 16 GB never on the host)
    mat = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=dtype).mul_(0.02)  # noqa: E731
    d, h, kvh = c.head_dim, c.num_heads, c.num_kv_heads
    layers = [(mat((h + 2 * kvh) * d, c.hidden_size), mat(c.hidden_size, h * d), mat(2 * c.intermediate_size, c.hidden_size),
               mat(c.hidden_size, c.intermediate_size)) for _ in range(c.num_layers)]
    head = mat(c.vocab_size, c.hidden_size)
    norm = torch.ones(c.hidden_size, device=device, dtype=dtype)
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, device=device).float() / d))
    model = (c, layers, head, norm, inv, dtype)
    read = sum(w.numel() * w.element_size() for layer in layers for w in layer) + head.numel() * head.element_size()
    return {batch: _graph_step_rate(model, batch, context, steps, device) for batch in batches}, read


def _graph_step_rate(model: tuple, batch: int, context: int, steps: int, device: str) -> float:
    import torch
    import torch.nn.functional as F

    c, layers, head, norm, inv, dtype = model
    d, h, kvh = c.head_dim, c.num_heads, c.num_kv_heads
    caches = [(torch.zeros(batch, kvh, context, d, device=device, dtype=dtype), torch.zeros(batch, kvh, context, d, device=device, dtype=dtype))
              for _ in range(c.num_layers)]
    token = torch.zeros(batch, dtype=torch.long, device=device)
    pos = torch.full((batch,), context - 1, dtype=torch.long, device=device)

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def step() -> None:
        x = F.embedding(token, head)
        angle = pos[:, None].float() * inv
        cos, sin = angle.cos().to(dtype)[:, None, :], angle.sin().to(dtype)[:, None, :]
        for (wqkv, wo, wgu, wd), (kc, vc) in zip(layers, caches):
            qkv = F.linear(F.rms_norm(x, (c.hidden_size,), norm, 1e-5), wqkv)
            q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
            q, k = rotate(q.view(batch, h, d), cos, sin), rotate(k.view(batch, kvh, d), cos, sin)
            kc[:, :, -1] = k
            vc[:, :, -1] = v.view(batch, kvh, d)
            a = F.scaled_dot_product_attention(q[:, :, None], kc, vc, enable_gqa=True)
            x = x + F.linear(a.reshape(batch, h * d), wo)
            gate, up = F.linear(F.rms_norm(x, (c.hidden_size,), norm, 1e-5), wgu).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, wd)
        logits = F.linear(F.rms_norm(x, (c.hidden_size,), norm, 1e-5), head).float()
        noise = -torch.log(-torch.log(torch.rand_like(logits).clamp_(min=1e-10)))  # Gumbel-max: a sample at temperature 0.8
        token.copy_((logits / 0.8 + noise).argmax(-1))
        pos.add_(1).clamp_(max=context - 1)

    with torch.inference_mode():
        if device == "cuda":
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            replay = graph.replay
        else:
            replay = step
        replay()
        return batch * steps / _timed(partial(_repeat, replay, steps))


def _repeat(fn, times: int) -> None:
    for _ in range(times):
        fn()


def run(args: argparse.Namespace) -> None:
    if args.device == "cpu":  # the Triton kernels on CPU tensors: only in Triton's interpreter (set before triton loads)
        os.environ["TRITON_INTERPRET"] = "1"
    _import_kvpilot()
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from common import offline_workload, table

    device, quick = args.device, args.quick
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: `bench/gpu.py run --quick --device cpu` is the smoke test")
    model = subject(args.model_shape, Path(tempfile.mkdtemp()), quick)
    spec = WORKLOADS[args.model_shape]
    workloads = {name: (*offline_workload(min(n, 3) if quick else n, seed=i, prompt=(8, 16) if quick else prompt,
                                          output=(2, 4) if quick else output), max_seqs)
                 for i, (name, ((n, prompt, output, max_seqs), _)) in enumerate(spec.items())}
    bandwidth = copy_bandwidth(device)

    def against_roofline(row: dict, rate: float, read: int) -> dict:
        roofline = bandwidth / read
        return {**row, "roofline tok/s": f"{roofline:.0f}", "of roofline": f"{rate / roofline:.0%}"}

    parts = set(args.only or PARTS)
    checks, rows = [], []
    if "checks" in parts:
        checked = {name: model.runs[name] for name in model.checked} | {"reference kernels": ("reference", {})}
        checks = correctness(model, device, 64 if not quick else 4, checked)
        if not model.dummy:  # (the features on the bundled shapes: an 8B-shaped copy of each would not add to what they check)
            checks += _guarded_rows("feature checks", partial(feature_checks, model, device, 32 if not quick else 4))
        checks += _guarded_rows("half-precision kernels", partial(half_kernels, device))
        print(table(checks, ["check", "result", "pass"]), flush=True)
    if "kvpilot" in parts:
        for run_name, (kernels, settings) in model.runs.items():
            for name, (rate, read) in kvpilot_rates(model, device, kernels, settings, workloads, args.deadline).items():
                row = {"engine": f"kvpilot ({run_name})", "workload": name, "output tok/s": rate}
                rows.append(against_roofline(row, float(rate.split()[0]), read) if name == SINGLE_STREAM else row)
    if "hf" in parts:
        batches = {name: batch for name, (_, batch) in spec.items()}
        for name, rate in hf_rates(model, device, workloads, batches).items():
            rows.append({"engine": f"HF transformers (static batches: {', '.join(map(str, batches.values()))})", "workload": name,
                         "output tok/s": f"{rate:.0f}"})
    if "graph" in parts:
        context = 64 if quick else 1024 if args.model_shape == "smollm2-135m" else 768
        rates, read = graph_step_rates(model.config, device, [1, 2] if quick else [1, 256], context, 3 if quick else 200)
        for batch, rate in rates.items():
            row = {"engine": "plain PyTorch decode step, CUDA graph (RoPE, sampling)", "workload": f"batch {batch}, context {context}",
                   "output tok/s": f"{rate:.0f}"}
            rows.append(against_roofline(row, rate, read) if batch == 1 else row)
    quant = []
    if "quant" in parts:
        shapes = {"small 256x128": (256, 128)} if quick else LLAMA3_8B_LAYER
        quant = quantized_matmul_rows(device, shapes, [1, 2] if quick else [1, 16], 3 if quick else 50)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}, model shape {args.model_shape}, copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    if rows:
        print(table(rows, ["engine", "workload", "output tok/s", "roofline tok/s", "of roofline"]))
    if quant:
        print(table(quant, list(quant[0])))
    out = args.json or (Path(os.environ["OUT"], f"gpu_bench-{args.model_shape}.json") if os.environ.get("OUT") else None)
    if out:
        Path(out).write_text(json.dumps({"device": name, "torch": torch.__version__, "model_shape": args.model_shape, "quick": quick,
                                         "copy_bandwidth_bytes_per_s": bandwidth, "checks": checks, "rates": rows, "quantized_matmul": quant},
                                        indent=1))
    if not all(c["pass"] for c in checks):
        raise SystemExit("a correctness check failed (table above)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("bundle", help="here: write .gpu/ (metadata skeleton + wheels) for the GPU machine")
    r = sub.add_parser("run", help="there: build the random-weight GGUF, check correctness, measure")
    r.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    r.add_argument("--quick", action="store_true", help="tiny workloads: a smoke test of this script")
    r.add_argument("--only", action="append", choices=PARTS, help="run only these parts (repeatable; default all): to split the "
                   "work over several device commands of ten minutes each")
    r.add_argument("--deadline", type=float, default=75.0, help="seconds a kvpilot workload may run before it is stopped and rated")
    r.add_argument("--model-shape", default="smollm2-135m", choices=list(WORKLOADS),
                   help="smollm2-135m: the bundled model's shapes in a random-weight GGUF; llama3-8b: Llama-3-8B's, dummy weights")
    r.add_argument("--json", help="write every figure here (default: $OUT/gpu_bench-<shape>.json where $OUT is set)")
    args = ap.parse_args()
    if args.command == "bundle":
        bundle()
    else:
        run(args)


if __name__ == "__main__":
    main()
