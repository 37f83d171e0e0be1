"""A Chat Completions reply from streamed model text: the `delta`s of its chunks and its final message.

Text goes through the same two readers as a Responses turn (`sessions.reasoning.ReasoningSplitter`
for `<think>` templates, then `tools.calls.ToolCallParser` when tools are declared): reasoning
becomes `reasoning_content`, answer text `content`, and each call a `tool_calls` entry
(`CallStarted` gives its index, id, type and name; `ArgumentsDelta` its arguments as they stream).
Logprobs become OpenAI's `{token, logprob, bytes, top_logprobs}` through the tokenizer.
"""

from __future__ import annotations

from typing import Any

from engine.loading.tokenizer import Tokenizer
from engine.request import TokenLogprob
from sessions.reasoning import ReasoningSplitter
from tools.calls import ArgumentsDelta, CallDone, CallStarted, TextDelta, ToolCallParser


class ChatReply:
    """Reads one reply (see the module docstring): `feed` (a `sessions.generation.Reply`) and
    `finish` collect the deltas to stream, which `take` hands out."""

    def __init__(self, parser: ToolCallParser | None, splitter: ReasoningSplitter):
        self.parser, self.splitter = parser, splitter
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self._pending = ""  # leading whitespace, held until text follows it
        self._deltas: list[dict[str, Any]] = []

    async def feed(self, text: str) -> None:
        for piece in self.splitter.feed(text):
            self._deltas += self._piece(piece.reasoning, piece.text)

    def finish(self) -> None:
        """End of the reply: text held back is released, an open call is closed."""
        for piece in self.splitter.finish():
            self._deltas += self._piece(piece.reasoning, piece.text)
        if self.parser is not None:
            for event in self.parser.finish():
                self._deltas += self._event(event)

    def take(self) -> list[dict[str, Any]]:
        """The deltas made since the last call."""
        out, self._deltas = self._deltas, []
        return out

    def message(self) -> dict[str, Any]:
        """The final `message`: content is null when the reply only calls tools."""
        text = "".join(self.content)
        msg: dict[str, Any] = {"role": "assistant", "content": text if text or not self.calls else None}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg

    def _piece(self, reasoning: bool, text: str) -> list[dict[str, Any]]:
        if reasoning:
            self.reasoning.append(text)
            return [{"reasoning_content": text}]
        events = self.parser.feed(text) if self.parser is not None else [TextDelta(text)]
        out: list[dict[str, Any]] = []
        for event in events:
            out += self._event(event)
        return out

    def _event(self, event: TextDelta | CallStarted | ArgumentsDelta | CallDone) -> list[dict[str, Any]]:
        if isinstance(event, TextDelta):
            if not self.content:  # a reply does not open with whitespace alone
                self._pending += event.text
                if not self._pending.strip():
                    return []
                text, self._pending = self._pending, ""
            else:
                text = event.text
            self.content.append(text)
            return [{"content": text}]
        if isinstance(event, CallStarted):
            index = len(self.calls)
            self.calls.append({"id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}})
            fn = {"name": event.name, "arguments": ""}
            return [{"tool_calls": [{"index": index, "id": event.id, "type": "function", "function": fn}]}]
        if isinstance(event, ArgumentsDelta):
            index = len(self.calls) - 1
            self.calls[index]["function"]["arguments"] += event.delta
            return [{"tool_calls": [{"index": index, "function": {"arguments": event.delta}}]}]
        if self.calls:  # CallDone: the arguments as the parser settled them
            self.calls[-1]["function"]["arguments"] = event.arguments
        return []


def token_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob], top_n: int) -> list[dict[str, Any]]:
    """OpenAI's `logprobs.content` entries for `logprobs` (the model's raw distribution)."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": max(float(logprob), -9999.0), "bytes": list(token.encode())}

    out = []
    for lp in logprobs:
        e = entry(lp.token_id, lp.logprob)
        e["top_logprobs"] = [entry(t, p) for t, p in lp.top[:top_n]]
        out.append(e)
    return out
