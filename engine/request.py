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
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.grammar import Matcher


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
    """One increment of a request's output; the last one carries `finish_reason`."""

    token_ids: list[int]
    text_delta: str
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None


class RequestHandle:
    """The caller's side of a request."""

    _END = object()

    def __init__(self, request_id: str, abort: Any):
        self.id = request_id
        self._abort = abort
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self.finished = False

    def push(self, out: RequestOutput) -> None:
        """Called by the engine thread."""
        self._queue.put(out)
        if out.finish_reason is not None:
            self._queue.put(self._END)
        with self._lock:
            loop, event = self._loop, self._event
        if loop is not None and event is not None:
            loop.call_soon_threadsafe(event.set)

    def abort(self) -> None:
        self._abort(self.id)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            item = self._queue.get()
            if item is self._END:
                self.finished = True
                return
            yield item

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        with self._lock:
            self._loop = asyncio.get_running_loop()
            self._event = asyncio.Event()
        event = self._event
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
    """Engine-side state. `num_computed` tokens of `all_ids` have their K/V in `pages`."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    handle: RequestHandle
    cache_salt: str = ""
    matcher: Matcher | None = None
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    cached_tokens: int = 0
    num_preemptions: int = 0
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    detok: Any = None  # engine.detokenizer.IncrementalDetokenizer
    stopper: Any = None  # engine.detokenizer.StopChecker
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
