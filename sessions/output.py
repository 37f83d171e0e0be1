"""A reply's streamed text to output items and their events.

Text goes through two readers: `ReasoningSplitter` takes out `<think>` reasoning (a `reasoning`
item), then `tools.calls.ToolCallParser` (when tools are declared) tells answer text from calls.
Answer text becomes one `message` item per stretch of text, opened only once it holds more than
whitespace (a calls-only reply has no message item); each call is a `function_call` item, or a
`custom_tool_call` for a custom tool (its input streamed as `response.custom_tool_call_input.*`),
with `name` and `namespace` split apart for a namespace's tool as OpenAI's output carries them.
Item text is kept exactly as the model wrote it, so the next turn renders what the model saw.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from msgspec import UNSET

from sessions.events import EventWriter
from sessions.ids import new_id
from sessions.items import (
    CustomToolCall,
    FunctionCall,
    Item,
    ItemStatus,
    Message,
    OutputText,
    Reasoning,
    ReasoningText,
)
from sessions.reasoning import ReasoningSplitter
from tools.calls import ArgumentsDelta, CallDone, CallStarted, TextDelta, ToolCallParser
from tools.schema import ToolSpec

log = logging.getLogger("longctx.sessions")


@dataclass(slots=True)
class _Open:
    kind: Literal["message", "reasoning", "function_call", "custom_tool_call"]
    index: int
    id: str
    text: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""


class OutputAssembler:
    """Builds `items` from streamed text and emits their events through `writer`.

    Args:
        parser: the tool-call parser, or None when the request declares no tools.
        splitter: the reasoning reader (disabled for templates without `<think>`).
    """

    def __init__(self, writer: EventWriter, parser: ToolCallParser | None, splitter: ReasoningSplitter):
        self.writer, self.parser, self.splitter = writer, parser, splitter
        self.tools: dict[str, ToolSpec] = (parser.tools or {}) if parser is not None else {}
        self.seal: Callable[[str], str] | None = None  # `include: reasoning.encrypted_content` (`sessions.sealed`)
        self.items: list[Item] = []
        self._open: _Open | None = None
        self._pending = ""  # whitespace not yet known to open a message

    @property
    def in_reasoning(self) -> bool:
        return self.splitter.in_reasoning

    async def feed(self, text: str) -> None:
        for piece in self.splitter.feed(text):
            await self._piece(piece.reasoning, piece.text)

    async def finish(self, status: ItemStatus) -> list[Item]:
        """End of the reply: held text is released, the open item closes with `status`."""
        for piece in self.splitter.finish():
            await self._piece(piece.reasoning, piece.text)
        if self.parser is not None:
            for event in self.parser.finish():
                await self._event(event)
        await self._close(status)
        return self.items

    async def _piece(self, reasoning: bool, text: str) -> None:
        if reasoning:
            if self._open is None or self._open.kind != "reasoning":
                await self._close("completed")
                self._open = _Open("reasoning", len(self.items), new_id("rs"))
                self.items.append(Reasoning(id=self._open.id))
                await self.writer.item_added(self._open.index, self.items[-1])
            self._open.text.append(text)
            await self.writer.reasoning_delta(self._open.index, self._open.id, text)
            return
        if self._open is not None and self._open.kind == "reasoning":
            await self._close("completed")
        events = self.parser.feed(text) if self.parser is not None else [TextDelta(text)]
        for event in events:
            await self._event(event)

    async def _event(self, event: TextDelta | CallStarted | ArgumentsDelta | CallDone) -> None:
        w = self.writer
        if isinstance(event, TextDelta):
            o = self._open
            if o is None or o.kind != "message":
                self._pending += event.text
                if not self._pending.strip():
                    return
                await self._close("completed")
                o = self._open = _Open("message", len(self.items), new_id("msg"))
                self.items.append(Message(id=o.id, role="assistant", content=[], status="in_progress"))
                await w.item_added(o.index, self.items[-1])
                await w.part_added(o.index, o.id)
                delta, self._pending = self._pending, ""
            else:
                delta = event.text
            o.text.append(delta)
            await w.text_delta(o.index, o.id, delta)
        elif isinstance(event, CallStarted):
            await self._close("completed")
            self._pending = ""
            tool = self.tools.get(event.name)
            kind: Literal["function_call", "custom_tool_call"] = (
                "custom_tool_call" if tool is not None and tool.kind == "custom" else "function_call"
            )
            o = self._open = _Open(
                kind,
                len(self.items),
                new_id("ctc" if kind == "custom_tool_call" else "fc"),
                call_id=event.id,
                name=event.name,
            )
            self.items.append(self._call(o, "", "in_progress"))
            await w.item_added(o.index, self.items[-1])
        elif isinstance(event, ArgumentsDelta):
            assert self._open is not None and self._open.kind in ("function_call", "custom_tool_call")
            self._open.text.append(event.delta)
            if self._open.kind == "custom_tool_call":
                await w.custom_input_delta(self._open.index, self._open.id, event.delta)
            else:
                await w.arguments_delta(self._open.index, self._open.id, event.delta)
        else:
            if event.error is not None:
                log.warning("tool call %s: %s", event.name, event.error)
            await self._close("completed" if event.error is None else "incomplete", event.arguments)

    async def _close(self, status: ItemStatus, arguments: str | None = None) -> None:
        o, self._open = self._open, None
        if o is None:
            return
        w, text = self.writer, "".join(o.text)
        item: Item
        if o.kind == "message":
            await w.text_done(o.index, o.id, text)
            await w.part_done(o.index, o.id, text)
            item = Message(id=o.id, role="assistant", content=[OutputText(text=text)], status=status)
        elif o.kind == "reasoning":
            await w.reasoning_done(o.index, o.id, text)
            item = Reasoning(id=o.id, content=[ReasoningText(text=text)])
            if self.seal is not None:
                item.encrypted_content = self.seal(text)
        else:
            args = text if arguments is None else arguments
            item = self._call(o, args, status)
            if o.kind == "custom_tool_call":
                await w.custom_input_done(o.index, o.id, args)
            else:
                await w.arguments_done(o.index, o.id, item.name, args)  # type: ignore[union-attr]
        self.items[o.index] = item
        await w.item_done(o.index, item)

    def _call(self, o: _Open, text: str, status: ItemStatus) -> FunctionCall | CustomToolCall:
        """The call item of `o`: a namespace's tool as its own name and the namespace."""
        tool = self.tools.get(o.name)
        namespace = tool.namespace if tool is not None and tool.namespace else UNSET
        name = tool.local_name if tool is not None else o.name
        if o.kind == "custom_tool_call":
            return CustomToolCall(id=o.id, call_id=o.call_id, name=name, input=text, status=status, namespace=namespace)
        return FunctionCall(id=o.id, call_id=o.call_id, name=name, arguments=text, status=status, namespace=namespace)
