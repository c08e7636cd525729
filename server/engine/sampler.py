"""Turns the last-position logits of each sequence into next tokens (and logprobs)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpilot.server.engine.sequence import Sequence


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]   # per sequence: {token id: logprob} (sampled + top-n)
    sampled_logprobs: list[float]
    errors: dict[int, str] = field(default_factory=dict)  # row -> why no token could be sampled for it


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition (over prompt + output, as in vLLM), presence and frequency (over output) penalties."""
    for row, seq in enumerate(seqs):
        p = seq.params
        if not p.has_penalties:
            continue
        vocab = logits.shape[1]
        out_counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device), minlength=vocab)[:vocab]
        if p.repetition_penalty != 1.0:
            seen = out_counts > 0
            seen[torch.tensor(seq.prompt_token_ids, dtype=torch.long, device=logits.device)] = True
            x = logits[row]
            logits[row] = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        if p.frequency_penalty:
            logits[row] -= p.frequency_penalty * out_counts.to(logits.dtype)
        if p.presence_penalty:
            logits[row] -= p.presence_penalty * (out_counts > 0).to(logits.dtype)
    return logits


def mask_min_tokens(logits: torch.Tensor, seqs: list[Sequence], eos_token_id: int | None) -> None:
    """Until min_tokens are out, EOS and stop token ids cannot be sampled."""
    for row, seq in enumerate(seqs):
        p = seq.params
        if len(seq.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([eos_token_id] if eos_token_id is not None and not p.ignore_eos else [])
            if banned:
                logits[row, banned] = float("-inf")


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Top-k, then top-p (nucleus), then min-p, on one row of temperature-scaled logits.

    The most likely token always survives every filter, so the row never becomes all -inf (a top_p or
    min_p that rounds to 0 or 1 in float32 would otherwise turn the softmax into NaN).
    """
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p (the top one always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        keep = (probs >= min_p * probs.max()) | (logits == logits.max())
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits


class Sampler:
    def __init__(self, eos_token_id: int | None, default_generator: torch.Generator | None = None):
        self.eos_token_id = eos_token_id
        self.default_generator = default_generator

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in seqs):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if any(s.params.has_penalties for s in seqs):
            logits = apply_penalties(logits.clone(), seqs)
        mask_min_tokens(logits, seqs, self.eos_token_id)

        token_ids = logits.argmax(-1).tolist()  # greedy rows keep this
        # A row with no finite logit left (every token banned, or a model that produced NaN/inf) has
        # nothing to sample: that request fails alone, the rest of the batch goes on.
        errors: dict[int, str] = {}
        unusable = ~torch.isfinite(logits).any(-1) | torch.isnan(logits).any(-1) | (logits == float("inf")).any(-1)
        for row in torch.nonzero(unusable).flatten().tolist():
            errors[row] = "no token can be sampled: every token is excluded by the request's parameters, or the model produced non-finite scores"
        for row, seq in enumerate(seqs):
            p = seq.params
            if p.greedy or row in errors:
                continue
            # Shift so the best logit is 0 before dividing (a small temperature cannot overflow it to
            # +inf) and keep masked entries -inf (a huge temperature would give -inf/inf = NaN).
            shifted = logits[row] - logits[row].max()
            scaled = (shifted / p.temperature).masked_fill(shifted == float("-inf"), float("-inf"))
            row_logits = filter_logits(scaled, p.top_k, p.top_p, p.min_p)
            probs = row_logits.softmax(-1)
            generator = seq.generator or self.default_generator
            try:
                token_ids[row] = int(torch.multinomial(probs, 1, generator=generator))
            except RuntimeError as e:  # probabilities that are not a distribution: this row only
                errors[row] = f"sampling failed: {e}"

        logprobs: list[dict[int, float] | None] = [None] * len(seqs)
        sampled: list[float] = [0.0] * len(seqs)
        if raw_logprobs is not None:
            for row, seq in enumerate(seqs):
                if seq.params.logprobs is None or row in errors:
                    continue
                entry = {token_ids[row]: float(raw_logprobs[row, token_ids[row]])}
                if seq.params.logprobs:
                    top = torch.topk(raw_logprobs[row], seq.params.logprobs)
                    for lp, tid in zip(top.values.tolist(), top.indices.tolist()):
                        entry.setdefault(tid, lp)
                logprobs[row] = entry
                sampled[row] = entry[token_ids[row]]
        return SampleResult(token_ids, logprobs, sampled, errors)
