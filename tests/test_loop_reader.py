"""The engine channel read on an asyncio loop (`engine/process/loop_reader.py`, `EngineClient.
read_on`): every frame arrives whole and in each sender's order, however large (a frame past
the socket's buffer is read on as its rest arrives) and however threads interleave; the peer's
end (its process exiting, or its socket closing) is reported once, after every frame it sent;
reading stops where a frame says so and leaves the rest readable. With a real engine process:
async and blocking consumers are served from the loop, the reader thread has handed over and
ended, the engine's death ends every open request with an error, and a shutdown after the loop
has stopped reads the rest on its own thread and stops the engine cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.process.channel import BUFFER_BYTES, Channel
from engine.process.loop_reader import LoopReader
from engine.request import FinishReason, RequestHandle, RequestOutput
from engine.sampling_params import SamplingParams
from tests.test_channel import _frame, _pair
from tests.test_core_process import _client


class _Peer:
    """A stand-in for the engine process's pid (a sleeping child), and what the reader saw."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(["sleep", "120"])
        self.frames: list[bytes] = []
        self.ends = 0
        self.frames_at_end = -1

    def on_frame(self, raw: bytes) -> bool:
        self.frames.append(raw)
        return raw == b"stop"

    def on_end(self) -> None:
        self.ends += 1
        self.frames_at_end = len(self.frames)

    def reader(self, loop: asyncio.AbstractEventLoop, ours: Channel) -> LoopReader:
        return LoopReader(loop, ours, self.proc.pid, self.on_frame, self.on_end)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@contextlib.contextmanager
def _channel_and_peer() -> Iterator[tuple[Channel, Channel, _Peer]]:
    """A channel pair (`ours` read by the loop) and a peer process whose pid the reader watches."""
    ours, theirs = _pair()
    peer = _Peer()
    try:
        yield ours, theirs, peer
    finally:
        peer.close()
        theirs.close()
        ours.close()


async def _until(cond: object, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    senders=st.integers(1, 3),
    sizes=st.lists(
        st.sampled_from([0, 1, 7, 8, 9, 1000, 65536, BUFFER_BYTES + 3, 3 * BUFFER_BYTES]), min_size=1, max_size=6
    ),
    end=st.sampled_from(["exit", "close"]),
)
def test_frames_arrive_whole_and_in_order_then_the_end_once(senders: int, sizes: list[int], end: str) -> None:
    want = {s: [_frame(s, i, n) for i, n in enumerate(sizes)] for s in range(senders)}
    with _channel_and_peer() as (ours, theirs, peer):

        async def run() -> None:
            reader = peer.reader(asyncio.get_running_loop(), ours)
            reader.start()

            def send(s: int) -> None:
                for f in want[s]:
                    theirs.send(f)

            threads = [threading.Thread(target=send, args=(s,)) for s in range(senders)]
            for t in threads:
                t.start()
            await _until(lambda: len(peer.frames) == senders * len(sizes))
            for t in threads:
                t.join()
            assert theirs.flush(30)
            if end == "exit":  # the engine process ended (its socket still open here)
                peer.proc.kill()
            else:  # its end closed
                theirs.close()
            await _until(lambda: peer.ends == 1)
            await asyncio.sleep(0.05)
            assert not reader.active

        asyncio.run(run())
        for s in range(senders):
            assert [f for f in peer.frames if f.startswith(f"{s}:".encode())] == want[s]
        assert peer.ends == 1 and peer.frames_at_end == senders * len(sizes)


def test_frames_sent_just_before_the_peer_exits_are_read_first() -> None:
    with _channel_and_peer() as (ours, theirs, peer):

        async def run() -> None:
            reader = peer.reader(asyncio.get_running_loop(), ours)
            for i in range(50):
                theirs.send(_frame(0, i, 5000))
            peer.proc.kill()
            peer.proc.wait()
            reader.start()
            await _until(lambda: peer.ends == 1)

        asyncio.run(run())
        assert peer.frames == [_frame(0, i, 5000) for i in range(50)] and peer.frames_at_end == 50


def test_a_frame_that_says_stop_ends_the_reading_and_leaves_the_rest() -> None:
    with _channel_and_peer() as (ours, theirs, peer):

        async def run() -> None:
            reader = peer.reader(asyncio.get_running_loop(), ours)
            reader.start()
            for f in (b"a", b"stop", b"b", b"c"):
                theirs.send(f)
            await _until(lambda: not reader.active)
            theirs.send(b"d")
            await asyncio.sleep(0.05)

        asyncio.run(run())
        assert peer.frames == [b"a", b"stop"] and peer.ends == 0
        assert ours.recv(1.0) == [b"b", b"c", b"d"]


def test_stop_from_another_thread_and_on_a_stopped_loop() -> None:
    loop = asyncio.new_event_loop()
    with _channel_and_peer() as (ours, theirs, peer):
        try:
            reader = peer.reader(loop, ours)
            loop.call_soon(reader.start)
            runner = threading.Thread(target=loop.run_forever)
            runner.start()
            theirs.send(b"x")
            deadline = time.monotonic() + 10
            while peer.frames != [b"x"]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert reader.stop(5) and not reader.active
            theirs.send(b"y")  # read by no one on the loop: still in the channel
            time.sleep(0.05)
            assert peer.frames == [b"x"] and ours.recv(1.0) == [b"y"]
            again = peer.reader(loop, ours)
            loop.call_soon_threadsafe(again.start)
            deadline = time.monotonic() + 10
            while not again.active:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            loop.call_soon_threadsafe(loop.stop)
            runner.join(10)
            assert not again.stop(1) and not again.active  # the loop cannot run it: nothing left registered to run
        finally:
            loop.close()


@pytest.mark.slow
def test_an_engine_client_read_on_the_loop(tiny_model: Path) -> None:
    """Outputs read on the loop equal those read by the thread; the thread has ended; a blocking
    consumer on another thread is served too; the engine's death ends every open request with an
    error and calls `on_death`; `shutdown` then returns at once."""
    client, loaded = _client(tiny_model)
    tok = loaded.tokenizer  # type: ignore[attr-defined]
    prompts = [tok.encode(p) for p in ("Hello there", "The sky is", "One two three")]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    by_thread = [client.add_request(p, params).result() for p in prompts]
    deaths: list[tuple[str, str]] = []
    client.on_death = lambda reason: deaths.append((threading.current_thread().name, reason))

    async def run() -> tuple[list[Any], Any, list[RequestOutput]]:
        client.read_on(asyncio.get_running_loop())
        await asyncio.sleep(0.2)
        assert not client._reader.is_alive() and client._loop_reader is not None and client._loop_reader.active

        async def one(p: list[int]) -> Any:
            ids: list[int] = []
            text, reason = "", None
            async for out in client.add_request(p, params):
                ids += out.token_ids
                text += out.text_delta
                reason = out.finish_reason
            return ids, text, reason

        on_loop = await asyncio.gather(*(one(p) for p in prompts))
        blocking = await asyncio.to_thread(lambda: client.add_request(prompts[0], params).result())
        long = client.add_request(prompts[1], SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        outs = []
        async for out in long:
            outs.append(out)
            if len(outs) == 1:
                os.kill(client.pid, signal.SIGKILL)
        return on_loop, blocking, outs

    try:
        on_loop, blocking, outs = asyncio.run(run())
        assert on_loop == by_thread and blocking == by_thread[0]
        assert outs[-1].finish_reason is FinishReason.ERROR and "exited" in (outs[-1].error or "")
        assert len(deaths) == 1 and deaths[0][0] == "MainThread" and not client.alive
        t0 = time.monotonic()
        client.shutdown()
        assert time.monotonic() - t0 < 5
    finally:
        client.shutdown()


@pytest.mark.slow
def test_a_shutdown_after_the_loop_stopped_reads_on_its_own_thread(tiny_model: Path) -> None:
    client, loaded = _client(tiny_model)
    ids = loaded.tokenizer.encode("Go:")  # type: ignore[attr-defined]

    async def run() -> RequestHandle:
        client.read_on(asyncio.get_running_loop())
        handle = client.add_request(ids, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        async for _ in handle:
            break  # aborts it
        return client.add_request(ids, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))

    handle = asyncio.run(run())  # the loop is closed: nothing reads the channel on it any more
    t0 = time.monotonic()
    client.shutdown(timeout_s=20)
    assert time.monotonic() - t0 < 10, "shutdown waited for a loop that no longer runs"
    assert client.proc.returncode == 0 and not client.alive
    assert list(handle)[-1].finish_reason is FinishReason.ABORT
