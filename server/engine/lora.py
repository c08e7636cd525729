"""LoRA adapters in the engine: their weights read and checked against the base model, and the
registry that owns them — names, ids, host copies (at most max_cpu_loras, least recently used
dropped and re-read on demand) and the compute device's slots (max_loras).

Slots: a step's adapters must all be in slots (kernels/lora.py); the scheduler admits rows of at most
max_loras distinct adapters at a time, so a step's adapters always fit, and a slot is only given to
another adapter when no running sequence uses its adapter. The prefix cache keys an adapter's blocks
by the digest of its files (the same files under two names share KV; changed files never do), and an
adapter re-read into host memory must still be those files.
"""

from __future__ import annotations

import itertools
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvpilot.server.adapters import TARGETS, AdapterError, adapter_directory, adapter_files, check_adapter_name, read_adapter_config
from kvpilot.server.model_config import ModelConfig
from kvpilot.server.model_files import files_digest

# (layer, target) -> (A [rank, in], B [out, rank] with the adapter's scale folded in), float32
AdapterTensors = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """target -> (in, out) of the base projection it adapts."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv), "v_proj": (c.hidden_size, kv), "o_proj": (q, c.hidden_size),
            "gate_proj": (c.hidden_size, c.intermediate_size), "up_proj": (c.hidden_size, c.intermediate_size),
            "down_proj": (c.intermediate_size, c.hidden_size)}


def max_adapter_bytes(config: ModelConfig, max_rank: int) -> int:
    """The largest adapter_model.safetensors an adapter of rank <= max_rank over every projection of
    this model can be (float32), plus room for its header: a bigger file is refused unread."""
    return config.num_layers * max_rank * 4 * sum(i + o for i, o in target_shapes(config).values()) + (1 << 20)


def read_adapter(path: str | Path, config: ModelConfig, max_rank: int) -> tuple[AdapterTensors, int]:
    """An adapter's tensors, checked against the base model (targets, layers, shapes, rank <= max_rank),
    and its largest rank. AdapterError names whatever does not fit."""
    from safetensors import SafetensorError, safe_open

    config_file, weights_file = adapter_files(path)
    adapter = read_adapter_config(config_file.parent)
    limit = max_adapter_bytes(config, max_rank)
    if weights_file.stat().st_size > limit:
        raise AdapterError(f"{weights_file}: {weights_file.stat().st_size} bytes, more than an adapter of rank {max_rank} over every "
                           f"projection of this model can take ({limit}): refused unread")
    shapes = target_shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_file), framework="pt") as f:
            keys = list(f.keys())
            for key in keys:
                m = _KEY.match(key)
                if m is None:
                    raise AdapterError(f"{weights_file}: tensor {key!r} is not a LoRA A/B of a supported projection ({', '.join(TARGETS)}); "
                                       "embedding and LM-head adapters are refused")
                layer, target, half = int(m.group(1)), m.group(2), m.group(3)
                if target not in shapes or target not in adapter.targets:
                    raise AdapterError(f"{weights_file}: {key!r} adapts {target}, which is not among its target_modules or not supported")
                if layer >= config.num_layers:
                    raise AdapterError(f"{weights_file}: {key!r} is for layer {layer}, the base model has {config.num_layers}")
                tensor = f.get_tensor(key)
                if tensor.dim() != 2:
                    raise AdapterError(f"{weights_file}: tensor {key!r} is {tensor.dim()}-d (a LoRA A or B is a matrix)")
                halves.setdefault((layer, target), {})[half] = tensor.float()
    except SafetensorError as e:
        raise AdapterError(f"{weights_file}: not a readable safetensors file ({e})") from None
    if not halves:
        raise AdapterError(f"{weights_file}: no LoRA weights")
    tensors: AdapterTensors = {}
    top = 0
    for (layer, target), ab in halves.items():
        name = f"model.layers.{layer}.{'mlp' if target.endswith(('gate_proj', 'up_proj', 'down_proj')) else 'self_attn'}.{target}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{weights_file}: {name} has lora_{''.join(ab)} without its other half")
        a, b = ab["A"], ab["B"]
        n_in, n_out = shapes[target]
        rank = a.shape[0]
        if a.shape[1] != n_in or b.shape != (n_out, rank):
            raise AdapterError(f"{weights_file}: {name} has A {tuple(a.shape)} and B {tuple(b.shape)}; the base model needs "
                               f"A [rank, {n_in}] and B [{n_out}, rank] (an adapter of another model?)")
        if rank == 0:
            raise AdapterError(f"{weights_file}: {name} has rank 0 (A and B are empty)")
        if rank > max_rank:
            raise AdapterError(f"{weights_file}: {name} has rank {rank}, more than --max-lora-rank {max_rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{weights_file}: {name} holds non-finite values")
        # Checked as served: a finite alpha (from lora_alpha or alpha_pattern) can still overflow float32 in B.
        scale = adapter.scale(name, rank)
        scaled_b = b * scale
        if not torch.isfinite(scaled_b).all():
            rule = "alpha/sqrt(rank)" if adapter.use_rslora else "alpha/rank"
            raise AdapterError(f"{weights_file}: {name}'s B times its scale {rule} ({scale:g}) is not finite in float32")
        tensors[(layer, target)] = (a.contiguous(), scaled_b.contiguous())
        top = max(top, rank)
    return tensors, top


@dataclass(slots=True)
class Adapter:
    name: str
    id: int
    path: str                                # the directory it is (re-)read from
    rank: int
    tensors: AdapterTensors | None           # host copy (None: dropped, re-read when it needs a slot)
    slot: int | None = None
    requests: int = 0                        # requests run with it (metrics)
    loaded_at: float = field(default_factory=time.time)
    source: str = ""                         # as the load named it (a path, or hf://org/repo): /v1/models' root
    fingerprint: bytes = b""                 # SHA-256 of its two files: the root of its KV blocks' keys (block_manager.py)


class LoRARegistry:
    """Adapters by name and id, their host copies and the compute device's slots.

    load_slot(slot, adapter | None) writes an adapter into a slot of every adapted projection (on every
    rank; None clears it): the engine's _set_adapter."""

    def __init__(self, config: ModelConfig, max_loras: int, max_cpu_loras: int, max_rank: int,
                 load_slot: Callable[[int, Adapter | None], None], base_names: Collection[str] = ()):
        self.config, self.max_loras, self.max_cpu_loras, self.max_rank = config, max_loras, max_cpu_loras, max_rank
        self.load_slot = load_slot
        self.base_names = frozenset(base_names)  # the served model's: a request naming one gets the base model, never an adapter
        self.by_name: dict[str, Adapter] = {}
        self.by_id: dict[int, Adapter] = {}           # registered, and unregistered ones still in use
        self.slots: list[int | None] = [None] * max_loras  # adapter id per slot
        self.slot_use: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))  # least recently used first
        self.host: OrderedDict[int, None] = OrderedDict()  # adapter ids with host copies, least recently used first
        self._ids = itertools.count(1)

    def names(self) -> list[str]:
        return list(self.by_name)

    def fingerprint(self, adapter_id: int) -> bytes:
        """The digest of an adapter's files: the root of its KV blocks' keys (the block manager's)."""
        return self.by_id[adapter_id].fingerprint

    def read(self, name: str, path: str | Path, root: str | Path | None = None) -> Adapter:
        """Read and check an adapter, not yet registered (no engine state touched: the server reads
        off the step loop, then registers on it); an hf:// source is downloaded into `root` first.
        AdapterError: refused."""
        self._check_name_free(check_adapter_name(name))
        local = adapter_directory(str(path), root, max_adapter_bytes(self.config, self.max_rank))
        files = adapter_files(local, root)  # under root, links resolved: where it is re-read from
        tensors, rank = read_adapter(files[0].parent, self.config, self.max_rank)  # the size bound checked before the files are read
        return Adapter(name, 0, str(files[0].parent), rank, tensors, source=str(path), fingerprint=files_digest(*files))

    def register(self, adapter: Adapter) -> Adapter:
        self._check_name_free(adapter.name)
        adapter.id = next(self._ids)
        self.by_name[adapter.name] = self.by_id[adapter.id] = adapter
        self._keep_host(adapter)
        return adapter

    def _check_name_free(self, name: str) -> None:
        if name in self.base_names:
            raise AdapterError(f"adapter name {name!r} is the served model's name", "lora_name")
        if name in self.by_name:
            raise AdapterError(f"an adapter named {name!r} is already loaded", "lora_name")

    def add(self, name: str, path: str | Path, root: str | Path | None = None) -> Adapter:
        """Read, check and register an adapter (AdapterError: refused, nothing changed)."""
        return self.register(self.read(name, path, root))

    def remove(self, name: str, in_use: set[int]) -> Adapter:
        """Unregister (new requests cannot name it); sequences running with it finish with it, its slot
        and host copy go once none does (release_unused)."""
        adapter = self.by_name.pop(name, None)
        if adapter is None:
            raise KeyError(name)
        self.release_unused(in_use)
        return adapter

    def release_unused(self, in_use: set[int]) -> None:
        """Forget unregistered adapters that no sequence uses any more (their slots cleared)."""
        for aid in [a for a in self.by_id if a not in in_use and self.by_id[a].name not in self.by_name]:
            adapter = self.by_id.pop(aid)
            self.host.pop(aid, None)
            if adapter.slot is not None:
                self.slots[adapter.slot] = None
                self.load_slot(adapter.slot, None)

    def lookup(self, name: str) -> Adapter | None:
        return self.by_name.get(name)

    def slots_for(self, adapter_ids: list[int], running: set[int]) -> list[int]:
        """The slot of each given adapter id (0: none -> -1), loading the ones not in a slot into slots
        whose adapters no running sequence uses (least recently used first)."""
        out = []
        for aid in adapter_ids:
            if aid == 0:
                out.append(-1)
                continue
            adapter = self.by_id[aid]
            if adapter.slot is None:
                self._give_slot(adapter, running | set(adapter_ids))
            self.slot_use.move_to_end(adapter.slot)
            out.append(adapter.slot)
        return out

    def _give_slot(self, adapter: Adapter, keep: set[int]) -> None:
        slot = next((s for s in self.slot_use if self.slots[s] is None or self.slots[s] not in keep), None)
        if slot is None:
            raise AssertionError(f"no adapter slot free for {adapter.name!r}: more than max_loras={self.max_loras} adapters in use")
        if adapter.tensors is None:
            # Dropped from host memory: read again, before the slot changes hands (a refused re-read leaves
            # the slot's adapter in it), checked as at load (a FIFO or an oversized file swapped in is
            # refused, not read) and still the same files (its KV is keyed by them).
            tensors, _ = read_adapter(adapter.path, self.config, self.max_rank)
            if files_digest(*adapter_files(adapter.path)) != adapter.fingerprint:
                raise AdapterError(f"adapter {adapter.name!r}: its files in {adapter.path} changed since it was loaded (unload and load it again)")
            adapter.tensors = tensors
        self._keep_host(adapter)
        old = self.slots[slot]
        if old is not None:  # unseated before the write: a failed write leaves the slot empty, not naming either adapter
            self.by_id[old].slot = None
            self.slots[slot] = None
        self.load_slot(slot, adapter)
        self.slots[slot], adapter.slot = adapter.id, slot

    def _keep_host(self, adapter: Adapter) -> None:
        self.host[adapter.id] = None
        self.host.move_to_end(adapter.id)
        while len(self.host) > self.max_cpu_loras:
            aid, _ = self.host.popitem(last=False)
            self.by_id[aid].tensors = None
