"""Turns the sampled rows' logits into next tokens (and logprobs), batched, from SamplingTensors alone.

Two stages: `processed_logits` applies every sampling parameter to all rows at once (penalties,
logit_bias, min_tokens bans, structured-output masks, temperature, top-k, top-p, min-p; the vocabulary is sorted only when some row asks
for top-k or top-p) and `Sampler` draws from the result. The first stage is what rejection sampling
needs for the target's and the draft's distributions alike. No step syncs with the host per row:
each row's parameters are tensors, random rows are drawn by inverse CDF all at once, and the
results come back in one device-to-host copy. A seeded request draws from its own generator for its
own row only, so its output does not depend on what else is batched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvpilot.server.engine.model_io import Penalties, SamplingTensors

NEG_INF = float("-inf")


@dataclass(slots=True)
class SampleResult:
    """Per sampled sequence (not per row): its new tokens (one, or the accepted part of a proposal
    plus one), their logprobs, and why it failed, if it did."""

    token_ids: list[list[int]]
    logprobs: list[list[dict[int, float]] | None]   # per sequence, per token: {token id: logprob} (sampled + top-n)
    errors: dict[int, str] = field(default_factory=dict)  # sequence -> why no token could be sampled for it


def to_host(values: torch.Tensor) -> HostCopy:
    """Start copying a device tensor to the host; on CUDA into pinned memory without blocking."""
    if values.device.type != "cuda":
        return HostCopy(values, None)
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return HostCopy(host, done)


@dataclass(slots=True)
class HostCopy:
    values: torch.Tensor            # host tensor, complete once `done` has passed
    done: torch.cuda.Event | None   # None: already complete (a CPU tensor)

    def tolist(self) -> list:
        if self.done is not None:
            self.done.synchronize()
        return self.values.tolist()


@dataclass(slots=True)
class PendingSample:
    """A launched draw: its tokens on the device at once, the host's SampleResult when the copy lands."""

    tokens: torch.Tensor            # [rows] long, on the device: each row's chosen token (a proposed one where accepted)
    host: HostCopy                  # chosen, unusable, [accepted], [chosen logprob, top values, top indices] as float64
    t: SamplingTensors
    has_accepted: bool
    has_logprobs: bool
    top_n: int
    # Per sampled sequence, on the device: the proposed tokens it accepted (None: no proposals), and
    # its last new token (after the accepted ones), which the next step's input takes.
    accepted_counts: torch.Tensor | None = None
    last_tokens: torch.Tensor | None = None

    @property
    def next_tokens(self) -> torch.Tensor:
        """[sampled sequences] long, on the device: each one's last new token."""
        return self.tokens if self.last_tokens is None else self.last_tokens

    def result(self) -> SampleResult:
        """Wait for the copy (the step's one device-to-host sync) and read it per sequence."""
        t, top_n = self.t, self.top_n
        host = self.host.tolist()
        b = len(t.top_logprobs)
        row_tokens = [int(x) for x in host[:b]]
        bad = host[b:2 * b]
        acc, at = (host[2 * b:3 * b], 3 * b) if self.has_accepted else ([0.0] * b, 2 * b)
        chosen_lp = host[at:at + b]
        values, indices = host[at + b:at + b + b * top_n], host[at + b + b * top_n:]

        def entry(row: int) -> dict[int, float]:
            e = {row_tokens[row]: chosen_lp[row]}
            for j in range(t.top_logprobs[row]):
                e.setdefault(int(indices[row * top_n + j]), values[row * top_n + j])
            return e

        result = SampleResult([], [])
        row = 0
        for s, count in enumerate(t.row_counts):
            take = 1  # a sequence's rows up to and including its first that did not accept its proposed token
            while take < count and acc[row + take - 1]:
                take += 1
            used = range(row, row + take)
            if any(bad[r] for r in used):
                result.errors[s] = NOTHING_TO_SAMPLE
            result.token_ids.append([row_tokens[r] for r in used])
            wants = self.has_logprobs and t.top_logprobs[row] is not None and s not in result.errors
            result.logprobs.append([entry(r) for r in used] if wants else None)
            row += count
        return result


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """Repetition (over prompt + output, as in vLLM), presence and frequency (over output) penalties,
    on the rows that have any, all at once."""
    vocab = logits.shape[1]
    counts = torch.zeros(len(pen.rows), vocab, dtype=logits.dtype, device=logits.device).scatter_add_(1, pen.output_ids, pen.output_valid.to(logits.dtype))
    in_prompt = torch.zeros_like(counts).scatter_add_(1, pen.prompt_ids, pen.prompt_valid.to(logits.dtype))
    seen = (counts > 0) | (in_prompt > 0)
    x = logits[pen.rows]
    x = torch.where(seen, torch.where(x > 0, x / pen.repetition, x * pen.repetition), x)
    x = x - pen.frequency * counts - pen.presence * (counts > 0).to(logits.dtype)
    logits[pen.rows] = x
    return logits


def apply_allowed_tokens(logits: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> None:
    """Structured outputs: on the given rows, every token `allowed` ([G, V] bool) does not allow
    becomes -inf (in place)."""
    constrained = logits[rows]
    logits[rows] = constrained.masked_fill_(~allowed, NEG_INF)


def filter_logits_batch(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                        use_top_k_p: bool = True, use_min_p: bool = True, top_k_bound: int = 0) -> torch.Tensor:
    """Top-k, then top-p (nucleus) over what top-k kept, then min-p over what top-p kept; per row, on
    [rows, vocab] temperature-scaled logits, with [rows] parameters (top_k <= 0: off). The use_* flags
    say whether any row needs a filter at all (sorting the vocabulary is the expensive part);
    top_k_bound, when every row has a top-k, the largest (only that many best tokens are ordered).

    The most likely token always survives every filter, so a row never becomes all -inf (a top_p or
    min_p that rounds to 0 or 1 in float32 would otherwise turn the softmax into NaN)."""
    if use_top_k_p:
        vocab = logits.shape[-1]
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
        sorted_logits, order = _best_first(logits, k, top_k_bound)
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, NEG_INF)  # ties with the k-th stay, as topk's threshold keeps them
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p (the top one always stays).
        # Rows with top_p = 1 are left alone: float rounding can take the running sum to 1 before the tail.
        drop = ((probs.cumsum(-1) - probs) >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        drop[:, 0] = False
        logits = torch.full_like(logits, NEG_INF).scatter_(1, order, sorted_logits.masked_fill(drop, NEG_INF))
    if use_min_p:
        probs = logits.softmax(-1)
        top = probs.max(-1, keepdim=True).values
        keep = (probs >= min_p.unsqueeze(1) * top) | (logits == logits.max(-1, keepdim=True).values)
        logits = logits.masked_fill(~keep, NEG_INF)
    return logits


def _best_first(logits: torch.Tensor, k: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's logits in descending order, with their token ids, as far as the filters look: the
    best `bound` (torch.topk: a 49k vocabulary's sort costs ~20x more) when every row's k is at most
    bound, unless a token past them ties a row's finite k-th logit (top-k keeps ties: then the whole
    vocabulary is sorted)."""
    if 0 < bound < logits.shape[-1]:
        head, order = torch.topk(logits, bound, dim=-1)
        kth = head.gather(1, (k - 1).unsqueeze(1))
        tied_past = ((logits == kth).sum(-1) > (head == kth).sum(-1)) & (kth[:, 0] > NEG_INF)
        if not bool(tied_past.any()):
            return head, order
    return torch.sort(logits, dim=-1, descending=True)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """filter_logits_batch for one row."""
    one = lambda v, dtype: torch.tensor([v], dtype=dtype, device=logits.device)  # noqa: E731
    return filter_logits_batch(logits.unsqueeze(0), one(top_k, torch.long), one(top_p, logits.dtype), one(min_p, logits.dtype))[0]


def processed_logits(logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sampling parameter applied (penalties, logit_bias, min_tokens bans, structured-output
    masks, then temperature and the filters): (all rows' penalised and masked logits, which greedy rows
    argmax; the random rows' temperature-scaled, filtered logits, whose softmax they draw from)."""
    if t.penalties is not None or t.banned_rows.numel() or t.allowed is not None or t.bias is not None:
        logits = logits.clone()
    if t.penalties is not None:
        apply_penalties(logits, t.penalties)
    if t.bias is not None:
        rows, tokens, values = t.bias
        logits.index_put_((rows, tokens), values, accumulate=True)
    if t.banned_rows.numel():
        logits[t.banned_rows, t.banned_tokens] = NEG_INF
    if t.allowed is not None:
        apply_allowed_tokens(logits, t.guided_rows, t.allowed)
    if not t.random_rows:
        return logits, logits[:0]
    rows = t.random_index  # a device index: a host list would be uploaded with a blocking copy
    x = logits[rows]
    # Shift so the best logit is 0 before dividing (a small temperature cannot overflow it to +inf) and
    # keep masked entries -inf (a huge temperature would give -inf/inf = NaN).
    shifted = x - x.max(-1, keepdim=True).values
    scaled = (shifted / t.temperature[rows]).masked_fill(shifted == NEG_INF, NEG_INF)
    return logits, filter_logits_batch(scaled, t.top_k[rows], t.top_p[rows], t.min_p[rows], t.use_top_k_p, t.use_min_p, t.top_k_bound)


NOTHING_TO_SAMPLE = ("no token can be sampled: every token is excluded by the request's parameters, "
                     "or the model produced non-finite scores")


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One draw per row of (unnormalized) probs [R, V], located by uniforms u [R] in the cumulative
    sum: on a CPU ~40x cheaper than torch.multinomial over a 49k vocabulary."""
    cdf = probs.cumsum(-1)
    return torch.searchsorted(cdf, u.unsqueeze(1) * cdf[:, -1:], right=True).clamp_(max=cdf.shape[1] - 1)[:, 0]


class Sampler:
    """Draws a step's tokens. With proposed tokens (speculative decoding) it verifies them exactly:
    a greedy row accepts its proposed token when it is the argmax; a random row accepts it with
    probability min(1, p/q) and otherwise draws from the residual max(0, p - q), normalized (p: the
    target's processed distribution, q: the proposer's; an n-gram proposal is certain, q one-hot).
    The output then has the distribution of sampling from p alone."""

    def __init__(self, default_generator: torch.Generator | None = None):
        self.default_generator = default_generator  # for random rows of unseeded requests

    def uniforms(self, t: SamplingTensors, per_row: int, like: torch.Tensor) -> torch.Tensor:
        """[random rows, per_row] uniforms: a seeded request's from its own generator, so its draws
        do not depend on what else is batched."""
        draw = lambda n, g: torch.rand(n, per_row, generator=g, dtype=like.dtype, device=like.device)  # noqa: E731
        unseeded = sum(g is None for g in t.generators)
        shared = draw(unseeded, self.default_generator) if unseeded else None
        if unseeded == len(t.generators):
            return shared
        rows, k = [], 0
        for g in t.generators:  # assembled in row order without indexing by a host list (a blocking upload)
            if g is None:
                rows.append(shared[k])
                k += 1
            else:
                rows.append(draw(1, g)[0])
        return torch.stack(rows)

    def propose(self, logits: torch.Tensor, t: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A proposer's draw, with every sampling parameter applied as the target will apply it:
        (one token per row, on the device; the random rows' distributions q it was drawn from).
        t None: every row greedy with nothing to apply (the argmax)."""
        if t is None:
            return logits.argmax(-1), None
        penalised, filtered = processed_logits(logits, t)
        tokens = penalised.argmax(-1)
        q = None
        if t.random_rows:
            q = filtered.softmax(-1)
            tokens[t.random_index] = inverse_cdf(q, self.uniforms(t, 1, q)[:, 0])
        return tokens, q

    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> SampleResult:
        return self.draw(logits, t).result()

    def draw(self, logits: torch.Tensor, t: SamplingTensors) -> PendingSample:
        """Launch the step's sampling: the chosen tokens stay on the device (the next step can take its
        inputs from them) and everything the host needs is on its way in one copy, not waited for."""
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(n is not None for n in t.top_logprobs) else None
        penalised, filtered = processed_logits(logits, t)
        # One pass gives the greedy tokens and, from the row maxima, the rows with nothing to sample
        # (every token banned: max -inf; a model that produced NaN/inf: max NaN/inf): such a request
        # fails alone, the rest of the batch goes on.
        best, tokens = penalised.max(-1)
        unusable = ~torch.isfinite(best)
        drafts = t.draft_token_ids
        accepted = None if drafts is None else tokens == drafts  # the greedy rows' verdict (-1 matches nothing)
        if t.random_rows:
            rows = t.random_index
            probs = filtered.softmax(-1)
            u = self.uniforms(t, 1 if drafts is None else 2, probs)
            if drafts is not None:
                d = drafts[rows]
                has = d >= 0
                at = d.clamp(min=0).unsqueeze(1)
                p_d = probs.gather(1, at)[:, 0]
                if t.draft_probs is None:  # a certain proposal: q is one-hot at d
                    q_d, residual = torch.ones_like(p_d), probs.scatter(1, at, 0.0)
                else:
                    q_d, residual = t.draft_probs.gather(1, at)[:, 0], (probs - t.draft_probs).clamp_(min=0)
                accepted[rows] = has & (u[:, 1] * q_d < p_d)
                # Where p <= q everywhere the residual is empty; then p = q and the proposal is always accepted.
                probs = torch.where((has & (residual.sum(-1) > 0)).unsqueeze(1), residual, probs)
            tokens[rows] = inverse_cdf(probs, u[:, 0])
        chosen = tokens if drafts is None else torch.where(accepted, drafts, tokens)
        top_n = max((n or 0 for n in t.top_logprobs), default=0)
        parts = [chosen.to(torch.float64), unusable.to(torch.float64)]
        if accepted is not None:
            parts.append(accepted.to(torch.float64))
        if raw_logprobs is not None:
            parts.append(raw_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).to(torch.float64))
            if top_n:
                top = torch.topk(raw_logprobs, top_n, dim=-1)
                parts += [top.values.to(torch.float64).flatten(), top.indices.to(torch.float64).flatten()]
        counts = last = None
        if t.spec_rows is not None:  # a sequence's accepted tokens: its rows' leading run of accepted proposals
            rows, checks = t.spec_rows
            counts = (accepted[rows] & checks).long().cumprod(1).sum(1)
            last = chosen[rows[:, 0] + counts]
        return PendingSample(chosen, to_host(torch.cat(parts)), t, accepted is not None, raw_logprobs is not None, top_n, counts, last)

