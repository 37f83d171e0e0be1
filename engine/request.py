"""A request's state inside the engine, and the handle its caller reads tokens from.

The engine thread pushes `RequestOutput`s into the handle; the caller iterates it either
blocking (`for out in handle`) or from asyncio (`async for out in handle`). The two sides
meet through a thread-safe queue; an asyncio consumer is woken with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple

from engine.sampling_params import SamplingParams
from engine.scheduling.page_table import PageTable

if TYPE_CHECKING:
    from engine.sampling.grammar import Matcher
    from engine.scheduling.images import RequestImages


class ContextTooLong(ValueError):
    """A request that can never fit: prompt + max_tokens over the model's context or the KV capacity."""

    def __init__(self, needed: int, limit: int, what: str):
        self.needed, self.limit = needed, limit
        super().__init__(f"prompt + max_tokens = {needed} tokens exceeds the {what} of {limit} tokens")


class EngineOverloaded(RuntimeError):
    """More requests queued (added, not yet running) than `EngineConfig.max_queued`; nothing was
    queued. `retry_after_s` is a hint for the caller's Retry-After."""

    def __init__(self, queued: int, limit: int, retry_after_s: float = 1.0):
        self.queued, self.limit, self.retry_after_s = queued, limit, retry_after_s
        super().__init__(f"{queued} requests already queued (max_queued={limit}); retry in {retry_after_s:.0f} s")


class EngineClosed(RuntimeError):
    """`add_request` after `shutdown()`."""


class FinishReason(StrEnum):
    STOP = "stop"  # end-of-sequence token, stop token, stop string or finished grammar
    LENGTH = "length"  # max_tokens
    ABORT = "abort"
    ERROR = "error"  # e.g. a grammar that dead-ends


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-n (token id, logprob), best first


class RequestOutput(NamedTuple):
    """One increment of a request's output; the last one carries `finish_reason`.

    `logprobs`, when present, has one entry per id in `token_ids`: a token that ends the request
    without being emitted (end-of-sequence, a stop token, one the grammar rejects) has none.
    """

    request_id: str
    token_ids: list[int]
    text_delta: str
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None


class ConsumerGone(RuntimeError):
    """The handle's asyncio consumer can no longer be woken (its event loop has closed)."""


def push_all(items: list[tuple[RequestHandle, RequestOutput]]) -> list[RequestHandle]:
    """`push` each output to its handle (in order), waking each asyncio loop once for all of its
    consumers rather than once per handle: a step's outputs for 16 streams cost the loop one
    wake-up and one write to its self-pipe, not 16 (and none when pushed on that loop's own
    thread: its consumers' events are set at once). Returns the handles whose consumer's loop has
    closed (`ConsumerGone` of `push`), for the caller to abort those not finished."""
    wake: dict[asyncio.AbstractEventLoop, list[tuple[RequestHandle, asyncio.Event]]] = {}
    for handle, out in items:
        waiting = handle._put(out)
        if waiting is not None:
            wake.setdefault(waiting[0], []).append((handle, waiting[1]))
    gone: list[RequestHandle] = []
    try:
        here = asyncio.get_running_loop()  # pushed from a callback on a loop (the channel read there)
    except RuntimeError:
        here = None
    for loop, pairs in wake.items():
        events = [event for _, event in pairs]
        if loop is here:
            _set_all(events)
            continue
        try:
            loop.call_soon_threadsafe(_set_all, events)
        except RuntimeError:  # "Event loop is closed"
            for handle, _ in pairs:
                handle._detach()
                gone.append(handle)
    return gone


def _set_all(events: list[asyncio.Event]) -> None:
    for event in events:
        event.set()


class RequestHandle:
    """The caller's side of a request.

    Iterate it blocking (`for out in handle`) or from asyncio (`async for out in handle`). A
    consumer that stops early (break, a cancelled task, an exception) aborts the request, so
    nothing keeps generating for nobody; so does leaving `with handle:` / `async with handle:`
    before the final output.
    """

    _END = object()

    def __init__(self, request_id: str, abort: Callable[[str], None]):
        self.id = request_id
        self._abort = abort
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._closed = False  # the final output has been pushed
        self.finished = False  # the consumer has read the final output

    @property
    def done(self) -> bool:
        """True once the engine has pushed the final output (the consumer may not have read it)."""
        return self._closed

    def push(self, out: RequestOutput) -> None:
        """Called by the engine thread; outputs after the final one are dropped.

        Raises:
            ConsumerGone: the output is queued, but the asyncio consumer's loop has closed; the
                engine ends the request (later pushes only queue).
        """
        waiting = self._put(out)
        if waiting is None:
            return
        try:
            waiting[0].call_soon_threadsafe(waiting[1].set)
        except RuntimeError as e:  # "Event loop is closed"
            self._detach()
            raise ConsumerGone(f"the consumer of request {self.id!r} is gone: {e}") from e

    def _put(self, out: RequestOutput) -> tuple[asyncio.AbstractEventLoop, asyncio.Event] | None:
        """Queue `out`; the asyncio consumer's loop and event to wake, if it has one."""
        with self._lock:
            if self._closed:
                return None
            self._closed = out.finish_reason is not None
            self._queue.put(out)
            if self._closed:
                self._queue.put(self._END)
            loop, event = self._loop, self._event
        return None if loop is None or event is None else (loop, event)

    def _detach(self) -> None:
        with self._lock:
            self._loop = self._event = None

    def abort(self) -> None:
        self._abort(self.id)

    def _stopped_early(self) -> None:
        """The consumer left: abort unless the final output is already out (then it is a no-op)."""
        if not self._closed:
            self.abort()

    def __iter__(self) -> Iterator[RequestOutput]:
        try:
            while True:
                item = self._queue.get()
                if item is self._END:
                    self.finished = True
                    return
                yield item
        finally:  # GeneratorExit on break / close(), or an exception in the consumer
            self._stopped_early()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._event = event = asyncio.Event()
        try:
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    event.clear()
                    if self._queue.empty():
                        await event.wait()
                    continue
                if item is self._END:
                    self.finished = True
                    return
                yield item
        finally:  # break (on the generator's finalization), task cancelled, consumer error
            with self._lock:
                self._loop = self._event = None
            self._stopped_early()

    def __enter__(self) -> RequestHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped_early()

    async def __aenter__(self) -> RequestHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stopped_early()

    def result(self) -> tuple[list[int], str, FinishReason | None]:
        """Block until finished; returns (all token ids, full text, finish reason)."""
        ids: list[int] = []
        text = []
        reason = None
        for out in self:
            ids += out.token_ids
            text.append(out.text_delta)
            reason = out.finish_reason
        return ids, "".join(text), reason


@dataclass(slots=True, eq=False)
class Request:
    """Engine-side state. `num_computed` tokens of `all_ids` have their K/V in `pages` (those a
    sliding window has not released: `pages.first` onwards)."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    handle: RequestHandle
    cache_salt: str = ""
    matcher: Matcher | None = None
    images: RequestImages | None = None  # a vision-language model's images and their placeholders
    output_ids: list[int] = field(default_factory=list)
    pages: PageTable = field(default_factory=PageTable)
    num_computed: int = 0
    cached_tokens: int = 0
    # Where its cached tokens came from (its first admission; see `Scheduler._count_admission`):
    found_host_tokens: int = 0  # tokens the host tier returned for its lookups
    found_redis_tokens: int = 0  # tokens Redis returned for its lookups
    loaded_tokens: int = 0  # of those, tokens copied into the device pages it holds
    recomputed_tokens: int = 0  # prompt tokens it computed at its first admission (not cached)
    num_preemptions: int = 0
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # queue time ends here
    first_token_time: float | None = None
    last_token_time: float | None = None  # inter-token latency starts here
    detok: Any = None  # engine.sampling.detokenizer.IncrementalDetokenizer
    stopper: Any = None  # engine.sampling.detokenizer.StopChecker
    finished: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids)[start:end] if start < n else self.output_ids[start - n : end - n]
