"""Turns the last-position logits of a batch into next tokens (and logprobs), batched.

Two stages: `processed_logits` applies every sampling parameter to all rows at once (penalties,
min_tokens bans, temperature, top-k, top-p, min-p) and `Sampler` draws from the result. The first
stage is what rejection sampling needs for the target's and the draft's distributions alike. No step
syncs with the host per row: each row's parameters are tensors, random rows are drawn by the
exponential race (argmax of p / E with E ~ Exp(1), which picks token i with probability p_i), and the
results come back in one device-to-host copy. A seeded request draws its noise from its own generator,
one row of the vocabulary's size per token, so its output does not depend on what else is batched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpilot.server.engine.sequence import Sequence

NEG_INF = float("-inf")


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]   # per sequence: {token id: logprob} (sampled + top-n)
    sampled_logprobs: list[float]
    errors: dict[int, str] = field(default_factory=dict)  # row -> why no token could be sampled for it


def _column(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device).unsqueeze(1)


def _padded(rows: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as one [rows, longest] tensor (padding points at column 0) and its validity mask."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=device).reshape(len(rows), width)
    valid = torch.tensor([[True] * len(r) + [False] * (width - len(r)) for r in rows], dtype=torch.bool, device=device).reshape(len(rows), width)
    return ids, valid


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition (over prompt + output, as in vLLM), presence and frequency (over output) penalties, all rows at once."""
    rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
    if not rows:
        return logits
    dev, vocab = logits.device, logits.shape[1]
    out_ids, out_valid = _padded([seqs[i].output_token_ids for i in rows], dev)
    counts = torch.zeros(len(rows), vocab, dtype=logits.dtype, device=dev).scatter_add_(1, out_ids, out_valid.to(logits.dtype))
    prompt_ids, prompt_valid = _padded([seqs[i].prompt_token_ids for i in rows], dev)
    in_prompt = torch.zeros_like(counts).scatter_add_(1, prompt_ids, prompt_valid.to(logits.dtype))
    seen = (counts > 0) | (in_prompt > 0)
    params = [seqs[i].params for i in rows]
    rep = _column([p.repetition_penalty for p in params], logits.dtype, dev)
    x = logits[rows]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - _column([p.frequency_penalty for p in params], logits.dtype, dev) * counts
    x = x - _column([p.presence_penalty for p in params], logits.dtype, dev) * (counts > 0).to(logits.dtype)
    logits[rows] = x
    return logits


def mask_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_token_id: int | None) -> None:
    """Until min_tokens are out, EOS and stop token ids cannot be sampled."""
    rows, cols = [], []
    for row, seq in enumerate(seqs):
        p = seq.params
        if len(seq.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([eos_token_id] if eos_token_id is not None and not p.ignore_eos else [])
            rows += [row] * len(banned)
            cols += banned
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = NEG_INF


def filter_logits_batch(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Top-k, then top-p (nucleus) over what top-k kept, then min-p over what top-p kept; per row, on
    [rows, vocab] temperature-scaled logits, with [rows] parameters (top_k <= 0: off).

    The most likely token always survives every filter, so a row never becomes all -inf (a top_p or
    min_p that rounds to 0 or 1 in float32 would otherwise turn the softmax into NaN)."""
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, NEG_INF)  # ties with the k-th stay, as topk's threshold keeps them
    probs = sorted_logits.softmax(-1)
    # Drop a token when the mass strictly before it already reaches top_p (the top one always stays).
    drop = (probs.cumsum(-1) - probs) >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, NEG_INF)
    probs = sorted_logits.softmax(-1)
    keep = (probs >= min_p.unsqueeze(1) * probs[:, :1]) | (sorted_logits == sorted_logits[:, :1])
    sorted_logits = sorted_logits.masked_fill(~keep, NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """filter_logits_batch for one row."""
    one = lambda v, dtype: torch.tensor([v], dtype=dtype, device=logits.device)  # noqa: E731
    return filter_logits_batch(logits.unsqueeze(0), one(top_k, torch.long), one(top_p, logits.dtype), one(min_p, logits.dtype))[0]


def processed_logits(logits: torch.Tensor, seqs: list[Sequence], eos_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sampling parameter applied: (penalised and min_tokens-masked logits, which greedy rows argmax;
    the temperature-scaled, filtered logits whose softmax is the distribution random rows draw from)."""
    if any(s.params.has_penalties for s in seqs):
        logits = apply_penalties(logits.clone(), seqs)
    elif any(len(s.output_token_ids) < s.params.min_tokens for s in seqs):
        logits = logits.clone()
    mask_min_tokens(logits, seqs, eos_token_id)
    dev, dtype = logits.device, logits.dtype
    params = [s.params for s in seqs]
    temperature = _column([1.0 if p.greedy else p.temperature for p in params], dtype, dev)
    # Shift so the best logit is 0 before dividing (a small temperature cannot overflow it to +inf) and
    # keep masked entries -inf (a huge temperature would give -inf/inf = NaN).
    shifted = logits - logits.max(-1, keepdim=True).values
    scaled = (shifted / temperature).masked_fill(shifted == NEG_INF, NEG_INF)
    filtered = filter_logits_batch(scaled, torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev),
                                   torch.tensor([p.top_p for p in params], dtype=dtype, device=dev),
                                   torch.tensor([p.min_p for p in params], dtype=dtype, device=dev))
    return logits, filtered


class Sampler:
    def __init__(self, eos_token_id: int | None, default_generator: torch.Generator | None = None):
        self.eos_token_id = eos_token_id
        self.default_generator = default_generator

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        want_logprobs = [s.params.logprobs is not None for s in seqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        penalised, filtered = processed_logits(logits, seqs, self.eos_token_id)
        # A row with no finite logit left (every token banned, or a model that produced NaN/inf) has
        # nothing to sample: that request fails alone, the rest of the batch goes on.
        unusable = ~torch.isfinite(penalised).any(-1) | torch.isnan(penalised).any(-1) | (penalised == float("inf")).any(-1)
        tokens = penalised.argmax(-1)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if random_rows:
            probs = filtered[random_rows].softmax(-1)
            noise = torch.empty_like(probs)
            unseeded = [j for j, i in enumerate(random_rows) if seqs[i].generator is None]
            if unseeded:
                noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], dtype=probs.dtype, device=probs.device).exponential_(
                    generator=self.default_generator)
            for j, i in enumerate(random_rows):
                if seqs[i].generator is not None:  # its own stream: the same draws whatever else is batched
                    noise[j].exponential_(generator=seqs[i].generator)
            noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # a draw of exactly 0 would make 0/0 = NaN for p = 0
            tokens[random_rows] = (probs / noise).argmax(-1)
        top_n = max((s.params.logprobs or 0 for s in seqs), default=0)
        parts = [tokens.to(torch.float64), unusable.to(torch.float64)]
        if raw_logprobs is not None:
            parts.append(raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).to(torch.float64))
            if top_n:
                top = torch.topk(raw_logprobs, top_n, dim=-1)
                parts += [top.values.to(torch.float64).flatten(), top.indices.to(torch.float64).flatten()]
        host = torch.cat(parts).tolist()  # the step's one device-to-host copy
        b = len(seqs)
        token_ids = [int(t) for t in host[:b]]
        errors = {i: "no token can be sampled: every token is excluded by the request's parameters, or the model produced non-finite scores"
                  for i, bad in enumerate(host[b:2 * b]) if bad}
        logprobs: list[dict[int, float] | None] = [None] * b
        sampled = [0.0] * b
        if raw_logprobs is not None:
            chosen = host[2 * b:3 * b]
            values, indices = host[3 * b:3 * b + b * top_n], host[3 * b + b * top_n:]
            for row, seq in enumerate(seqs):
                if not want_logprobs[row] or row in errors:
                    continue
                entry = {token_ids[row]: chosen[row]}
                for j in range(seq.params.logprobs or 0):
                    entry.setdefault(int(indices[row * top_n + j]), values[row * top_n + j])
                logprobs[row] = entry
                sampled[row] = chosen[row]
        return SampleResult(token_ids, logprobs, sampled, errors)
