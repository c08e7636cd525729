"""Reasoning models' `<think>…</think>` blocks returned as `reasoning_content` (`--reasoning-parser`),
whole and streamed. torch-free.

- qwen3: the output opens with `<think>` when the model thinks (Qwen3 with thinking off writes none);
- deepseek_r1: the chat template opens the block in the prompt, so everything before `</think>` is
  reasoning, and an output without `</think>` is reasoning throughout.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


class ReasoningParser:
    def __init__(self, kind: str):
        if kind not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {kind!r}")
        self.kind = kind

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None for a part that is not there."""
        stream = self.stream()
        reasoning, content = stream.feed(text, final=True)
        return (reasoning if stream.reasoned else None), (content or None)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.kind)


class ReasoningStream:
    """Splits streamed text into reasoning and content deltas, holding back text that may be the start
    of a tag until it is one or cannot be. However the text is split into deltas, each kind joins to
    what `ReasoningParser.split` returns for the whole ("" where it is None)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.state = "opening"          # then "reasoning", then "content"
        self.reasoned = kind == "deepseek_r1"
        self.fresh = True               # no reasoning emitted yet (the newlines that open it belong to the tag)
        self.content_fresh = True       # no content emitted yet after the block
        self.buffer = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.buffer += delta
        reasoning = content = ""
        if self.state == "opening":  # does the output open with <think>?
            head = self.buffer.lstrip()
            if head.startswith(START):
                self.state, self.reasoned, self.buffer = "reasoning", True, head[len(START):]
            elif START.startswith(head) and not final:
                return "", ""
            else:  # qwen3 without the tag: no thinking; deepseek_r1: the template opened the block
                self.state = "reasoning" if self.kind == "deepseek_r1" else "content"
        if self.state == "reasoning":
            at = self.buffer.find(END)
            if at >= 0:
                reasoning, self.buffer = self.buffer[:at], self.buffer[at + len(END):]
                self.state = "content"
            else:
                keep = 0 if final else partial_tag_suffix(self.buffer, END)
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
        if self.state == "content":
            content, self.buffer = self.buffer, ""
            if self.reasoned and self.content_fresh:  # the blank lines after </think> belong to the tag
                content = content.lstrip()
                self.content_fresh = not content
        if self.fresh:  # newlines are dropped until the first other character, however the deltas split them
            reasoning = reasoning.lstrip("\n")
            self.fresh = not reasoning
        return reasoning, content


def partial_tag_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that is a beginning of tag (text to hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
