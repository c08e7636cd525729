"""Tiny random LoRA adapters of the bundled model, made and saved by Hugging Face `peft` itself
(adapter_config.json + adapter_model.safetensors), and peft's own greedy outputs with them: the
oracle of the LoRA tests (nothing can be downloaded).

peft's default initialisation makes B zero (an adapter that changes nothing): A and B are drawn here
instead, seeded, B at a scale that changes the base model's greedy continuation of most prompts
without turning it into noise (near-ties would make the comparison a test of rounding).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

from kvpilot.kernels.cache import cache_root
from oracle import TOPK, OracleResult

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> peft LoraConfig arguments (and how far B moves the outputs): three ranks, rsLoRA, subsets of targets
SPECS = {
    "all7-r8": dict(r=8, lora_alpha=16, target_modules=SEVEN),
    "qv-r4-rslora": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "mixed-r16": dict(r=16, lora_alpha=16, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}
B_STD = 0.04
STEPS = 24  # greedy tokens compared per prompt


def save_adapter(base_model, name: str, dest: Path, seed: int = 0):
    """The peft model of one adapter (base_model untouched: a copy is adapted) and its saved directory."""
    import torch
    from peft import LoraConfig, get_peft_model

    spec = SPECS[name]
    model = get_peft_model(copy.deepcopy(base_model), LoraConfig(init_lora_weights=False, **spec)).eval()
    g = torch.Generator().manual_seed(seed + sum(map(ord, name)))
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_A" in pname:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[1] ** -0.5)
            elif "lora_B" in pname:
                p.copy_(torch.randn(p.shape, generator=g) * B_STD)
    model.save_pretrained(str(dest / name))
    return model, dest / name


def peft_greedy(model, prompt_ids: list[list[int]], steps: int, logprob_prompts: set[int]) -> list[OracleResult]:
    """peft's greedy continuations of all prompts in one left-padded batch (transformers' generate; the
    engine's comparison rule tolerates the padding's rounding), top-5 at each step, and the prompt
    logprobs of the prompts in logprob_prompts (one unpadded forward each)."""
    import torch

    width = max(map(len, prompt_ids))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompt_ids])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        topk = torch.stack([torch.topk(lg.float(), TOPK).indices for lg in out.logits], dim=1)  # [prompts, steps, 5]
        results = []
        for i, p in enumerate(prompt_ids):
            prompt_lps = []
            if i in logprob_prompts:
                lps = torch.log_softmax(model(input_ids=torch.tensor([p])).logits[0].float(), -1)
                prompt_lps = [float(lps[j, p[j + 1]]) for j in range(len(p) - 1)]
            results.append(OracleResult(p, out.sequences[i, width:].tolist(), topk[i].tolist(), prompt_lps))
    return results


def peft_outputs(base_model, model_sha: str, prompt_ids: list[list[int]], steps: int, dest: Path,
                 logprob_prompts: set[int] = frozenset({7})) -> tuple[dict[str, Path], dict[str, list[OracleResult]]]:
    """Every adapter of SPECS saved under dest, and peft's greedy results for each prompt (cached
    outside the repo by the versions, the model, the specs and the prompts)."""
    import peft
    import torch
    import transformers

    key = hashlib.sha256(json.dumps([peft.__version__, transformers.__version__, torch.__version__, model_sha, SPECS, B_STD,
                                     prompt_ids, steps, sorted(logprob_prompts)]).encode()).hexdigest()[:24]
    cached = cache_root() / "oracle" / f"lora-{key}.json"
    known = json.loads(cached.read_text()) if cached.is_file() else None
    paths, results = {}, {}
    for name in SPECS:
        model, paths[name] = save_adapter(base_model, name, dest)
        if known is not None:
            results[name] = [OracleResult(**r) for r in known[name]]
        else:
            results[name] = peft_greedy(model, prompt_ids, steps, logprob_prompts)
        del model
    if known is None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")  # pytest-xdist workers may fill the same entry at once
        tmp.write_text(json.dumps({n: [asdict(r) for r in rs] for n, rs in results.items()}))
        tmp.replace(cached)
    return paths, results
