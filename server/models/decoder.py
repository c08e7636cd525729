"""One decoder for every supported family (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM, Gemma 3) over a
paged KV cache. The families' differences are data in ModelConfig (biases, q/k norms, RoPE scaling,
sliding-window layers, Gemma's norms); the weights come by their transformers names from a GGUF file
or a checkpoint directory alike."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from kvpilot.kernels.direct_call import direct_call
from kvpilot.kernels.fused_moe import ExpertBlocks, ExpertPanels, Experts
from kvpilot.kernels.linear import RowParallel, make_linear
from kvpilot.kernels.lora import LoRAContext, LoRALinear, LoRAShape
from kvpilot.kernels.ops import Ops, ops_for
from kvpilot.kernels.paged_attention import AttentionMetadata
from kvpilot.kernels.quantized import GGUFLinear, GGUFWeight, cat_rows, embedding, quantize_int4, quantize_int8
from kvpilot.server.dummy_weights import DummyWeights
from kvpilot.server.layers.attention import PagedSelfAttention
from kvpilot.server.layers.mlp import SwiGLU
from kvpilot.server.layers.moe import SparseMoE
from kvpilot.server.layers.rmsnorm import RMSNorm
from kvpilot.server.layers.rotary import RotaryEmbedding
from kvpilot.server.model_config import ModelConfig, ModelFormatError
from kvpilot.server.models.sharding import PipelineStage, TensorParallel

log = logging.getLogger("kvpilot.server.models")


class WeightSource(Protocol):
    """A GGUF file or a checkpoint directory, read by transformers tensor names."""

    path: Path
    config: ModelConfig
    memory_mapped: bool  # load() returns views of a file mapping (not owned tensors)

    def checkpoint_names(self) -> set[str]: ...

    def load(self, name: str) -> torch.Tensor: ...


@direct_call
class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each adding the residual; with `post_norms` (Gemma's sandwich) each
    output is normed before it is added. local_rope: the layer rotates by the model's local RoPE (Gemma 3's
    sliding layers)."""

    def __init__(self, attn: PagedSelfAttention, mlp: SwiGLU | SparseMoE, attn_norm: RMSNorm, mlp_norm: RMSNorm,
                 post_norms: tuple[RMSNorm, RMSNorm] | None = None, local_rope: bool = False):
        super().__init__()
        self.attn, self.mlp, self.attn_norm, self.mlp_norm = attn, mlp, attn_norm, mlp_norm
        self.post_attn_norm, self.post_mlp_norm = post_norms or (None, None)
        self.local_rope = local_rope

    def forward(self, x, rope, kv_cache, meta):
        if self.post_attn_norm is None:
            x = self.attn(self.attn_norm(x), x, rope, kv_cache, meta)
            return self.mlp(self.mlp_norm(x), x)
        x = x + self.post_attn_norm(self.attn(self.attn_norm(x), None, rope, kv_cache, meta))
        return x + self.post_mlp_norm(self.mlp(self.mlp_norm(x), None))


class DecoderModel(nn.Module):
    """With tensor parallelism (`tp`) this is one rank's shard: its query/KV heads and FFN columns
    (the o and down projections all-reduce), and a slice of the vocabulary for the embedding (its
    lookups all-reduced) and the LM head (its logits all-gathered). With pipeline parallelism (`stage`)
    it holds its stage's layers only (`layers[i]` is the model's layer `first_layer + i`): the
    embedding on the first stage, the final norm and the LM head on the last (a tied head's matrix
    there too); forward() takes the hidden states a stage before it handed on and gives its own."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, embed: torch.Tensor | None, layers: list[DecoderLayer], norm: RMSNorm | None,
                 lm_head: torch.Tensor | None, rotary: RotaryEmbedding, num_kv_heads: int, tp: TensorParallel | None = None,
                 lora: LoRAModules | None = None, stage: PipelineStage | None = None, rotary_local: RotaryEmbedding | None = None):
        """dtype: the compute dtype (of the activations and the KV cache). embed / norm and lm_head: None on the stages
        that do not hold them; lm_head `embed` itself: a tied head. rotary_local: the sliding layers' RoPE where it
        differs (Gemma 3)."""
        super().__init__()
        self.config = config
        self.lora = lora
        self.num_kv_heads = num_kv_heads  # this rank's (all of them without tensor parallelism)
        self.tp = tp
        self.stage = stage
        self.first_layer = stage.layers[0] if stage else 0
        self.aux_layers: tuple[int, ...] = ()  # a declared aux output (declare_aux_output)
        # The sliding-window layers' caches are a pool of their own (set by the worker that allocates them so): those
        # layers read the step's window tables (meta.window).
        self.window_pool = False
        self.layers = nn.ModuleList(layers)
        self.dtype = dtype
        self.norm = norm
        self.rotary, self.rotary_local = rotary, rotary_local
        # Gemma: embeddings times √hidden, in the compute dtype (as transformers scales them)
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5).to(self.dtype) if config.family.gemma else None
        # A tied head is the embedding matrix; on CPU it is packed for the matmul (a second copy,
        # 113 MB for SmolLM2, repaid by a 3x faster head on every decode step) — except GGUF blocks
        # in panels (GGUFLinear), which the lookup reads too: one copy.
        self.vocab_rows = next((t.shape[0] for t in (embed, lm_head) if t is not None), 0)  # this rank's (a middle stage: none)
        self.lm_head = make_linear(lm_head) if lm_head is not None else None
        if lm_head is embed and isinstance(self.lm_head, GGUFLinear):
            embed = self.lm_head
        # Packed (quantization gguf): the GGUF's blocks, dequantized row by row on lookup.
        self.embed = embed if embed is None or isinstance(embed, (GGUFWeight, GGUFLinear)) else nn.Parameter(embed, requires_grad=False)

    @property
    def ops(self) -> Ops:
        """The kernel table every layer was built with."""
        return self.layers[0].attn.ops

    def weight_bytes(self) -> int:
        """Bytes the model's weights occupy (GGUF blocks at their size), each storage counted once."""
        packed = [t for t in (self.embed.qs, self.embed.d, self.embed.m) if t is not None] if isinstance(self.embed, GGUFWeight) else []
        seen, total = set(), 0
        for t in [*packed, *self.parameters(), *self.buffers()]:
            if t.is_mkldnn:  # oneDNN's packed layout has no storage to share
                total += t.numel() * t.element_size()
                continue
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total

    def set_adapter(self, slot: int, tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Write an adapter's (layer, target) -> (A, B) into `slot` of every adapted projection (None: clear it)."""
        with torch.inference_mode():
            for module, layer, targets in self.lora.modules:
                module.set_slot(slot, [tensors.get((layer, t)) if tensors else None for t in targets])

    def declare_aux_output(self, layers: tuple[int, ...]) -> None:
        """From now on forward() also gives the residual stream entering each of these layers,
        concatenated: (hidden, aux) (an EAGLE-3 head drafts from them: server/models/eagle.py)."""
        self.aux_layers = tuple(layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, hidden: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states; with a declared aux output (declare_aux_output), (hidden, aux).
        A pipeline stage: `hidden` the residual stream the stage before handed on (the first embeds
        input_ids instead); a stage before the last gives its residual stream, not normed."""
        x = self._embed(input_ids).to(self.dtype) if hidden is None else hidden  # GGUF-block rows dequantize to float32
        if self.embed_scale is not None and hidden is None:
            x = x * self.embed_scale
        ropes = [self.rotary.rope(positions, x.dtype)]  # once per forward, shared by every layer
        if self.rotary_local is not None:
            ropes.append(self.rotary_local.rope(positions, x.dtype))
        aux = []
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            if i in self.aux_layers:
                aux.append(x)  # every layer returns a new tensor: x is not written to later
            x = layer(x, ropes[layer.local_rope], kv, meta.window if self.window_pool and layer.attn.window else meta)
        if self.norm is None:
            return x
        return (self.norm(x), torch.cat(aux, dim=-1)) if self.aux_layers else self.norm(x)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return embedding(input_ids, self.embed)
        import torch.distributed as dist

        start = self.tp.rank * self.vocab_rows
        local = input_ids - start
        mine = (local >= 0) & (local < self.vocab_rows)
        x = embedding(torch.where(mine, local, 0), self.embed) * mine[:, None]
        dist.all_reduce(x, group=self.tp.group)  # each token's row comes from the one rank that holds it
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.tp is None:
            return logits
        import torch.distributed as dist

        parts = [torch.empty_like(logits) for _ in range(self.tp.world_size)]
        dist.all_gather(parts, logits.contiguous(), group=self.tp.group)
        return torch.cat(parts, dim=-1)[:, :self.config.vocab_size]

    @classmethod
    def load(cls, source: WeightSource, config: ModelConfig, dtype: torch.dtype, device: torch.device,
             progress: Callable[[int], None] | None = None, tp: TensorParallel | None = None, quantization: str = "none",
             group_size: int = 32, lora: tuple[int, int] | None = None, stage: PipelineStage | None = None) -> DecoderModel:
        """quantization gguf: projections, the embedding and the LM head stay in the GGUF's blocks; gptq / awq:
        a pre-quantized checkpoint's projections in the block layout that holds them (server/quant_checkpoint.py); int8 /
        int4: they are quantized as they are read (the embedding and LM head int8 in both). lora:
        (max_loras, max_rank): every projection gets that many adapter slots (kernels/lora.py). stage: a
        pipeline stage's layers and ends only (the other stages' weights are not read)."""
        c = config
        w = _WeightReader(source, dtype, device, progress, tp, quantization, group_size)
        ops = ops_for(device)
        adapted = LoRAModules(LoRAContext(), []) if lora else None

        def adapt(layer: int, targets: tuple[str, ...], in_range: list[int], *part_ranges: list[int]):
            if adapted is None:
                return None

            def wrap(base: nn.Module) -> LoRALinear:
                module = LoRALinear(base, LoRAShape(tuple(in_range), tuple(map(tuple, part_ranges)), lora[1]), lora[0], adapted.context,
                                    ops.lora_add_, dtype, device)
                adapted.modules.append((module, layer, targets))
                return module
            return wrap

        # Gemma's norms scale by 1 + w in float32: transformers holds w in the compute dtype, adds 1 and multiplies in
        # float32 and rounds the product once (ops.rms_norm does so for a float32 weight); rounding 1 + w to bfloat16
        # instead would drop every w under 2^-8 and put each layer's rows off transformers' (docs/models.md)
        norm = lambda name: RMSNorm(1.0 + w(name).float() if c.family.gemma else w(name), c.rms_norm_eps, ops)
        heads = tp.split(c.num_heads) if tp else (0, c.num_heads)
        kv_heads = tp.kv_heads(c.num_kv_heads) if tp else (0, c.num_kv_heads)
        ffn = tp.split(c.intermediate_size) if tp else (0, c.intermediate_size)
        q_rows, kv_rows = [h * c.head_dim for h in heads], [h * c.head_dim for h in kv_heads]
        row_parallel = RowParallel(tp.rank, tp.group) if tp else None
        layers, kept_dense = [], {}
        first, end = stage.layers if stage else (0, c.num_layers)
        for i in range(first, end):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            qkv = cat_rows([w.weight(a + "q_proj.weight", rows=q_rows), w.weight(a + "k_proj.weight", rows=kv_rows),
                            w.weight(a + "v_proj.weight", rows=kv_rows)])
            qkv_bias = None
            if c.family.qkv_bias or c.attention_bias:
                qkv_bias = torch.cat([w(a + "q_proj.bias", rows=q_rows), w(a + "k_proj.bias", rows=kv_rows), w(a + "v_proj.bias", rows=kv_rows)])
            hidden = [0, c.hidden_size]
            attn = PagedSelfAttention(
                make_linear(qkv, bias=qkv_bias, adapt=adapt(i, ("q_proj", "k_proj", "v_proj"), hidden, q_rows, kv_rows, kv_rows)),
                make_linear(w.weight(a + "o_proj.weight", cols=q_rows), bias=w(a + "o_proj.bias") if c.attention_bias else None, shard=row_parallel,
                            adapt=adapt(i, ("o_proj",), q_rows, hidden)),
                heads[1] - heads[0], kv_heads[1] - kv_heads[0], c.head_dim, ops,
                qk_norms=(norm(a + "q_norm.weight"), norm(a + "k_norm.weight")) if c.family.qk_norm else None, window=c.window(i),
                scale=c.query_scale)
            bias = lambda name, rows=None: w(name, rows=rows) if c.mlp_bias else None
            mlp = _sparse_moe(w, c, i, ops, tp, kept_dense) if c.is_moe(i) else SwiGLU(make_linear(w.weight(m + "gate_proj.weight", rows=ffn), bias=bias(m + "gate_proj.bias", ffn),
                                     adapt=adapt(i, ("gate_proj",), hidden, ffn)),
                         make_linear(w.weight(m + "up_proj.weight", rows=ffn), bias=bias(m + "up_proj.bias", ffn), adapt=adapt(i, ("up_proj",), hidden, ffn)),
                         make_linear(w.weight(m + "down_proj.weight", cols=ffn), bias=bias(m + "down_proj.bias"), shard=row_parallel,
                                     adapt=adapt(i, ("down_proj",), ffn, hidden)), act=c.hidden_act)
            local_rope = c.rope_local_theta is not None and c.window(i) > 0
            if c.family.gemma:  # input, post-attention, pre- and post-feedforward norms
                layers.append(DecoderLayer(attn, mlp, norm(p + "input_layernorm.weight"), norm(p + "pre_feedforward_layernorm.weight"),
                                           (norm(p + "post_attention_layernorm.weight"), norm(p + "post_feedforward_layernorm.weight")), local_rope))
            else:
                layers.append(DecoderLayer(attn, mlp, norm(p + "input_layernorm.weight"), norm(p + "post_attention_layernorm.weight"),
                                           local_rope=local_rope))
        if kept_dense:  # (once for the model, not once a layer)
            log.warning("the experts' blocks (%s) are kept dense in %s on the %s kernels, in %d of %d layers (panels are the C++ kernels', "
                        "stacked blocks of one kind for gate and up the Triton kernel's)", ", ".join(sorted(set().union(*kept_dense.values()))),
                        str(w.dtype).removeprefix("torch."), ops.name, len(kept_dense), end - first)
        vocab = tp.split(tp.padded_vocab(c.vocab_size)) if tp else None
        holds_embed, holds_head = stage is None or stage.first, stage is None or stage.last
        embed = w.weight("model.embed_tokens.weight", rows=vocab, pad_rows=True, table=True) \
            if holds_embed or (holds_head and c.tie_word_embeddings) else None
        head = None
        if holds_head:
            head = embed if c.tie_word_embeddings else w.weight("lm_head.weight", rows=vocab, pad_rows=True, table=True)
        rotary = RotaryEmbedding(c.head_dim, c.max_position, c.rope_theta, c.rope_scaling).to(device)
        rotary_local = RotaryEmbedding(c.head_dim, c.max_position, c.rope_local_theta).to(device) if c.rope_local_theta is not None else None
        model = cls(c, dtype, embed if holds_embed else None, layers, norm("model.norm.weight") if holds_head else None, head, rotary,
                    kv_heads[1] - kv_heads[0], tp, adapted, stage, rotary_local)
        ignored = {"lm_head.weight"} if c.tie_word_embeddings else set()
        if stage is not None:  # the other stages' weights
            ignored |= {n for n in w.available if n.startswith("model.layers.") and not first <= int(n.split(".")[2]) < end}
            ignored |= set() if embed is not None else {"model.embed_tokens.weight"}
            ignored |= set() if holds_head else {"model.norm.weight", "lm_head.weight"}
        w.check_all_read(ignored=ignored)
        return model


def _sparse_moe(w: _WeightReader, c: ModelConfig, layer: int, ops: Ops, tp: TensorParallel | None,
                kept_dense: dict[int, set[str]]) -> SparseMoE:
    """A layer's mixture of experts: its router, and its experts (this rank's slice of every expert's inner dimension)
    read from per-expert matrices (Qwen3-MoE's mlp.experts.{e}.gate_proj…, Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2)
    or a GGUF's stacked ones; Qwen2-MoE's shared expert and its gate. Quantized (a GGUF's blocks with quantization=gguf,
    int8 / int4 as read) they are kept in panels for the C++ op, in stacked blocks for the Triton one (gate and up rows
    fused per expert), else (the reference ops) dense in the compute dtype."""
    p = f"model.layers.{layer}."
    lo, hi = tp.split(c.moe_intermediate_size) if tp else (0, c.moe_intermediate_size)
    if p + "mlp.experts.gate_proj.weight" in w.available:  # a GGUF's [experts, inner, hidden] (down: [experts, hidden, inner])
        names = [p + f"mlp.experts.{k}_proj.weight" for k in ("gate", "up", "down")]
        read = lambda name, e, **part: w.expert(name, e, **part)  # noqa: E731
    else:
        m, spelled = (p + "block_sparse_moe.", ("w1", "w3", "w2")) if c.family.moe == "mixtral" else (p + "mlp.", ("gate_proj", "up_proj", "down_proj"))
        names = [m + "experts.{e}." + n + ".weight" for n in spelled]
        read = lambda name, e, **part: w.weight(name.format(e=e), **part)  # noqa: E731
    experts = range(c.num_experts)
    gate, up = ([read(names[k], e, rows=(lo, hi)) for e in experts] for k in (0, 1))
    down = [read(names[2], e, cols=(lo, hi)) for e in experts]
    quantized = all(isinstance(t, GGUFWeight) for t in (*gate, *up, *down))
    blocks = None
    if quantized and ops.name == "triton" and len({t.kind for t in (*gate, *up)}) == 1:  # (gate and up rows fuse in one kind)
        w13 = [cat_rows([g, u]) for g, u in zip(gate, up)]
        both = (ExpertBlocks.of(w13) if all(isinstance(t, GGUFWeight) for t in w13) else None, ExpertBlocks.of(down))
        blocks = both if None not in both else None
    if quantized and ops.name == "cpu-c++":
        weights = Experts(hi - lo, panels=(ExpertPanels.of(gate), ExpertPanels.of(up), ExpertPanels.of(down)))
    elif blocks is not None:
        weights = Experts(hi - lo, blocks=blocks)
    else:
        if quantized:  # (the caller warns once for the model)
            kept_dense[layer] = {t.kind for t in (*gate, *up, *down)}
        dense = lambda ts: torch.stack([t.dequantize().to(w.dtype) if isinstance(t, GGUFWeight) else t for t in ts])  # noqa: E731
        weights = Experts(hi - lo, torch.cat([dense(gate), dense(up)], dim=1).contiguous(), dense(down).contiguous())
    router = p + "mlp.gate.weight" if p + "mlp.gate.weight" in w.available else p + "block_sparse_moe.gate.weight"
    shared = None
    if c.shared_expert_intermediate_size:  # this rank's slice of its inner dimension too, summed with the experts' outputs
        s, rows = p + "mlp.shared_expert.", tp.split(c.shared_expert_intermediate_size) if tp else (0, c.shared_expert_intermediate_size)
        shared = (SwiGLU(make_linear(w.weight(s + "gate_proj.weight", rows=rows)), make_linear(w.weight(s + "up_proj.weight", rows=rows)),
                         make_linear(w.weight(s + "down_proj.weight", cols=rows)), act=c.hidden_act),
                  make_linear(w(p + "mlp.shared_expert_gate.weight").reshape(1, c.hidden_size)))
    return SparseMoE(make_linear(w(router)), weights, c.experts_per_token, c.norm_topk_prob, ops, c.hidden_act,
                     torch.float32 if c.family.moe == "mixtral" else None, tp.group if tp else None, tp.rank if tp else 0, sharded=tp is not None,
                     shared=shared)


@dataclass(slots=True)
class LoRAModules:
    """A model's adapted projections: the step's LoRABatch they all read, and each projection with its
    layer and the adapter targets of its parts (q/k/v for the fused QKV projection)."""

    context: LoRAContext
    modules: list[tuple[LoRALinear, int, tuple[str, ...]]]


PACKED_FORMATS = ("gguf", "gptq", "awq", "compressed-tensors", "fp8")  # kept as the file holds them (the source's load_packed)


def read_embedding(source: WeightSource, dtype: torch.dtype, device: torch.device, quantization: str = "none") -> torch.Tensor | GGUFWeight:
    """The whole embedding table, as an unsharded model keeps it (an EAGLE-3 head beside a tensor-parallel
    rank's target, whose own table is its vocabulary shard)."""
    return _WeightReader(source, dtype, device, None, None, quantization).weight("model.embed_tokens.weight", table=True)


class _WeightReader:
    """Reads weights by name, each cast to the compute dtype and moved to the device as it is read (no
    second full copy of the model in host memory), and keeps count: a weight the model never read
    means a variant this code does not implement, an error rather than a silently different model."""

    def __init__(self, source: WeightSource, dtype: torch.dtype, device: torch.device, progress: Callable[[int], None] | None,
                 tp: TensorParallel | None, quantization: str = "none", group_size: int = 32):
        if isinstance(source, DummyWeights):  # (made where they are used, in the dtype they are used in)
            source = source.on(device, dtype)
        self.source, self.dtype, self.device, self.progress, self.tp = source, dtype, device, progress, tp
        self.available = source.checkpoint_names()
        self.read: set[str] = set()
        if quantization in PACKED_FORMATS and getattr(source, "packed_format", None) != quantization:
            what = "a GGUF model (its blocks are what it keeps)" if quantization == "gguf" else f"a {quantization.upper()} checkpoint"
            raise ModelFormatError(f"{source.path}: quantization={quantization} needs {what}")
        self.quantization, self.group_size = quantization, group_size
        self._stacked: tuple[str, torch.Tensor] | None = None  # the stacked experts' weight being read (expert())

    def weight(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None,
               pad_rows: bool = False, table: bool = False) -> torch.Tensor | GGUFWeight:
        """A matrix the model multiplies by (`table`: the embedding or LM head): kept in the file's
        blocks (gguf, when the file has them), quantized as it is read (int8, int4: int8 for tables),
        else as __call__ reads it."""
        if self.quantization in ("int8", "int4"):
            # Quantized from the file's own precision: after a cast to a half compute dtype, weights
            # near a rounding boundary would land on the neighbouring code.
            dense = self(name, rows, cols, pad_rows, dtype=torch.float32)
            return quantize_int8(dense) if self.quantization == "int8" or table else quantize_int4(dense, self.group_size)
        # gguf: the file's blocks; gptq / awq: the checkpoint's codes in the block layout that holds them (server/quant_checkpoint.py)
        packed = self.source.load_packed(name) if self.quantization in PACKED_FORMATS and name in self.available else None
        if packed is None:
            return self(name, rows, cols, pad_rows)
        return self._packed_part(name, packed, rows, cols, pad_rows)

    def expert(self, name: str, expert: int, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor | GGUFWeight:
        """Expert `expert`'s [out, in] of a stacked [experts, out, in] weight (a GGUF's), as weight() reads a matrix: its
        blocks (quantization gguf), quantized as read (int8, int4), else in the compute dtype."""
        packed = self.source.load_packed(name, expert) if self.quantization == "gguf" and name in self.available else None
        if packed is not None:
            return self._packed_part(name, packed, rows, cols, False)
        if name not in self.available:
            raise ModelFormatError(f"{self.source.path}: weight {name!r} is missing")
        if self._stacked is None or self._stacked[0] != name:  # (read once for all its experts)
            self._stacked = (name, self.source.load(name))
            self.read.add(name)
            if self.progress:
                self.progress(1)
        dense = self._stacked[1][expert]
        dense = dense[rows[0]:rows[1]] if rows is not None else dense
        dense = dense[:, cols[0]:cols[1]] if cols is not None else dense
        if self.quantization in ("int8", "int4"):
            dense = dense.float()
            return (quantize_int8(dense) if self.quantization == "int8" else quantize_int4(dense, self.group_size)).to(self.device)
        return dense.to(device=self.device, dtype=self.dtype).contiguous().clone()

    def _packed_part(self, name: str, packed: GGUFWeight, rows: tuple[int, int] | None, cols: tuple[int, int] | None,
                     pad_rows: bool) -> GGUFWeight:
        """This rank's rows / columns of a weight kept in blocks."""
        n, k = packed.shape
        if rows is not None and tuple(rows) != (0, n):
            if rows[1] > n:
                raise ModelFormatError(f"{name}: rows {rows} past its {n} (a padded vocabulary is not kept in GGUF blocks)")
            packed = packed.rows(slice(*rows))
        if cols is not None and tuple(cols) != (0, k):
            if packed.perm is not None:  # an act-order weight's columns are permuted: this rank's share, dequantized
                return self(name, rows, cols, pad_rows)
            try:
                packed = packed.columns(*cols)
            except ValueError as e:  # this rank's row-parallel share falls inside one of the layout's units
                raise ModelFormatError(f"{name}: {e} (this rank's share of its {k} input columns): choose a tensor_parallel_size that "
                                       f"splits {k} into whole blocks, or quantization=none") from e
        if self.progress and name not in self.read:  # (a stacked experts' weight: once for all its experts)
            self.progress(1)
        self.read.add(name)
        return packed.to(self.device)

    def __call__(self, name: str, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None, pad_rows: bool = False,
                 dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight (in the compute dtype unless `dtype` says otherwise), or this rank's [start, end)
        of its rows / columns (rows past the end: zeros when pad_rows, for a vocabulary padded to a
        multiple of the ranks)."""
        if name not in self.available:
            raise ModelFormatError(f"{self.source.path}: weight {name!r} is missing")
        full = self.source.load(name)
        loaded = full
        if rows is not None:
            end = min(rows[1], full.shape[0]) if pad_rows else rows[1]
            loaded = full[rows[0]:end]
            if pad_rows and end - rows[0] < rows[1] - rows[0]:
                loaded = torch.cat([loaded, full.new_zeros(rows[1] - max(end, rows[0]), *full.shape[1:])])
        if cols is not None:
            loaded = loaded[:, cols[0]:cols[1]]
        t = loaded.to(device=self.device, dtype=dtype or self.dtype).contiguous()
        if t.untyped_storage().data_ptr() == full.untyped_storage().data_ptr() and (self.source.memory_mapped or t.numel() < full.numel()):
            # An owned copy: a view would keep the whole memory-mapped file (or, for a shard, the
            # whole tensor) resident for as long as the model lives.
            t = t.clone()
        self.read.add(name)
        if self.progress:
            self.progress(1)
        return t

    def check_all_read(self, ignored: set[str]) -> None:
        # A tied checkpoint may also store the head; older ones store RoPE's inverse frequencies.
        unread = sorted(n for n in self.available - self.read - ignored if not n.endswith("rotary_emb.inv_freq"))
        if unread:
            more = f" and {len(unread) - 5} more" if len(unread) > 5 else ""
            raise ModelFormatError(f"{self.source.path}: weights the model does not use (an unsupported variant?): {', '.join(unread[:5])}{more}")


