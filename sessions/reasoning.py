"""Reasoning text out of a reply, for templates that think in `<think>` ... `</think>` (Qwen3,
DeepSeek-R1): what the model writes between the tags becomes a `reasoning` item, never message text.

`ReasoningSplitter` reads the reply as it streams, in chunks of any size, and hands each piece on
as reasoning or as answer text; a possible tag at the end of a chunk is held back until the next
chunk decides. A reply that opens with `<think>` (after whitespace) reasons until `</think>`; a
prompt whose generation prompt already opened `<think>` starts inside the reasoning.
"""

from __future__ import annotations

from typing import NamedTuple

OPEN, CLOSE = "<think>", "</think>"


class Piece(NamedTuple):
    reasoning: bool
    text: str


def uses_reasoning(chat_template: str) -> bool:
    """Whether the template writes (or drops) `<think>` blocks."""
    return OPEN in chat_template


def opens_in_reasoning(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an open `<think>` block."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


class ReasoningSplitter:
    """See the module docstring. `enabled=False` passes everything through as answer text."""

    def __init__(self, enabled: bool = True, in_reasoning: bool = False):
        self._state = ("think" if in_reasoning else "start") if enabled else "answer"
        self._held = ""

    @property
    def in_reasoning(self) -> bool:
        return self._state == "think"

    def feed(self, chunk: str) -> list[Piece]:
        out: list[Piece] = []
        text, self._held = self._held + chunk, ""
        while text:
            if self._state == "answer":
                out.append(Piece(False, text))
                break
            if self._state == "start":
                stripped = text.lstrip()
                if not stripped:
                    self._held = text
                    break
                if stripped.startswith(OPEN):
                    self._state, text = "think", stripped[len(OPEN) :]
                elif OPEN.startswith(stripped):
                    self._held = text
                    break
                else:
                    self._state = "answer"
                continue
            i = text.find(CLOSE)  # state "think"
            if i >= 0:
                if i:
                    out.append(Piece(True, text[:i]))
                self._state, text = "answer", text[i + len(CLOSE) :]
                continue
            keep = _partial_suffix(text, CLOSE)
            if len(text) > keep:
                out.append(Piece(True, text[: len(text) - keep]))
            self._held = text[len(text) - keep :]
            break
        return [p for p in out if p.text]

    def finish(self) -> list[Piece]:
        """End of the reply: held text goes out as what it was read as."""
        held, self._held = self._held, ""
        if not held:
            return []
        return [Piece(self._state == "think", held)]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
