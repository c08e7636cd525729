"""kvpilot's inference engine and its server.

`LLM` and `SamplingParams` are exported lazily so that `import kvpilot.server.config` (used by the
operator) never pulls in torch.
"""

from typing import Any

__all__ = ["LLM", "SamplingParams", "EngineConfig"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvpilot.server.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvpilot.server.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from kvpilot.server.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
