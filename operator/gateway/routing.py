"""Which engine pod gets a request: consistent hashing with bounded loads over the prompt's prefix.

The key is the leading characters of the prompt (for chat, of the messages in a fixed rendering —
the gateway has no tokenizer or template), hashed onto a ring of the ready pods (64 virtual points
each, hashed with BLAKE2b so that every gateway replica builds the same ring). A request goes to the
first pod clockwise from its key whose in-flight count stays within (1 + ε) × the mean after adding
it (Mirrokni, Thorup and Zadimoghaddam's bounded loads), or within MIN_SPILL_LOAD at low load: the
same prefix keeps landing on the same replica — whose prefix cache holds it — until that replica is
busier than the rest, and a pod that joins or leaves moves only the keys next to it.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

PREFIX_CHARS = 256   # how much of the prompt decides the route (a system prompt's worth)
VIRTUAL_POINTS = 64  # points per pod on the ring: evens out the share of keys each pod gets
LOAD_EPSILON = 0.25  # a pod may take up to 1.25 × the mean in-flight load before keys spill past it …
MIN_SPILL_LOAD = 4   # … but never spills below this many: a few requests are one batch for the engine
                     # (continuous batching), and spilling them would only cost a prefix-cache miss


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


def _text(content: Any) -> str:
    """A chat message's content as text (a string, or OpenAI content parts of type text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prefix_key(path: str, body: Mapping[str, Any], chars: int = PREFIX_CHARS) -> str:
    """The routing key of a request body: the first `chars` characters of what the engine will see first."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        text = "".join(f"<|{m.get('role')}|>{_text(m.get('content'))}" for m in messages if isinstance(m, dict)) if isinstance(messages, list) else ""
    elif path.endswith("/responses"):  # the instructions, then the input (text, or its items' text)
        items = body.get("input")
        text = items if isinstance(items, str) else "".join(
            f"<|{m.get('role')}|>{_text(m.get('content'))}" for m in items if isinstance(m, dict)) if isinstance(items, list) else ""
        instructions = body.get("instructions")
        text = f"<|system|>{instructions}{text}" if isinstance(instructions, str) else text
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]  # a batch of prompts: routed by the first
        if isinstance(prompt, list):  # token ids
            text = ",".join(str(t) for t in prompt[:chars])
        else:
            text = prompt if isinstance(prompt, str) else ""
    return text[:chars]


class HashRing:
    """The ready pods (by endpoint, e.g. "10.1.2.3:8000") on a hash ring."""

    def __init__(self, endpoints: Iterable[str], virtual_points: int = VIRTUAL_POINTS):
        self.endpoints = sorted(set(endpoints))
        points = sorted((_hash(f"{e}#{i}"), e) for e in self.endpoints for i in range(virtual_points))
        self._hashes = [h for h, _ in points]
        self._owners = [e for _, e in points]

    def candidates(self, key: str) -> Iterator[str]:
        """Every pod once, in ring order from the key's position."""
        if not self._owners:
            return
        start = bisect.bisect(self._hashes, _hash(key))
        seen: set[str] = set()
        for i in range(len(self._owners)):
            owner = self._owners[(start + i) % len(self._owners)]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.endpoints):
                    return


def choose(ring: HashRing, key: str, in_flight: Mapping[str, int], epsilon: float = LOAD_EPSILON, min_load: int = MIN_SPILL_LOAD) -> str | None:
    """The pod for `key`: the first in ring order whose load, with this request, is within the bound."""
    if not ring.endpoints:
        return None
    total = sum(in_flight.get(e, 0) for e in ring.endpoints) + 1
    bound = max(math.ceil((1 + epsilon) * total / len(ring.endpoints)), min_load)
    first = None
    for endpoint in ring.candidates(key):
        first = first or endpoint
        if in_flight.get(endpoint, 0) + 1 <= bound:
            return endpoint
    return first  # unreachable (some pod is at or below the mean), kept total for safety
