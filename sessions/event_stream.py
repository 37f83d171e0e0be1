"""A response's events as an async iterator: a foreground one fed by its running turn, a
background one read from the store.

The turn runs as its own task and pushes each event into a queue; the consumer (an SSE response)
reads them. A consumer that leaves early (closes the iterator, or its task is cancelled when the
client disconnects) stops the turn: the engine request is aborted and the response still ends
`incomplete` and is committed, once, by the turn's task.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, Protocol

import msgspec

from sessions.events import TERMINAL_EVENTS, Event
from sessions.store import SessionStore
from sessions.turn import Turn

_END: Any = object()


class ResponseEvents(Protocol):
    """A response's events in order, an async iterator: a foreground turn's (`EventStream`), a
    background response's from the store (`stored_events`) or a finished one's (`replay`). A
    consumer that leaves early calls `aclose`."""

    def __aiter__(self) -> AsyncIterator[Event]: ...

    def __anext__(self) -> Awaitable[Event]: ...

    async def aclose(self) -> None: ...


class EventStream(AsyncIterator[Event]):
    """Iterate for the events; `task` finishes with the final response (or the turn's error)."""

    def __init__(self, turn: Turn):
        self.turn = turn
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.task: asyncio.Task[Any] | None = None
        self._done = False

    async def sink(self, event: Event) -> None:
        self.queue.put_nowait(event)

    def start(self) -> EventStream:
        async def drive() -> Any:
            try:
                return await self.turn.run()
            finally:
                self.queue.put_nowait(_END)

        self.task = asyncio.create_task(drive(), name=f"turn {self.turn.id}")
        return self

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> Event:
        if self._done:
            raise StopAsyncIteration
        try:
            event = await self.queue.get()
        except asyncio.CancelledError:
            self._leave()
            raise
        if event is _END:
            self._done = True
            assert self.task is not None
            await self.task  # raises the turn's error, if any
            raise StopAsyncIteration
        return event  # type: ignore[no-any-return]

    async def aclose(self) -> None:
        """The consumer is done: a turn still running is stopped (and commits `incomplete`)."""
        self._leave()

    def _leave(self) -> None:
        if not self._done:
            self._done = True
            self.turn.stop("client_disconnected")


async def replay(events: list[Event]) -> AsyncGenerator[Event, None]:
    """A stream of events already made (an idempotent repeat of a finished stream)."""
    for event in events:
        yield event


_FINAL = frozenset(TERMINAL_EVENTS.values())


async def stored_events(
    store: SessionStore, tenant: str, resp_id: str, starting_after: int | None = None, block_ms: int = 5000
) -> AsyncGenerator[Event, None]:
    """A background response's events from the store (`store.events`) after `starting_after`,
    waiting for new ones until its terminal event (a response already final with no events
    left ends the stream too). NotFound for an unknown response."""
    last = starting_after
    while True:
        batch = await store.events.read(tenant, resp_id, last, block_ms=block_ms)
        for e in batch:
            event: Event = msgspec.json.decode(e.data)
            last = e.seq
            yield event
            if event.get("type") in _FINAL:
                return
        if not batch and (await store.responses.get(tenant, resp_id)).terminal:
            return
