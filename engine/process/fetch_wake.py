"""Waking the engine process's loop when a KV tier lookup ends.

While a request waits for pages from Redis and nothing else can run, the loop waits between
steps. It used to sleep 1 ms and poll again: the request was admitted up to a poll after its
lookup ended. Now the store's `on_fetched` (called on the lookup thread, or on the step thread
when the lookup ended before its callback was added) writes a byte to a pipe that the loop polls
beside its channel, so the wait ends as soon as the lookup does, or a message comes in.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
from typing import Any


class FetchWake:
    """A non-blocking pipe, and the poller the loop waits on: the pipe and the channel."""

    def __init__(self, channel: Any, store: Any):
        self.channel = channel
        self._rx, self._tx = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._lock = threading.Lock()  # the pipe is written from the lookup and step threads
        self._closed = False
        self.poller = select.poll()
        self.poller.register(channel.fileno(), select.POLLIN)
        self.poller.register(self._rx, select.POLLIN)
        self.store = store
        store.on_fetched = self.fetched

    def fetched(self) -> None:
        """(any thread) A lookup ended."""
        with self._lock:
            if self._closed:
                return
            with contextlib.suppress(BlockingIOError):  # the pipe is full: wake-ups are pending already
                os.write(self._tx, b"\0")

    def wait(self, timeout_ms: int) -> bool:
        """Until a lookup ends or the channel has a message, at most `timeout_ms`; True when a
        lookup's end woke it (its wake-ups are consumed)."""
        if self._rx not in {fd for fd, _ in self.poller.poll(timeout_ms)}:
            return False
        with contextlib.suppress(BlockingIOError):
            while os.read(self._rx, 4096):
                pass
        return True

    def close(self) -> None:
        """No wake-up is sent after this."""
        self.store.on_fetched = None
        with self._lock:
            self._closed = True
            os.close(self._tx)
        os.close(self._rx)
