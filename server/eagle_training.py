"""`kvpilot train-eagle OUT_DIR`: an EAGLE-3 head for a model, trained on CPU from text the model
writes itself, saved in the published layout (server/models/eagle.py loads it).

1. Prompts: `--prompts` made here from templates and subjects written for this repository
   (`training_prompts`; no dataset, no network, none of them bench/spec.py's), in a fixed shuffle, and
   `--written-prompts` requests the model writes itself (`written_prompts`).
2. Text: the model answers each prompt greedily through its chat template (`--max-tokens`).
3. What the head learns from: one forward of the model over each prompt + answer gives the residual
   stream entering the head's three layers, and the model's next-token distribution at every position
   (its SOFT_TOP likeliest tokens): the head is trained towards that distribution (EAGLE-3's soft
   labels; chat acceptance 0.32 → 0.37 against the greedy choice alone as label, bench/history/
   "EAGLE-3 VI"), and scored on picking the model's choice, which is what greedy verification accepts.
   Only the answers' positions count (drafts are made only there); the prompt's rows are attended to.
4. Draft vocabulary: the `--draft-vocab` most frequent of the answers' choices; positions whose choice
   is outside it do not count.
5. Training (`--epochs`, AdamW, a fixed seed and thread count: the same command writes the same head):
   two unrolled steps per position, as it drafts — step 1 from the model's states, step 2 from the
   head's own output at the position before, attending to step 1's keys before it and its own. The
   head's LM head and final norm start as the target's own (rows of the draft vocabulary), the LM head
   frozen; a tenth of the texts is held out and the epoch that predicts them best is kept. Measured
   figures: bench/history/ ("EAGLE-3 III" to "VI").
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SUBJECTS = [
    "volcanoes", "the water cycle", "photosynthesis", "the moon landing", "honey bees", "glaciers", "the printing press",
    "electric cars", "coral reefs", "the Roman Empire", "solar panels", "black holes", "chess", "bread baking", "rainforests",
    "the human heart", "earthquakes", "the internet", "penguins", "ancient Egypt", "recycling", "the piano", "tea",
    "the Olympic Games", "wind turbines", "octopuses", "the Great Wall of China", "vaccines", "deserts", "submarines",
    "the speed of light", "mushrooms", "trains", "the stock market", "owls", "gardening", "the periodic table", "bicycles",
    "rain", "libraries", "the Amazon river", "dinosaurs", "clocks", "coffee", "hurricanes", "bridges", "elephants",
    "the alphabet", "satellites", "museums", "tides", "magnets", "the immune system", "compost", "jazz", "origami",
    "the French Revolution", "airplanes", "whales", "antibiotics", "batteries", "cheese making", "the Renaissance", "caves",
    "spiders", "the Silk Road", "rockets", "paper", "the brain", "sleep", "friendship", "money", "maps", "lightning",
    "snowflakes", "the ocean floor", "robots", "democracy", "the Industrial Revolution", "bees and flowers", "fossils",
    "the Sahara", "tigers", "recycling plastic", "the compass", "telescopes", "the violin", "pizza", "chocolate", "rice",
    "the Moon", "Mars", "comets", "the Sun", "gravity", "sound waves", "rainbows", "microscopes", "bacteria", "frogs",
    "migrating birds", "ants", "the Eiffel Tower", "castles", "pyramids", "the Vikings", "samurai", "knights", "pirates",
    "the telephone", "photography", "cinema", "video games", "social media", "email", "cybersecurity", "passwords",
    "programming", "spreadsheets", "databases", "artificial intelligence", "climate change", "forests", "rivers", "islands",
    "mountains", "public transport", "city parks", "farming", "fishing", "vegetarian cooking", "soup", "baking cookies",
    "running", "swimming", "yoga", "football", "basketball", "tennis", "the guitar", "painting", "poetry", "novels",
    "newspapers", "the post office", "hospitals", "nurses", "teachers", "firefighters", "volunteering", "budgeting",
    "saving money", "taxes", "job interviews", "public speaking", "time management", "learning a language", "homework",
    "exams", "kindness", "patience", "curiosity", "teamwork", "dogs", "cats", "horses", "parrots", "goldfish", "houseplants",
    "winter", "spring", "autumn", "summer holidays", "camping", "hiking", "road trips", "airports", "hotels", "markets",
    "the metric system", "fractions", "prime numbers", "geometry", "probability", "electricity", "steam engines", "glass",
    "steel", "wool", "cotton", "plastic", "water pollution", "air quality", "earth's layers", "the Arctic", "Antarctica",
    "kangaroos", "pandas", "sharks", "jellyfish", "butterflies", "seeds", "trees", "the human skeleton", "teeth", "vitamins",
]
TEMPLATES = [
    "Explain {s} to a ten-year-old.",
    "Write three short facts about {s}.",
    "Write a short poem about {s}.",
    "What are the main benefits and drawbacks of {s}?",
    "Summarize the history of {s} in a few sentences.",
    "Give me a quiz question about {s} and its answer.",
    "Describe {s} in one paragraph.",
    "Write a short story that involves {s}.",
    "List five words related to {s}.",
    "Why do people find {s} interesting?",
    "What is {s}?",
    "Tell me something surprising about {s}.",
    "How does {s} work?",
    "What should a beginner know about {s}?",
    "Write a haiku about {s}.",
    "What are some common myths about {s}?",
    "Give me two questions a student might ask about {s}.",
    "How has {s} changed over time?",
    "Write a friendly tweet about {s}.",
    "What would the world be like without {s}?",
    "Can you give me a simple example that explains {s}?",
    "Write a short dialogue between two friends about {s}.",
    "What is the most important thing to know about {s}?",
    "Give me a fun fact about {s}.",
    "Write a short advertisement for a book about {s}.",
    "Explain {s} in three steps.",
    "What are three questions scientists still ask about {s}?",
    "Write a letter to a friend describing {s}.",
    "Compare {s} with something from everyday life.",
    "Give me a title and a first sentence for an essay about {s}.",
]
TASKS = [
    "make a cup of tea", "plant a tree", "write a thank-you note", "start a vegetable garden", "learn to juggle",
    "prepare for a job interview", "save money each month", "study for an exam", "clean a messy room", "bake bread at home",
    "train a puppy", "fix a flat bicycle tire", "write a good email", "make new friends", "stay focused while working",
    "plan a birthday party", "keep a houseplant alive", "start running", "cook rice", "organize a bookshelf",
    "learn to draw", "give a short speech", "reduce food waste", "pack for a trip", "read more books",
    "take better photos", "write a short story", "learn a new word every day", "prepare a picnic", "care for a cat",
    "wake up earlier", "make a budget", "learn to swim", "build a birdhouse", "write a poem", "apologize to a friend",
    "choose a good book", "keep a diary", "make pancakes", "memorize a phone number",
]
TASK_TEMPLATES = [
    "How do I {t}?",
    "Give me some tips to {t}.",
    "What is the easiest way to {t}?",
    "Write step-by-step instructions to {t}.",
    "What mistakes should I avoid when I try to {t}?",
    "My friend wants to {t}. What should I tell them?",
]
PAIRS = [
    ("a lake", "a sea"), ("a virus", "a bacterium"), ("a frog", "a toad"), ("a star", "a planet"), ("a town", "a city"),
    ("a poem", "a song"), ("a crocodile", "an alligator"), ("a hurricane", "a tornado"), ("a rabbit", "a hare"),
    ("a violin", "a cello"), ("a moth", "a butterfly"), ("a hill", "a mountain"), ("a noun", "a verb"), ("a laptop", "a tablet"),
    ("a cafe", "a restaurant"), ("speed", "velocity"), ("a meteor", "a meteorite"), ("an ocean", "a river"),
    ("a map", "a globe"), ("a novel", "a short story"), ("tea", "coffee"), ("a train", "a tram"), ("a cold", "the flu"),
    ("a fruit", "a vegetable"), ("a library", "a bookshop"),
]
PAIR_TEMPLATES = [
    "What is the difference between {a} and {b}?",
    "Which is bigger, {a} or {b}, and why?",
    "Explain how {a} and {b} are alike and how they differ.",
]
# Copying and editing: the model repeats or changes text it was given (what n-gram lookup is best at).
SENTENCES = [
    "The old train left the station at noon and crossed the river before sunset.",
    "Please bring two notebooks, a blue pen and your lunch to the meeting tomorrow.",
    "Our garden has tomatoes, beans and a small apple tree near the fence.",
    "The library will be closed on Monday for cleaning and will open again on Tuesday.",
    "She painted the kitchen yellow and hung three pictures of the sea.",
]
COPY_TEMPLATES = [
    "Repeat this sentence exactly: {t}",
    "Rewrite this sentence in the past tense if needed and keep its meaning: {t}",
    "Write this sentence twice, on two lines: {t}",
    "Change every number word in this sentence to a digit: {t}",
]


def prompt_pool() -> list[str]:
    """Every prompt the lists make: subjects x templates, tasks x task templates, pairs x pair templates,
    sentences x copy templates."""
    return ([t.format(s=s) for t in TEMPLATES for s in SUBJECTS] + [t.format(t=task) for t in TASK_TEMPLATES for task in TASKS]
            + [t.format(a=a, b=b) for t in PAIR_TEMPLATES for a, b in PAIRS] + [t.format(t=s) for t in COPY_TEMPLATES for s in SENTENCES])


def training_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` of the prompt pool's, in a fixed shuffle."""
    prompts = prompt_pool()
    random.Random(seed).shuffle(prompts)
    if count > len(prompts):
        raise ValueError(f"--prompts {count}: there are {len(prompts)}")
    return prompts[:count]


def written_prompts(llm, count: int, seed: int = 0, max_tokens: int = 64) -> list[str]:
    """`count` user requests the model writes itself (Magpie's method): the chat template's opening of
    a user turn, sampled at temperature 1 (top-p 0.95, a seed per request) until the turn ends. A turn
    that does not end within `max_tokens`, has fewer than three words or repeats another is dropped and
    more are drawn. An instruction-tuned model writes requests as broad as its own tuning data's, which
    templates made here cannot be. Cached like the texts (`_cached`)."""
    from kvpilot.server.engine.sampling_params import SamplingParams

    def draw() -> list[str]:
        marker = "\x00request\x00"
        rendered = llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": marker}])
        opening = rendered[:rendered.index(marker)]
        found: dict[str, None] = {}
        drawn = 0
        while len(found) < count:
            batch = (count - len(found)) * 5 // 4 + 2  # a quarter more than wanted: some turns do not end
            params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=max_tokens, seed=seed * 1_000_003 + drawn + i) for i in range(batch)]
            drawn += batch
            for out in llm.generate([opening] * batch, params):
                text = out.outputs[0].text.strip()
                if out.outputs[0].finish_reason == "stop" and len(text.split()) >= 3:
                    found.setdefault(text)
            if drawn > 20 * count:
                raise RuntimeError(f"train-eagle: the model wrote {len(found)} usable requests of {drawn} drawn")
        return list(found)[:count]

    return _cached(llm, ["written-prompts", count, seed, max_tokens], draw)


def _cached(llm, key: list, make):
    """make(), cached as JSON under the kvpilot cache by the model's files, its weight format and `key`:
    what the model writes is the slow part of training and the same every time, so a second training
    run with other settings starts from the cache."""
    import hashlib

    from kvpilot.kernels.cache import cache_root
    from kvpilot.server.model_files import model_fingerprint

    digest = hashlib.sha256(json.dumps([model_fingerprint(llm.engine.model_path), llm.engine.worker.quantization, *key]).encode()).hexdigest()[:24]
    cached = cache_root() / "eagle-texts" / f"{digest}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    value = make()
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")  # engines of one cache may fill the same entry at once
    tmp.write_text(json.dumps(value))
    tmp.replace(cached)
    return value


SOFT_TOP = 32  # the model's most likely next tokens kept per position, as the head's soft labels


@dataclass
class Example:
    tokens: torch.Tensor   # [L] the prompt and the answer
    aux: torch.Tensor      # [L, 3T] bfloat16: the residual stream entering the head's layers
    choice: torch.Tensor   # [L] the model's greedy choice after each position
    top_ids: torch.Tensor  # [L, SOFT_TOP] int32: the model's likeliest next tokens after each position
    top_p: torch.Tensor    # [L, SOFT_TOP] float16: their probabilities
    answer_start: int = 0  # the answer's first position: the head learns to draft the tokens after it


def write_texts(llm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """The model's greedy answers (prompt + answer ids), cached (`_cached`) by the prompts and max_tokens."""
    from kvpilot.server.engine.sampling_params import SamplingParams

    def answer() -> list[list[int]]:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], SamplingParams(temperature=0, max_tokens=max_tokens))
        return [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]

    return _cached(llm, [prompts, max_tokens], answer)


def answer_starts(tokenizer, prompts: list[str], texts: list[list[int]]) -> list[int]:
    """Where each text's answer begins: after its prompt through the chat template (checked against the text)."""
    starts = []
    for prompt, ids in zip(prompts, texts, strict=True):
        head = tokenizer.encode_chat([{"role": "user", "content": prompt}])
        if ids[:len(head)] != head:
            raise RuntimeError(f"train-eagle: a cached text does not start with its prompt {prompt[:60]!r}")
        starts.append(len(head))
    return starts


@torch.inference_mode()
def read_states(runner, sequences: list[list[int]], aux_layers: tuple[int, ...], answer_starts: list[int] | None = None) -> list[Example]:

    examples = []
    declared = runner.model.aux_layers
    runner.model.declare_aux_output(aux_layers)
    try:
        for j, ids in enumerate(sequences):
            n = len(ids)
            meta = runner.one_prefill(n)
            hidden, aux = runner.model(torch.tensor(ids), torch.arange(n), runner.kv_caches, meta)
            logits = runner.model.compute_logits(hidden).float()
            top = logits.softmax(-1).topk(SOFT_TOP, dim=-1)
            examples.append(Example(torch.tensor(ids), aux.to(torch.bfloat16), logits.argmax(-1), top.indices.to(torch.int32),
                                    top.values.to(torch.float16), answer_starts[j] if answer_starts else 0))
    finally:
        runner.model.declare_aux_output(declared)
    return examples


class TrainingHead(nn.Module):
    """The head's math in plain, differentiable torch (the serving module uses the engine's kernels)."""

    def __init__(self, target, embed: torch.Tensor, draft_vocab: int, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                 output: tuple[torch.Tensor, torch.Tensor] | None = None):
        """output: the target's own LM-head rows of the draft vocabulary and its final norm weight, to start
        the head's from (its LM head then stays frozen, as EAGLE-1's: 5M fewer parameters to fit to a
        few tens of thousands of tokens, and states the target's head already reads)."""
        super().__init__()
        c = target
        h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.heads, self.kv_heads, self.head_dim, self.eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("cos", rope_cos, persistent=False)
        self.register_buffer("sin", rope_sin, persistent=False)
        lin = lambda i, o: nn.Linear(i, o, bias=False)  # noqa: E731
        self.fc, self.q, self.k, self.v, self.o = lin(3 * h, h), lin(2 * h, q), lin(2 * h, kv), lin(2 * h, kv), lin(q, h)
        self.gate, self.up, self.down = lin(h, c.intermediate_size), lin(h, c.intermediate_size), lin(c.intermediate_size, h)
        self.lm_head = lin(h, draft_vocab)
        self.norms = nn.ParameterDict({n: nn.Parameter(torch.ones(h)) for n in ("embed", "hidden", "post", "final")})
        if output is not None:
            rows, final_norm = output
            with torch.no_grad():
                self.lm_head.weight.copy_(rows)
                self.norms["final"].copy_(final_norm)
            self.lm_head.weight.requires_grad_(False)

    def rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.norms[name]

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[B, L, heads, d], the half-split pairs (i, i + d/2) as the engine rotates them."""
        cos, sin = self.cos[positions][:, :, None, :], self.sin[positions][:, :, None, :]
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def project(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """(q, k, v) of rows taking `tokens` with `hidden`; q [B, heads, L, d], k/v [B, heads, L, d] (KV heads repeated)."""
        b, n, _ = hidden.shape
        x = torch.cat([self.rms(F.embedding(tokens, self.embed), "embed"), self.rms(hidden, "hidden")], dim=-1)
        q = self.rope(self.q(x).view(b, n, self.heads, self.head_dim), positions)
        k = self.rope(self.k(x).view(b, n, self.kv_heads, self.head_dim), positions)
        v = self.v(x).view(b, n, self.kv_heads, self.head_dim)
        repeat = self.heads // self.kv_heads
        return q.transpose(1, 2), k.repeat_interleave(repeat, dim=2).transpose(1, 2), v.repeat_interleave(repeat, dim=2).transpose(1, 2)

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The layer after attention: o + residual, then the MLP; the pre-norm output."""
        b, _, n, _ = attn.shape
        a = self.o(attn.transpose(1, 2).reshape(b, n, -1)) + residual
        m = self.rms(a, "post")
        return a + self.down(F.silu(self.gate(m)) * self.up(m))

    def forward(self, tokens: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft-vocabulary logits of step 1 and step 2 at every position ([B, L, V'] each)."""
        h1 = self.fc(aux)
        q1, k1, v1 = self.project(tokens, h1, positions)
        pre1 = self.finish(F.scaled_dot_product_attention(q1, k1, v1, is_causal=True), h1)
        # Step 2 at position p: the head's own output at p - 1 as the hidden state, step 1's keys before p and its own.
        h2 = torch.cat([torch.zeros_like(pre1[:, :1]), pre1[:, :-1]], dim=1)
        q2, k2, v2 = self.project(tokens, h2, positions)
        n = tokens.shape[1]
        before = torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril(-1)
        scores = (q2 @ k1.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~before, float("-inf"))
        own = (q2 * k2).sum(-1, keepdim=True) / math.sqrt(self.head_dim)
        weights = torch.softmax(torch.cat([scores, own], dim=-1), dim=-1)
        attn2 = weights[..., :n] @ v1 + weights[..., n:] * v2
        pre2 = self.finish(attn2, h2)
        return self.lm_head(self.rms(pre1, "final")), self.lm_head(self.rms(pre2, "final"))


def _batches(examples: list[Example], size: int, rng: random.Random):
    order = list(range(len(examples)))
    rng.shuffle(order)
    for i in range(0, len(order), size):
        yield [examples[j] for j in order[i:i + size]]


def _pad(batch: list[Example], to_draft: torch.Tensor):
    """Row p takes the token at p + 1 and predicts the model's choice after it; labels -100 where not counted:
    rows predicting a token of the prompt or the answer's first (the target samples that one itself) —
    drafts are only ever made inside answers, and the prompt's tokens are not the model's writing."""
    n = max(len(e.tokens) for e in batch) - 1
    tokens = torch.zeros(len(batch), n, dtype=torch.long)
    aux = torch.zeros(len(batch), n, batch[0].aux.shape[-1])
    labels = torch.full((len(batch), n), -100, dtype=torch.long)
    soft_ids = torch.zeros(len(batch), n, SOFT_TOP, dtype=torch.long)
    soft_p = torch.zeros(len(batch), n, SOFT_TOP)
    for i, e in enumerate(batch):
        m = len(e.tokens) - 1
        tokens[i, :m] = e.tokens[1:]
        aux[i, :m] = e.aux[:m].float()
        labels[i, :m] = to_draft[e.choice[1:]]
        labels[i, :max(e.answer_start - 1, 0)] = -100
        ids = to_draft[e.top_ids[1:].long()]
        soft_ids[i, :m] = ids.clamp(min=0)
        soft_p[i, :m] = e.top_p[1:].float() * (ids >= 0)  # tokens outside the draft vocabulary drop out
    soft_p /= soft_p.sum(-1, keepdim=True).clamp(min=1e-6)
    return tokens, aux, labels, (soft_ids, soft_p)


def train(examples: list[Example], target, embed: torch.Tensor, draft_ids: list[int], rope_cos, rope_sin, epochs: int, seed: int,
          batch_size: int = 8, lr: float = 1e-3, log=print, output: tuple[torch.Tensor, torch.Tensor] | None = None,
          held_out: float = 0.1) -> TrainingHead:
    """Train on all but `held_out` of the examples (a fixed draw); with a held-out part, each epoch is
    scored on it and the best epoch's weights are kept (a head this small memorises its data)."""
    torch.manual_seed(seed)
    head = TrainingHead(target, embed, len(draft_ids), rope_cos, rope_sin, output)
    to_draft = torch.full((target.vocab_size,), -100, dtype=torch.long)
    to_draft[torch.tensor(draft_ids)] = torch.arange(len(draft_ids))
    rng = random.Random(seed)
    order = list(range(len(examples)))
    rng.shuffle(order)
    cut = int(len(examples) * held_out)
    held, examples = [examples[i] for i in order[:cut]], [examples[i] for i in order[cut:]]
    steps = epochs * -(-len(examples) // batch_size)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(steps, 1), pct_start=0.05)
    best: tuple[float, int, dict] | None = None
    for epoch in range(epochs):
        started = time.monotonic()
        head.train()
        loss, right = _epoch(head, examples, batch_size, rng, to_draft, opt, schedule)
        line = f"train-eagle: epoch {epoch + 1}/{epochs}: loss {loss:.3f}, step-1 accuracy {right[0]:.3f}, step-2 {right[1]:.3f}"
        if held:
            head.eval()
            with torch.no_grad():
                _, seen = _epoch(head, held, batch_size, rng, to_draft)
            line += f"; held out ({len(held)} texts): step-1 {seen[0]:.3f}, step-2 {seen[1]:.3f}"
            if best is None or sum(seen) > best[0]:
                best = (sum(seen), epoch + 1, {k: v.clone() for k, v in head.state_dict().items()})
        log(f"{line} ({time.monotonic() - started:.0f} s)")
    if best is not None:
        head.load_state_dict(best[2])
        log(f"train-eagle: kept epoch {best[1]} (best on the held-out texts)")
    return head


def _epoch(head: TrainingHead, examples: list[Example], batch_size: int, rng: random.Random, to_draft: torch.Tensor,
           opt=None, schedule=None) -> tuple[float, tuple[float, float]]:
    """One pass (a training step per batch when opt is given): mean loss, step-1 and step-2 accuracy."""
    total, right, counted = 0.0, [0, 0], 0
    for batch in _batches(examples, batch_size, rng):
        tokens, aux, labels, soft = _pad(batch, to_draft)
        positions = torch.arange(tokens.shape[1]).expand_as(tokens)
        logits1, logits2 = head(tokens, aux, positions)
        valid = labels >= 0
        loss = _soft_cross_entropy(logits1, soft, valid) + 0.5 * _soft_cross_entropy(logits2[:, 1:], [t[:, 1:] for t in soft], valid[:, 1:])
        if opt is not None:
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            schedule.step()
        total += loss.item() * int(valid.sum())
        counted += int(valid.sum())
        right[0] += int((logits1.argmax(-1) == labels)[valid].sum())
        right[1] += int((logits2[:, 1:].argmax(-1) == labels[:, 1:])[valid[:, 1:]].sum())
    n = max(counted, 1)
    return total / n, (right[0] / n, right[1] / n)


def _soft_cross_entropy(logits: torch.Tensor, soft: tuple[torch.Tensor, torch.Tensor], valid: torch.Tensor) -> torch.Tensor:
    """The model's next-token distribution (its SOFT_TOP likeliest in the draft vocabulary, renormalised)
    against the head's, over the counted rows: EAGLE-3's loss, which carries what the model thinks of
    every likely token, not its choice alone (a stronger signal from few texts)."""
    ids, p = soft
    logq = logits.log_softmax(-1).gather(-1, ids)
    return -(p * logq).sum(-1)[valid].mean()


def save(head: TrainingHead, target, draft_ids: list[int], aux_layers: tuple[int, ...], out: Path, provenance: dict) -> None:
    """The published layout: config.json + model.safetensors (float16) + how it was made."""
    from safetensors.torch import save_file

    q, kv = target.num_heads * target.head_dim, target.num_kv_heads * target.head_dim
    m = "midlayer."
    tensors = {"fc.weight": head.fc.weight, m + "input_layernorm.weight": head.norms["embed"], m + "hidden_norm.weight": head.norms["hidden"],
               m + "self_attn.q_proj.weight": head.q.weight, m + "self_attn.k_proj.weight": head.k.weight,
               m + "self_attn.v_proj.weight": head.v.weight, m + "self_attn.o_proj.weight": head.o.weight,
               m + "post_attention_layernorm.weight": head.norms["post"], m + "mlp.gate_proj.weight": head.gate.weight,
               m + "mlp.up_proj.weight": head.up.weight, m + "mlp.down_proj.weight": head.down.weight,
               "norm.weight": head.norms["final"], "lm_head.weight": head.lm_head.weight}
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in tensors.items()}
    assert tensors[m + "self_attn.q_proj.weight"].shape[0] == q and tensors[m + "self_attn.k_proj.weight"].shape[0] == kv
    ids = torch.tensor(draft_ids, dtype=torch.long)
    tensors["d2t"] = ids - torch.arange(len(draft_ids))
    tensors["t2d"] = torch.zeros(target.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": target.hidden_size,
              "intermediate_size": target.intermediate_size, "num_attention_heads": target.num_heads, "num_key_value_heads": target.num_kv_heads,
              "head_dim": target.head_dim, "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": target.rms_norm_eps,
              "vocab_size": target.vocab_size, "draft_vocab_size": len(draft_ids), "target_hidden_size": target.hidden_size,
              "rope_theta": target.rope_theta, "max_position_embeddings": target.max_position, "tie_word_embeddings": False,
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layers), "use_aux_hidden_state": True}}
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "TRAINING.json").write_text(json.dumps(provenance, indent=1) + "\n")


def train_eagle(out: str | Path, model: str = "smollm2-135m", prompts: int = 1500, max_tokens: int = 128, draft_vocab: int = 8192,
                epochs: int = 8, seed: int = 0, threads: int = 2, quantization: str = "auto", written: int = 1500, log=print) -> Path:
    """prompts: of the templated ones; written: requests the model writes itself (`written_prompts`).
    quantization: the target's weight format while it writes and reads (the one it will be served in:
    the head learns from those hidden states)."""
    from kvpilot.server.llm import LLM

    torch.manual_seed(seed)
    started = time.monotonic()
    llm = LLM(model=model, num_threads=threads, show_progress=False, kv_cache_memory="256MiB", max_model_len=512, quantization=quantization)
    engine = llm.engine
    target, runner = engine.model_config, engine.worker
    aux_layers = (2, target.num_layers // 2, target.num_layers - 3)  # the reference loaders' default (29 for L - 3: no better, measured)
    asked = training_prompts(prompts, seed)
    texts = write_texts(llm, asked, max_tokens)
    if written:
        requests = written_prompts(llm, written, seed)
        log(f"train-eagle: {len(requests)} requests written by {model} ({time.monotonic() - started:.0f} s)")
        texts += write_texts(llm, requests, max_tokens)
        asked += requests
    log(f"train-eagle: {len(texts)} texts, {sum(map(len, texts))} tokens written by {model} ({time.monotonic() - started:.0f} s)")
    examples = read_states(runner, texts, aux_layers, answer_starts(engine.tokenizer, asked, texts))
    counts = Counter(int(t) for e in examples for t in e.choice[max(e.answer_start, 1):])
    draft_ids = sorted(t for t, _ in counts.most_common(draft_vocab))
    covered = sum(c for t, c in counts.items() if t in set(draft_ids)) / max(sum(counts.values()), 1)
    log(f"train-eagle: draft vocabulary {len(draft_ids)} tokens ({100 * covered:.1f}% of the model's choices); states read "
        f"({time.monotonic() - started:.0f} s)")
    embed = _dense_embedding(runner.model)
    rotary = runner.model.rotary
    head = train(examples, target, embed, draft_ids, rotary.cos, rotary.sin, epochs, seed, log=log,
                 output=(_dense_lm_head(runner.model)[torch.tensor(draft_ids)], runner.model.norm.weight.detach().float()))
    provenance = {"command": f"kvpilot train-eagle OUT --model {model} --prompts {prompts} --max-tokens {max_tokens} --draft-vocab {draft_vocab} "
                             f"--epochs {epochs} --seed {seed} --threads {threads} --quantization {quantization} --written-prompts {written}",
                  "prompts": prompts, "written_prompts": written, "tokens": sum(map(len, texts)), "seconds": round(time.monotonic() - started), "torch": torch.__version__}
    save(head, target, draft_ids, aux_layers, Path(out), provenance)
    log(f"train-eagle: wrote {out} ({time.monotonic() - started:.0f} s)")
    return Path(out)


@torch.inference_mode()
def _dense_lm_head(model) -> torch.Tensor:
    """The model's LM head as float32 [vocab, hidden], whatever its weight format (its logits of the identity)."""
    return model.compute_logits(torch.eye(model.config.hidden_size)).T.clone()


def _dense_embedding(model) -> torch.Tensor:
    """The model's embedding table as float32 (GGUF blocks dequantized): the head embeds with it."""
    from kvpilot.kernels.quantized import embedding

    with torch.inference_mode():
        return embedding(torch.arange(model.config.vocab_size), model.embed).float().clone()
