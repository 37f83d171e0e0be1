"""Reading the engine channel on the API process's asyncio loop instead of on a thread.

Each engine step's outputs used to cost the API process two wake-ups: the reader thread's (the
engine's eventfd), then the event loop's (the reader's `call_soon_threadsafe`), with a GIL
hand-off between them; on a 2-core machine each one preempts a spinning OpenMP worker of the
engine process, holding the whole step at its next barrier. Read on the loop, a step costs
one: the loop's `epoll` wakes on the eventfd, decodes the frames and sets its consumers'
events in the same callback.

`LoopReader` registers three things on the loop:
- the peer's eventfd (a frame, or part of one, has been sent);
- a pidfd of the engine process (it ended: the channel is drained, then the client hears of
  the death), as the reader thread noticed the socket's end of file;
- the socket itself only while a frame larger than its buffer is half read (the engine's
  writer thread may then be blocked on the buffer without signalling again).

All of it runs on the loop's thread; `stop` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable

from engine.process.channel import Channel, ChannelClosed


class LoopReader:
    """Reads `channel` on `loop`, handing each frame to `on_frame` (True: the peer said it stops,
    read no more) and calling `on_end()` once the peer is gone and every frame is read.

    Args:
        channel: this process's end (with the eventfd its peer signals).
        pid: the peer process, watched through a pidfd for its end.
        on_frame: called with each frame, in order, on the loop's thread.
        on_end: called on the loop's thread after the last frame once the peer ended (not after
            `on_frame` returned True, nor after `stop`).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        channel: Channel,
        pid: int,
        on_frame: Callable[[bytes], bool],
        on_end: Callable[[], None],
    ):
        assert channel.wake_fd is not None, "the loop reads a channel whose peer signals an eventfd"
        self.loop = loop
        self.channel = channel
        self.on_frame = on_frame
        self.on_end = on_end
        self._pidfd: int | None = os.pidfd_open(pid)
        self._socket_watched = False
        self.active = False

    def start(self) -> None:
        """Register on the loop (call on the loop's thread); reads what arrived already."""
        self.active = True
        assert self.channel.wake_fd is not None and self._pidfd is not None
        self.loop.add_reader(self.channel.wake_fd, self._drain)
        self.loop.add_reader(self._pidfd, self._peer_ended)
        self._drain()

    def _drain(self) -> None:
        if not self.active:
            return
        try:
            frames = self.channel.ready()
        except ChannelClosed:
            self._peer_ended()
            return
        if not self._hand_over(frames):
            self._watch_socket(self.channel.partial)

    def _hand_over(self, frames: list[bytes]) -> bool:
        """Give `frames` to `on_frame` in order; True when the reading stopped at one of them
        (it said stop, or stopped the reader: the client's death path), the rest put back."""
        for i, raw in enumerate(frames):
            said_stop = self.on_frame(raw)
            if said_stop or not self.active:
                self.channel.put_back(frames[i + 1 :])
                if said_stop:
                    self._unregister()
                return True
        return False

    def _watch_socket(self, on: bool) -> None:
        if on and not self._socket_watched:
            self.loop.add_reader(self.channel.fileno(), self._drain)
        elif not on and self._socket_watched:
            self.loop.remove_reader(self.channel.fileno())
        self._socket_watched = on

    def _peer_ended(self) -> None:
        """The engine process ended (or closed its end): read what it sent before, then end."""
        if not self.active:
            return
        while True:
            try:
                frames = self.channel.ready()
            except ChannelClosed:
                break
            if not frames:
                if self.channel.wait(0):
                    continue
                break
            if self._hand_over(frames):
                return
        self._unregister()
        self.on_end()

    def _unregister(self) -> None:
        if not self.active:
            return
        self.active = False
        assert self.channel.wake_fd is not None and self._pidfd is not None
        self.loop.remove_reader(self.channel.wake_fd)
        self.loop.remove_reader(self._pidfd)
        self._watch_socket(False)
        os.close(self._pidfd)
        self._pidfd = None

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop reading (from any thread); False if the loop could not be reached to do it (it
        is closed or not running: then nothing reads on it any more either)."""
        if not self.active:
            return True
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self._unregister()
            return True
        if self.loop.is_closed() or not self.loop.is_running():
            self.active = False  # its callbacks cannot run; the fds are closed with the channel
            if self._pidfd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._pidfd)
                self._pidfd = None
            return False
        done = threading.Event()

        def unregister() -> None:
            self._unregister()
            done.set()

        try:
            self.loop.call_soon_threadsafe(unregister)
        except RuntimeError:  # closed meanwhile
            self.active = False
            return False
        return done.wait(timeout_s)
