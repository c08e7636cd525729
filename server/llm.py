"""Offline API shaped like vLLM's: `LLM(model=…, **engine_args).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from kvpilot.server.adapters import LoRARequest
from kvpilot.server.config import EngineConfig
from kvpilot.server.engine.llm_engine import LLMEngine
from kvpilot.server.engine.outputs import RequestOutput
from kvpilot.server.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str = "smollm2-135m", show_progress: bool = True, **engine_args: Any):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args), show_progress=show_progress)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (batched by the scheduler); outputs come back in prompt order.
        lora_request: the LoRA adapter of every prompt, or one per prompt (None: the base model)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        adapters = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(adapters) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(adapters)} lora requests")
        ids = [self.engine.add_request(p, sp, lora_request=lr) for p, sp, lr in zip(prompts, params, adapters)]
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req")
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar:
                bar.close()
        return [done[rid] for rid in ids]

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Chat through the model's template; one conversation or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)
