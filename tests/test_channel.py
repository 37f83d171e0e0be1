"""The API <-> engine process channel (`engine/process/channel.py`): frames arrive whole and in
each sender's order, whatever their sizes and however threads interleave; a sender never blocks
on a peer that does not read (its frames wait in memory, in order, and leave when the peer
reads); the other end's close is seen once its last frame has been read; a close flushes."""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.process.channel import BUFFER_BYTES, Channel, ChannelClosed


def _pair() -> tuple[Channel, Channel]:
    """As between the processes: `ours` waits on the eventfd the other end signals (a copy of
    it, as the other process would hold)."""
    ours, theirs, signal = Channel.pair()
    return ours, Channel(theirs, signal_fd=os.dup(signal))


def _frame(sender: int, seq: int, size: int) -> bytes:
    head = f"{sender}:{seq}:".encode()
    return head + bytes((sender * 31 + seq + i) % 251 for i in range(max(0, size - len(head))))


def _read_all(ch: Channel, n: int, timeout_s: float = 60) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        assert time.monotonic() < deadline, f"{len(got)} of {n} frames arrived"
        got += ch.recv(0.05)
    return got


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    plan=st.lists(
        st.lists(st.sampled_from([0, 1, 7, 8, 9, 100, 4095, 65_536, 300_000, BUFFER_BYTES + 17]), max_size=12),
        min_size=1,
        max_size=4,
    ),
    read_late=st.booleans(),
)
def test_frames_arrive_whole_and_in_each_senders_order(plan: list[list[int]], read_late: bool) -> None:
    """Several threads send frames of random sizes (empty, around the header's size, past the
    socket's buffer) at once; with `read_late` the reader starts only after every send returned
    (so the senders must not have waited for it). Every frame arrives intact, each sender's in
    its order."""
    a, b = _pair()
    done = []

    def sender(k: int, sizes: list[int]) -> None:
        for i, size in enumerate(sizes):
            a.send(_frame(k, i, size))
        done.append(k)

    threads = [threading.Thread(target=sender, args=(k, sizes)) for k, sizes in enumerate(plan)]
    for t in threads:
        t.start()
    if read_late:
        for t in threads:
            t.join(60)
        assert len(done) == len(plan), "a sender blocked on a peer that was not reading"
    got = _read_all(b, sum(len(s) for s in plan))
    for t in threads:
        t.join(60)
    by_sender: dict[int, list[bytes]] = {}
    for frame in got:
        by_sender.setdefault(int(frame.split(b":")[0]), []).append(frame)
    for k, sizes in enumerate(plan):
        assert by_sender.get(k, []) == [_frame(k, i, size) for i, size in enumerate(sizes)]
    assert a.flush(10) and b.ready() == []
    a.close()
    b.close()


def test_both_directions_at_once_never_deadlock() -> None:
    """Each side sends far more than both socket buffers hold before reading anything (as an
    API reader thread sending an abort while the engine sends outputs would): both sends return,
    and then each side reads everything the other sent."""
    a, b = _pair()
    big = os.urandom(3 * BUFFER_BYTES)
    t0 = time.monotonic()
    for _ in range(3):
        a.send(big)
        b.send(big)
    assert time.monotonic() - t0 < 30
    results: dict[str, list[bytes]] = {}
    reader = threading.Thread(target=lambda: results.setdefault("b", _read_all(b, 3)))
    reader.start()
    results["a"] = _read_all(a, 3)
    reader.join(60)
    assert results["a"] == [big] * 3 and results["b"] == [big] * 3
    a.close()
    b.close()


def test_the_other_ends_close_is_seen_after_its_last_frame() -> None:
    """A peer that sends, flushes and closes: its frames are read first, then `ChannelClosed`;
    sending to a closed peer raises `ChannelClosed` too (at once or on a later send). A close
    without flushing drops what was still queued: the peer reads the whole frames before it,
    then `ChannelClosed`, never a partial frame."""
    a, b = _pair()
    payload = os.urandom(BUFFER_BYTES * 2)
    a.send(b"first")
    a.send(payload)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.extend(_read_all(b, 2)))
    reader.start()
    a.close(flush_s=30)
    reader.join(60)
    assert got == [b"first", payload]
    with pytest.raises(ChannelClosed):
        b.recv(1)
    with pytest.raises(ChannelClosed):
        for _ in range(100):
            b.send(b"x" * 65_536)
    b.close()

    a, b = _pair()
    a.send(b"first")
    a.send(payload)  # more than the socket holds: the rest waits for the writer thread
    a.close(flush_s=0)
    assert b.recv(5) == [b"first"]
    with pytest.raises(ChannelClosed):
        while True:
            assert b.recv(5) == []
    b.close()


class _SlowWriter:
    """The sending end's socket, whose writer thread pauses before each `send` (as a thread
    waiting for the GIL on a loaded machine would): the reader then reads a frame whole and waits
    on the eventfd alone before the next frame's first bytes arrive."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def send(self, data: Any, flags: int = 0) -> int:
        if threading.current_thread().name == "longctx-channel-writer":
            time.sleep(0.2)
        return self.sock.send(data, flags)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


def test_a_reader_between_frames_is_signalled_as_a_large_frame_is_written() -> None:
    """Frames past the socket's buffer, queued for the writer thread behind one another, and a
    reader that has read one frame whole and so waits on the eventfd alone (the event loop's
    reader does; the reader thread polls the socket only for a frame's rest): the writer signals
    after each part it writes, so every frame arrives and no wait runs to its timeout. (It once
    wrote each frame with one blocking `send`, which signalled only once the whole frame had
    gone: the reader waited for a signal the writer could not give; the reader thread's 0.1 s
    polls hid it, the event loop's reader stalled for good.)"""
    ours, theirs = _pair()
    theirs.sock = _SlowWriter(theirs.sock)  # type: ignore[assignment]
    frames = [_frame(0, i, 3 * BUFFER_BYTES + i) for i in range(3)]
    try:
        for f in frames:
            theirs.send(f)
        got: list[bytes] = []
        deadline = time.monotonic() + 60
        while len(got) < len(frames):
            assert time.monotonic() < deadline
            t0 = time.monotonic()
            ours.wait(5.0)
            assert time.monotonic() - t0 < 2.5, "the reader waited for a signal that never came"
            got += ours.ready()
        assert got == frames
    finally:
        theirs.close()
        ours.close()


def test_put_back_returns_frames_first() -> None:
    a, b = _pair()
    for f in (b"1", b"2", b"3"):
        a.send(f)
    frames = _read_all(b, 3)
    b.put_back(frames[1:])
    a.send(b"4")
    assert _read_all(b, 3) == [b"2", b"3", b"4"]
    a.close()
    b.close()


def test_an_inherited_end_is_not_passed_on() -> None:
    """`from_fd` (the engine process's end) is not inherited by processes it starts (ranks)."""
    ours, theirs, signal = Channel.pair()
    theirs.set_inheritable(True)
    end = Channel.from_fd(os.dup(theirs.fileno()), os.dup(signal))
    assert not os.get_inheritable(end.fileno()) and end.signal_fd is not None
    assert not os.get_inheritable(end.signal_fd)
    theirs.close()
    end.send(b"ok")
    assert _read_all(ours, 1) == [b"ok"]
    end.close()
    ours.close()
