"""Waking the engine process's loop when a KV tier lookup ends.

While a request waits for pages from Redis and nothing else can run, the loop waits between
steps. It used to sleep 1 ms and poll again: the request was admitted up to a poll after its
lookup ended. Now the store's `on_fetched` (called on the lookup thread, or on the step thread
when the lookup ended before its callback was added) sends an empty message on an inproc socket
that the loop polls beside its inbox, so the wait ends as soon as the lookup does, or a message
comes in.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any


class FetchWake:
    """An inproc PUSH/PULL pair on the loop's ZMQ context, and the poller the loop waits on."""

    def __init__(self, ctx: Any, inbox: Any, store: Any):
        import zmq

        addr = f"inproc://longctx-kv-fetched-{id(self)}"
        self.rx = ctx.socket(zmq.PULL)
        self.rx.bind(addr)
        self._tx: Any = ctx.socket(zmq.PUSH)
        self._tx.setsockopt(zmq.LINGER, 0)
        self._tx.connect(addr)
        self._lock = threading.Lock()  # the sender is used from the lookup and step threads
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        self.poller.register(self.rx, zmq.POLLIN)
        self.store = store
        store.on_fetched = self.fetched

    def fetched(self) -> None:
        """(any thread) A lookup ended."""
        import zmq

        with self._lock:
            if self._tx is None:
                return
            with contextlib.suppress(zmq.ZMQError):  # the queue is full: wake-ups are pending already
                self._tx.send(b"", zmq.NOBLOCK)

    def wait(self, timeout_ms: int) -> bool:
        """Until a lookup ends or the inbox has a message, at most `timeout_ms`; True when a
        lookup's end woke it (its wake-ups are consumed)."""
        import zmq

        if self.rx not in dict(self.poller.poll(timeout_ms)):
            return False
        while True:
            try:
                self.rx.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True

    def close(self) -> None:
        """Before the context ends: no wake-up is sent after this."""
        self.store.on_fetched = None
        with self._lock:
            self._tx.close(linger=0)
            self._tx = None
        self.rx.close(linger=0)
