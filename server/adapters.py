"""LoRA adapters as PEFT writes them (adapter_config.json + adapter_model.safetensors): what an adapter
declares, checked before a byte of its weights is read, and where one may be loaded from. torch-free
(the server checks names and paths with it; server/engine/lora.py reads the weights).

Refused by name, never half-applied: DoRA, LoRA biases, modules_to_save, embedding or LM-head
adapters, fan_in_fan_out, layer replication, target_parameters, a pickled adapter_model.bin.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The projections an adapter may target, as transformers names them (q/k/v map onto our fused QKV
# projection, gate/up onto the MLP's).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
# A PEFT adapter_config.json is a few KiB (its fields, and alpha/rank patterns of at most one entry per
# module): a bigger file is not one, and is refused before it is read into memory.
MAX_CONFIG_BYTES = 1 << 20


class AdapterError(ValueError):
    """An adapter the engine will not load, and why (the engine is unaffected); `param`: the field of a
    load request at fault (its name, or by default its path)."""

    def __init__(self, message: str, param: str = "lora_path"):
        super().__init__(message)
        self.param = param


def check_adapter_name(name: str) -> str:
    if not _NAME.fullmatch(name or ""):
        raise AdapterError(f"adapter name {name!r} must be 1-128 characters of letters, digits and . _ : / - (starting with a letter or digit)",
                           "lora_name")
    return name


def parse_lora_module(spec: str) -> tuple[str, str]:
    """`name=path` (vLLM's --lora-modules form) -> (name, path)."""
    name, sep, path = spec.partition("=")
    if not sep or not path:
        raise AdapterError(f"lora module {spec!r} must be name=path")
    return check_adapter_name(name.strip()), path.strip()


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """Which adapter a request runs with (vLLM's offline form): a name, a positive id of the caller's
    choosing (not used: the engine numbers adapters itself) and the adapter's directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    targets: tuple[str, ...]                              # of TARGETS
    alpha_pattern: dict[str, float] = field(default_factory=dict)  # (per-module ranks, rank_pattern, are read from the tensors)

    def scale(self, module: str, rank: int) -> float:
        """The factor B is multiplied by for `module` (its full name, e.g. model.layers.0.self_attn.q_proj)
        of rank `rank`: alpha / rank, or alpha / sqrt(rank) with rsLoRA; alpha from alpha_pattern when a key
        matches the module's name (PEFT's rule: the key matches a suffix of the name at a dot)."""
        alpha = next((v for k, v in self.alpha_pattern.items() if _module_pattern(k).match(module)), self.alpha)
        return alpha / (math.sqrt(rank) if self.use_rslora else rank)


def _refuse_if(condition: object, what: str, where: Path) -> None:
    if condition:
        raise AdapterError(f"{where}: {what} is not supported (refused rather than served differently)")


def _config_bytes(path: Path) -> bytes:
    """The config file's bytes: a regular file of at most MAX_CONFIG_BYTES. Opened without blocking (a
    FIFO would wait for a writer forever) and checked on the open file (not a path that may be swapped)."""
    try:
        with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK)) as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise AdapterError(f"{path} is not a regular file")
            data = f.read(MAX_CONFIG_BYTES + 1)  # the size as read: the file may grow after it is opened
    except FileNotFoundError:
        raise AdapterError(f"{path.parent}: no {ADAPTER_CONFIG} (not a PEFT adapter)") from None
    except OSError as e:
        raise AdapterError(f"{path}: unreadable ({e})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise AdapterError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes (a PEFT adapter config is a few KiB)")
    return data


def read_adapter_config(directory: Path) -> AdapterConfig:
    path = directory / ADAPTER_CONFIG
    data = _config_bytes(path)
    try:
        raw = json.loads(data)
    except RecursionError:
        raise AdapterError(f"{path}: nests deeper than the JSON parser's recursion limit (a PEFT adapter config is a few levels deep)") from None
    except ValueError as e:
        raise AdapterError(f"{path}: unreadable ({e})") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{path}: not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{path}: peft_type {raw.get('peft_type')!r} is not a LoRA adapter")
    _refuse_if(raw.get("use_dora"), "DoRA (use_dora)", path)
    _refuse_if(raw.get("bias", "none") != "none" or raw.get("lora_bias"), "a LoRA bias (bias / lora_bias)", path)
    _refuse_if(raw.get("modules_to_save"), f"modules_to_save {raw.get('modules_to_save')}", path)
    _refuse_if(raw.get("fan_in_fan_out"), "fan_in_fan_out", path)
    _refuse_if(raw.get("layer_replication"), "layer_replication", path)
    _refuse_if(raw.get("target_parameters"), "target_parameters", path)
    _refuse_if(raw.get("trainable_token_indices"), "trainable_token_indices", path)
    _refuse_if(raw.get("alora_invocation_tokens"), "activated LoRA (alora_invocation_tokens)", path)
    _refuse_if(raw.get("use_qalora"), "QA-LoRA (use_qalora)", path)
    rank, alpha = raw.get("r"), raw.get("lora_alpha", 8)
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{path}: r must be a positive integer, got {rank!r}")
    if not _finite_number(alpha):  # JSON as Python writes it may hold Infinity and NaN
        raise AdapterError(f"{path}: lora_alpha must be a finite number, got {alpha!r}")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        # "all-linear" or a regex over module names: the weights file says which projections it reaches
        names = TARGETS
    elif isinstance(targets, list) and all(isinstance(t, str) for t in targets):
        unknown = sorted({t.rsplit(".", 1)[-1] for t in targets} - set(TARGETS))
        if unknown:
            raise AdapterError(f"{path}: target modules {unknown} are not supported (embedding and LM-head adapters are refused; "
                               f"supported: {', '.join(TARGETS)})")
        names = tuple(t for t in TARGETS if t in {x.rsplit('.', 1)[-1] for x in targets})
    else:
        raise AdapterError(f"{path}: target_modules must be a list of module names or a regex, got {targets!r}")
    if not names:
        raise AdapterError(f"{path}: target_modules {targets!r} names none of {', '.join(TARGETS)}")
    alpha_pattern, rank_pattern = raw.get("alpha_pattern") or {}, raw.get("rank_pattern") or {}
    if not isinstance(alpha_pattern, dict) or not isinstance(rank_pattern, dict):
        raise AdapterError(f"{path}: alpha_pattern and rank_pattern must map module names to numbers")
    for key, value in alpha_pattern.items():
        if not _finite_number(value):
            raise AdapterError(f"{path}: alpha_pattern must map module names to finite numbers, got {value!r} for {key!r}")
        try:  # PEFT's keys are regular expressions over module names (AdapterConfig.scale)
            _module_pattern(key)
        except re.error as e:
            raise AdapterError(f"{path}: alpha_pattern key {key!r} is not a regular expression ({e})") from None
    for key, value in rank_pattern.items():  # the ranks served are the tensors' (read_adapter): this is checked, not used
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise AdapterError(f"{path}: rank_pattern must map module names to positive integers, got {value!r} for {key!r}")
    return AdapterConfig(rank, float(alpha), bool(raw.get("use_rslora")), names, alpha_pattern)


def _module_pattern(key: str) -> re.Pattern:
    """An alpha_pattern key as PEFT matches it: a suffix of the module's name, at a dot (compiled as
    used: a key such as "(?i)q_proj" is valid alone, not inside it)."""
    return re.compile(rf"(.*\.)?({key})$")


def _finite_number(x: object) -> bool:
    """A JSON number that is a finite float (Python's JSON reads Infinity, NaN, and integers past float's range)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


FETCHED_DIR = "hf"  # under --lora-dir: where hf:// adapter sources are downloaded to


def adapter_directory(lora_path: str, root: str | Path | None, max_bytes: int, timeout: float = 600) -> Path:
    """Where a load request's `lora_path` is on disk: a directory (under `root` when given), or an
    hf://org/repo source (the model-source grammar) downloaded first into `root`/hf/org/repo — its
    adapter_config.json and adapter_model.safetensors only, at most `max_bytes`. Blocking (network)."""
    if "://" not in lora_path:
        return Path(lora_path)
    from kvpilot.server.fetch import ADAPTER, FetchError, fetch
    from kvpilot.server.model_source import InvalidModelSource, parse_model_source

    try:
        src = parse_model_source(lora_path)
    except InvalidModelSource as e:
        raise AdapterError(str(e)) from None
    if src.kind != "hf" or src.path:
        raise AdapterError(f"adapter source {lora_path!r}: an adapter is a directory (adapter_config.json + adapter_model.safetensors): "
                           "give hf://org/repo or a directory under --lora-dir")
    if root is None:
        raise AdapterError(f"adapter source {lora_path!r}: downloading an adapter needs --lora-dir (where it is written)")
    dest = Path(root) / FETCHED_DIR / src.name
    try:
        fetch(lora_path, dest, timeout=timeout, max_bytes=max_bytes, wanted=ADAPTER, log=_FetchLog())
    except FetchError as e:
        raise AdapterError(str(e)) from None
    return dest


class _FetchLog:
    """fetch's progress lines, into the server's log."""

    def write(self, text: str) -> None:
        if text.strip():
            import logging
            logging.getLogger("kvpilot.server").info("%s", text.strip())

    def flush(self) -> None:
        pass


def adapter_files(directory: str | Path, root: str | Path | None = None) -> tuple[Path, Path]:
    """The adapter's config and weights files, checked: a directory (under `root` when given, nothing
    reached through a symlink out of it), weights in safetensors (a pickled adapter_model.bin is never
    loaded)."""
    d = Path(directory)
    if root is not None:
        real_root = Path(os.path.realpath(root))
        real = Path(os.path.realpath(d if d.is_absolute() else real_root / d))
        if real != real_root and real_root not in real.parents:
            raise AdapterError(f"adapter path {str(directory)!r} is outside the adapter directory (--lora-dir)")
        d = real
    if not d.is_dir():
        raise AdapterError(f"adapter path {str(directory)!r} is not a directory")
    config, weights = d / ADAPTER_CONFIG, d / ADAPTER_WEIGHTS
    if not weights.is_file():
        pickled = " (adapter_model.bin is pickled: never loaded; convert it to safetensors)" if (d / "adapter_model.bin").exists() else ""
        raise AdapterError(f"{d}: no {ADAPTER_WEIGHTS}{pickled}")
    if root is not None:
        for f in (config, weights):
            real = Path(os.path.realpath(f))
            if real_root not in real.parents:
                raise AdapterError(f"{f.name} of {str(directory)!r} links outside the adapter directory (--lora-dir)")
    return config, weights
