"""The HF transformers oracle: greedy continuations, top-5 alternatives and prompt logprobs for the
bundled GGUF, computed one prompt at a time in fp32 with no padding, cached outside the repo.

Cache key: transformers + torch versions, the model file's sha256, the prompts and the step count.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpilot.kernels.cache import cache_root

# Fixed before the first run: varied lengths, languages, code, chat-formatted and plain text.
ORACLE_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village at the edge of a dark forest, there lived",
    "1, 2, 3, 5, 8, 13,",
    "Les étudiants de l'université ont organisé une manifestation pour",
    "<|im_start|>system\nYou are a terse assistant.<|im_end|>\n<|im_start|>user\nList three primary colors.<|im_end|>\n<|im_start|>assistant\n",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to synthesize foods from carbon dioxide and water. In plants, photosynthesis generally involves",
    "SELECT name, COUNT(*) FROM orders WHERE",
    "   Indented text with   odd   spacing and a tab\tthen",
]
ORACLE_STEPS = 64
TOPK = 5


@dataclass
class OracleResult:
    prompt_ids: list[int]
    tokens: list[int]                 # greedy continuation
    topk: list[list[int]]             # top-5 token ids at each generated position
    prompt_logprobs: list[float]      # logprob of prompt token j+1 given tokens ≤ j


class HFOracle:
    def __init__(self, model_path: Path):
        self.model_path = model_path
        self._model = None
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_path.parent), gguf_file=self.model_path.name)
        return self._tokenizer

    @property
    def model(self):
        if self._model is None:
            import torch
            from transformers import AutoModelForCausalLM

            self._model = AutoModelForCausalLM.from_pretrained(
                str(self.model_path.parent), gguf_file=self.model_path.name, dtype=torch.float32).eval()
        return self._model

    def _key(self, prompts: list[str], steps: int) -> str:
        import torch
        import transformers

        h = hashlib.sha256()
        with open(self.model_path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        h.update(json.dumps([transformers.__version__, torch.__version__, prompts, steps, TOPK]).encode())
        return h.hexdigest()[:24]

    def run(self, prompts: list[str] = ORACLE_PROMPTS, steps: int = ORACLE_STEPS) -> list[OracleResult]:
        path = cache_root() / "oracle" / f"greedy-{self._key(prompts, steps)}.json"
        if path.is_file():
            return [OracleResult(**r) for r in json.loads(path.read_text())]
        results = [self._greedy(p, steps) for p in prompts]
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # pytest-xdist workers may fill the same entry at once
        tmp.write_text(json.dumps([r.__dict__ for r in results]))
        tmp.replace(path)
        return results

    def _greedy(self, prompt: str, steps: int) -> OracleResult:
        return hf_greedy(self.model, self.tokenizer(prompt).input_ids, steps)


def hf_greedy(model, ids: list[int], steps: int) -> OracleResult:
    """A transformers (or peft) model's greedy continuation of one unpadded prompt, with the top-5 at
    each step and the prompt's logprobs."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        lps = torch.log_softmax(out.logits[0].float(), -1)
        prompt_lps = [float(lps[j, ids[j + 1]]) for j in range(len(ids) - 1)]
        past, last = out.past_key_values, lps[-1]
        tokens, topk = [], []
        for _ in range(steps):
            topk.append(torch.topk(last, TOPK).indices.tolist())
            nxt = int(last.argmax())
            tokens.append(nxt)
            out = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past, last = out.past_key_values, torch.log_softmax(out.logits[0, -1].float(), -1)
    return OracleResult(ids, tokens, topk, prompt_lps)


@pytest.fixture(scope="session")
def hf_oracle_session(model_path):
    return HFOracle(model_path)


def compare_greedy(ours: list[list[int]], ours_topk: list[list[list[int]]], oracle: list[OracleResult]) -> dict:
    """vLLM's rule: count exact matches; at the first divergence each side's token must be in the
    other's top-5. Returns the counts and any rule violations."""
    exact, violations, diverged_at = 0, [], []
    for i, (mine, topk_mine, ref) in enumerate(zip(ours, ours_topk, oracle)):
        if mine == ref.tokens:
            exact += 1
            diverged_at.append(None)
            continue
        j = next(k for k, (a, b) in enumerate(zip(mine, ref.tokens)) if a != b) if len(mine) == len(ref.tokens) else min(len(mine), len(ref.tokens))
        diverged_at.append(j)
        if j >= min(len(mine), len(ref.tokens)) or mine[j] not in ref.topk[j] or ref.tokens[j] not in topk_mine[j]:
            violations.append((i, j))
    return {"exact": exact, "total": len(oracle), "violations": violations, "diverged_at": diverged_at}
