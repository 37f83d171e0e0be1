"""Responses API stream events, numbered as they are made.

An event is a dict `{"type", "sequence_number", ...}` whose values may be msgspec Structs (the
response, items, parts), so `msgspec.json.encode` writes it as the wire JSON. `EventWriter` numbers
events 0, 1, 2, ... with no gaps and hands each to its sink (a foreground stream's queue, the
store's event stream for a background response, or nowhere). The order for one response:

    response.created (full snapshot), response.in_progress (snapshot)
    per output item: output_item.added,
        message:       content_part.added, output_text.delta*, output_text.done, content_part.done
        function_call: function_call_arguments.delta*, function_call_arguments.done
        reasoning:     reasoning_text.delta*, reasoning_text.done
      output_item.done
    exactly one of response.completed | response.incomplete | response.failed | response.cancelled, last
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from sessions.items import Item, OutputText
from sessions.models import Response

Event = dict[str, Any]
Sink = Callable[[Event], Awaitable[None]]

TERMINAL_EVENTS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
    "cancelled": "response.cancelled",
}


async def _discard(event: Event) -> None:
    return None


class EventWriter:
    """Numbers events and passes them to `sink` (see the module docstring)."""

    def __init__(self, sink: Sink | None = None, first: int = 0, extra: dict[str, Any] | None = None):
        """Args:
        first: the first sequence number (a rerun continues after the events already stored).
        extra: fields every event carries (`{"attempt": 2}` for a background rerun).
        """
        self.sink = sink or _discard
        self.next = first
        self.extra = extra or {}

    async def emit(self, type: str, **fields: Any) -> Event:
        event: Event = {"type": type, "sequence_number": self.next, **fields, **self.extra}
        self.next += 1
        await self.sink(event)
        return event

    async def snapshot(self, type: str, response: Response) -> Event:
        """`response.created`, `.in_progress`, `.queued` or a terminal event, with the whole response."""
        return await self.emit(type, response=response)

    async def item_added(self, index: int, item: Item) -> None:
        await self.emit("response.output_item.added", output_index=index, item=item)

    async def item_done(self, index: int, item: Item) -> None:
        await self.emit("response.output_item.done", output_index=index, item=item)

    async def part_added(self, index: int, item_id: str) -> None:
        part = OutputText(text="")
        await self.emit("response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=part)

    async def part_done(self, index: int, item_id: str, text: str) -> None:
        part = OutputText(text=text)
        await self.emit("response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part)

    async def text_delta(self, index: int, item_id: str, delta: str) -> None:
        await self.emit(
            "response.output_text.delta", item_id=item_id, output_index=index, content_index=0, delta=delta, logprobs=[]
        )

    async def text_done(self, index: int, item_id: str, text: str) -> None:
        await self.emit(
            "response.output_text.done", item_id=item_id, output_index=index, content_index=0, text=text, logprobs=[]
        )

    async def reasoning_delta(self, index: int, item_id: str, delta: str) -> None:
        await self.emit(
            "response.reasoning_text.delta", item_id=item_id, output_index=index, content_index=0, delta=delta
        )

    async def reasoning_done(self, index: int, item_id: str, text: str) -> None:
        await self.emit("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0, text=text)

    async def arguments_delta(self, index: int, item_id: str, delta: str) -> None:
        await self.emit("response.function_call_arguments.delta", item_id=item_id, output_index=index, delta=delta)

    async def arguments_done(self, index: int, item_id: str, name: str, arguments: str) -> None:
        await self.emit(
            "response.function_call_arguments.done", item_id=item_id, output_index=index, name=name, arguments=arguments
        )

    async def custom_input_delta(self, index: int, item_id: str, delta: str) -> None:
        await self.emit("response.custom_tool_call_input.delta", item_id=item_id, output_index=index, delta=delta)

    async def custom_input_done(self, index: int, item_id: str, text: str) -> None:
        await self.emit("response.custom_tool_call_input.done", item_id=item_id, output_index=index, input=text)

    async def terminal(self, response: Response) -> Event:
        """The one last event, named after the response's final status."""
        return await self.snapshot(TERMINAL_EVENTS[response.status], response)
