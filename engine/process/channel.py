"""The API process <-> engine process channel: length-prefixed frames over one end of a Unix
stream socket pair (`socket.socketpair`; the engine process gets its end as an inherited fd).

What a step's outputs cost on their way was the reason for it. Over ZMQ, each message woke
a ZMQ I/O thread in the sending process (which took a core from the engine's spinning OpenMP
team, holding the whole step at its next barrier), then an I/O thread in the receiving process,
which woke the reader. Here the sender's thread writes the frame into the socket itself, and the
reader is woken by the kernel: no thread of the channel's own on either side, as long as the
socket's buffer has room.

Sending never blocks the caller: a frame the buffer cannot take whole goes to an in-memory
queue that a writer thread (started on the first such frame) flushes in order, waiting for
room instead of the caller, and signalling the peer after every part it sends (one blocking
`send` of a frame larger than the buffer would signal only once all of it had gone, while the
peer, its last frame read whole, waited for a signal: a stall). So neither side can hold the other up by not reading
(the API's reader thread, which also sends aborts, can never wait on the engine, which waits
on it), and the event loop never waits on the engine's pace of reading a large image.

Receiving is one thread's at a time (the API's reader thread or its event loop, through
`loop_reader.LoopReader`; the engine's loop): `wait` polls, `ready` takes what has arrived
without blocking and returns the complete frames.

How the API process's reader is woken matters as much as how often. A write to a Unix socket
wakes the thread waiting on it *synchronously* (the kernel's hint that the writer is about to
sleep), and the scheduler may then place the woken thread on the writer's core: the engine's
main thread, the step's critical path, which does not sleep but starts the next step (what fits
the measurements, one stream on 2 cores, int4: 105-107 tok/s, engine step 9.4 ms).
So the engine process writes its frame, then signals an eventfd, and the reader waits on that
eventfd, polling the socket only for its close and for the rest of a frame larger than the
socket's buffer: an eventfd's wake-up is not synchronous, and the reader lands where it last
ran, half the time on a spinning OpenMP worker, which costs nothing between parallel regions
(114 tok/s, step 8.75 ms in the same run; `docs/benchmarks.md`).
"""

from __future__ import annotations

import collections
import contextlib
import os
import select
import socket
import struct
import threading
import time

HEADER = struct.Struct("<Q")  # the frame's length
BUFFER_BYTES = 4 << 20  # each direction's socket buffer (the kernel may cap it lower)
READ_CHUNK = 1 << 20


class ChannelClosed(ConnectionError):
    """The other end is gone (its process ended, or closed the channel), or this end was closed."""


class Channel:
    """One end of the pair. `send` from any thread; `wait`/`ready`/`recv` from one thread."""

    def __init__(self, sock: socket.socket, signal_fd: int | None = None, wake_fd: int | None = None):
        self.sock = sock
        self.signal_fd = signal_fd  # an eventfd written after each frame (bytes) sent: the peer waits on it
        self.wake_fd = wake_fd  # an eventfd the peer writes: what `wait` waits on instead of the socket
        self._lock = threading.Lock()
        self._queue: collections.deque[memoryview] = collections.deque()  # frames waiting for the writer thread
        self._writing = False  # the writer thread holds a frame it took from the queue
        self._wake = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        self._closed = False
        self._failed: OSError | None = None  # the writer thread's send failed: the other end is gone
        self._buf = bytearray()
        self._chunk = bytearray(READ_CHUNK)
        self._eof = False

    @classmethod
    def pair(cls) -> tuple[Channel, socket.socket, int]:
        """This process's end, and the other end's socket and signal eventfd (to pass to the
        other process; this end waits on that eventfd for the other end's frames)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        for s in (ours, theirs):
            for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                s.setsockopt(socket.SOL_SOCKET, opt, BUFFER_BYTES)
        wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        return cls(ours, wake_fd=wake), theirs, wake

    @classmethod
    def from_fd(cls, fd: int, signal_fd: int | None = None) -> Channel:
        """The end a process inherited as `fd` (and the eventfd its peer waits on), kept from
        any process it starts itself."""
        sock = socket.socket(fileno=fd)
        sock.set_inheritable(False)
        if signal_fd is not None:
            os.set_inheritable(signal_fd, False)
        return cls(sock, signal_fd=signal_fd)

    def fileno(self) -> int:
        return self.sock.fileno()

    # ---- sending (any thread) ----

    def send(self, data: bytes | bytearray | memoryview) -> None:
        """Queue one frame; it leaves in the order of `send` calls, never interleaved with another.

        Raises:
            ChannelClosed: this end was closed, or an earlier frame found the other end gone.
        """
        frame = memoryview(HEADER.pack(len(data)) + bytes(data))
        with self._lock:
            if self._closed or self._failed is not None:
                raise ChannelClosed(f"channel closed{f': {self._failed}' if self._failed else ''}")
            if not self._queue and not self._writing:
                try:
                    sent = self.sock.send(frame, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    sent = 0
                except OSError as e:
                    self._failed = e
                    raise ChannelClosed(f"channel closed: {e}") from e
                if sent:
                    self._signal()
                if sent == len(frame):
                    return
                frame = frame[sent:]
            self._queue.append(frame)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write, name="longctx-channel-writer", daemon=True)
                self._writer.start()
            self._wake.notify()

    def _write(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._wake.wait()
                if not self._queue:
                    return
                frame = self._queue.popleft()
                self._writing = True
            try:
                while frame:  # the peer is signalled as each part is taken, so it reads on
                    try:  # never one blocking `send` of the whole: it would signal only at the end,
                        sent = self.sock.send(frame, socket.MSG_DONTWAIT)  # while the peer waits for a signal
                    except BlockingIOError:
                        self._wait_writable()
                        continue
                    self._signal()
                    frame = frame[sent:]
            except OSError as e:
                with self._lock:
                    self._failed = e
                    self._queue.clear()
                    self._writing = False
                    self._wake.notify_all()
                return
            with self._lock:
                self._writing = False
                self._wake.notify_all()

    def _wait_writable(self) -> None:
        """(writer thread) Until the socket's buffer has room (or the socket is shut or failed)."""
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLOUT)
        while not self._closed and not poller.poll(100):
            pass
        if self._closed:
            raise ChannelClosed("channel closed while a frame was being written")

    def _signal(self) -> None:
        if self.signal_fd is not None:
            os.eventfd_write(self.signal_fd, 1)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every frame sent so far has left this process (up to `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while (self._queue or self._writing) and self._failed is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._wake.wait(left)
            return self._failed is None

    # ---- receiving (one thread) ----

    def wait(self, timeout_s: float) -> bool:
        """Whether a frame (or the other end's close) can be read now, waiting up to `timeout_s`."""
        if self._complete() or self._eof:
            return True
        poller = select.poll()
        if self.wake_fd is None:
            poller.register(self.sock.fileno(), select.POLLIN)
        else:  # the peer's eventfd; the socket only for its close, or for the rest of a frame begun
            poller.register(self.wake_fd, select.POLLIN)
            poller.register(self.sock.fileno(), select.POLLRDHUP | (select.POLLIN if self._buf else 0))
        return bool(poller.poll(max(0, int(timeout_s * 1000))))

    def ready(self) -> list[bytes]:
        """The complete frames that have arrived, without waiting (possibly none).

        Raises:
            ChannelClosed: the other end is gone and every frame it sent has been returned.
        """
        if self.wake_fd is not None:  # first: a frame sent after this read signals again
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self.wake_fd)
        while not self._eof:
            try:
                n = self.sock.recv_into(self._chunk, READ_CHUNK, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError:
                n = 0
            if n == 0:
                self._eof = True
                break
            self._buf += memoryview(self._chunk)[:n]
            if n < READ_CHUNK:
                break
        frames = []
        while self._complete():
            (size,) = HEADER.unpack_from(self._buf)
            frames.append(bytes(self._buf[HEADER.size : HEADER.size + size]))
            del self._buf[: HEADER.size + size]
        if not frames and self._eof:
            raise ChannelClosed("the other end closed the channel")
        return frames

    def recv(self, timeout_s: float) -> list[bytes]:
        """`ready` after waiting up to `timeout_s` for something to arrive."""
        self.wait(timeout_s)
        return self.ready()

    def put_back(self, frames: list[bytes]) -> None:
        """Return frames taken by `ready` but not handled: the next `ready` gives them first."""
        self._buf[0:0] = b"".join(HEADER.pack(len(f)) + f for f in frames)

    @property
    def partial(self) -> bool:
        """Part of a frame has been read and its rest has not (after `ready`)."""
        return bool(self._buf) and not self._complete()

    def _complete(self) -> bool:
        if len(self._buf) < HEADER.size:
            return False
        return len(self._buf) >= HEADER.size + HEADER.unpack_from(self._buf)[0]

    # ---- the end ----

    def close(self, flush_s: float = 0.0) -> None:
        """Close this end, first waiting up to `flush_s` for queued frames to leave."""
        if flush_s > 0:
            self.flush(flush_s)
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._wake.notify_all()
        writer = self._writer
        if writer is not None and writer is not threading.current_thread():
            if self._writing:  # a writer waiting for room on a peer that stopped reading
                self.sock.shutdown(socket.SHUT_WR)
            writer.join(timeout=1)
        self.sock.close()
        with contextlib.suppress(OSError):
            self._signal()  # a peer waiting on the eventfd, not on the socket, reads the end of file
        for fd in (self.signal_fd, self.wake_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.signal_fd = self.wake_fd = None
