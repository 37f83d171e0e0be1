"""The engine core in its own process (`engine/process/main.py`) and its client: the wire's
messages round-trip; outputs agree with the in-process engine and come batched per step; an
abort, a shutdown and the engine process's death each end every open request; a matcher's
position (a forced prefix accepted on the API side) crosses the boundary; and a server whose
engine process dies answers `/ready` 503 `engine_stopped`, then exits 1."""

from __future__ import annotations

import functools
import gc
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from engine.engine_config import EngineConfig
from engine.process import wire
from engine.process.channel import Channel
from engine.process.client import EngineClient
from engine.process.fetch_wake import FetchWake
from engine.process.main import LoadSpec
from engine.request import EngineClosed, FinishReason, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.snapshot import EngineSnapshot
from engine.stats import EngineStats
from tests.redis_server import shared_redis
from tests.server import http_get, start_server

pytestmark = pytest.mark.slow
CONFIG = EngineConfig(kv_cache_bytes=4 << 20, threads=1)


def _client(model: Path) -> tuple[EngineClient, object]:
    spec = LoadSpec(load=dict(spec=str(model), dtype="float32", progress=False), config=CONFIG, threads=1)
    client = EngineClient(spec)
    loaded = client.wait_phase("loaded", timeout_s=120)
    client.tokenizer = loaded.tokenizer
    client.build(None, "t:kv")
    client.wait_phase("compiled", timeout_s=60)
    return client, loaded


@pytest.fixture(scope="module")
def core(tiny_model: Path) -> Iterator[tuple[EngineClient, object]]:
    client, loaded = _client(tiny_model)
    yield client, loaded
    client.shutdown()  # a no-op after test_shutdown_ends_a_request_in_flight


def test_wire_round_trip() -> None:
    params = SamplingParams(max_tokens=7, temperature=0.5, stop=("a", "bc"), logprobs=2, seed=3, priority=1)
    add = wire.Add("r1", [1, 2, 3], params, "salt", wire.GrammarSpec("schema:{}", [5, 6]))
    assert wire.to_engine.decode(wire.encoder.encode(add)) == add
    out = RequestOutput("r1", [4], "x", [TokenLogprob(4, -0.1, [(4, -0.1), (9, -2.5)])], FinishReason.LENGTH, 3, 1)
    snap = EngineSnapshot(running=1, total_pages=8, request_pages={"r1": 2})
    msg = wire.Outputs([out], ["r1"], snap, 12.5)
    back = wire.from_engine.decode(wire.encoder.encode(msg))
    assert (
        back == msg
        and isinstance(back.outputs[0], RequestOutput)
        and back.outputs[0].finish_reason is FinishReason.LENGTH
    )
    stats = EngineStats()
    stats.ttft.observe(0.01)
    stats.count_finished("stop")
    metrics = wire.Metrics(stats.snapshot(), {"prefix": {"hits": 1}}, 5)
    assert wire.from_engine.decode(wire.encoder.encode(metrics)) == metrics
    with pytest.raises(msgspec.ValidationError, match="max_tokens"):  # the params' own checks run on decoding
        wire.to_engine.decode(wire.encoder.encode(["add", "r", [1], {"max_tokens": -1}]))


def test_outputs_agree_with_the_in_process_engine_and_are_batched(
    core: tuple[EngineClient, object], tiny_model: Path
) -> None:
    from engine.engine import Engine
    from engine.loading.loader import load

    client, loaded = core
    prompts = [loaded.tokenizer.encode(p) for p in ("Hello there", "The sky is", "One two three", "Paris")]  # type: ignore[attr-defined]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    before = client.channel.snapshot().samples
    handles = [client.add_request(p, params) for p in prompts]
    served = [h.result() for h in handles]
    messages = client.channel.snapshot().samples - before
    assert messages < 4 * 12, "outputs of one step travel in one message"
    local = load(str(tiny_model), dtype="float32", progress=False)
    with Engine(local.model, local.tokenizer, CONFIG) as engine:
        want = [engine.add_request(p, params).result() for p in prompts]
    assert served == want
    assert all(r == FinishReason.LENGTH for _, _, r in served)
    assert client.snapshot().running == 0 and client.snapshot().queued == 0


def test_abort_ends_the_request_and_frees_its_pages(core: tuple[EngineClient, object]) -> None:
    client, loaded = core
    ids = loaded.tokenizer.encode("Count forever:")  # type: ignore[attr-defined]
    handle = client.add_request(ids, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
    got = []
    for out in handle:
        got.append(out)
        if len(got) == 3:
            handle.abort()
    assert got[-1].finish_reason is FinishReason.ABORT and len(got) < 400
    deadline = time.monotonic() + 5
    while client.snapshot().held_pages and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.snapshot().held_pages == 0
    # an async consumer that leaves early aborts too
    import asyncio

    async def leave_early() -> int:
        n = 0
        async with client.generate(ids, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)) as h:
            async for _ in h:
                n += 1
                if n == 2:
                    break
        return n

    assert asyncio.run(leave_early()) == 2
    deadline = time.monotonic() + 5
    while client.snapshot().running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.snapshot().running == 0


def test_matcher_state_crosses_the_boundary(core: tuple[EngineClient, object]) -> None:
    """A schema whose start is forced: the API side accepts the forced tokens into its matcher
    (as the session layer does before prefilling them); the engine process rebuilds the matcher
    at that position, so the rest completes the same JSON."""
    from tools.grammar import GrammarCompiler

    client, loaded = core
    tok = loaded.tokenizer  # type: ignore[attr-defined]
    compiler = GrammarCompiler(tok, 49152)
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    matcher = compiler.matcher(compiler.json_schema(schema))
    params = SamplingParams(max_tokens=30, temperature=0.0)
    forced = matcher.forced_prefix(tok, params.max_tokens - 1)
    assert forced and matcher.accepted == forced
    _, text, reason = client.add_request(tok.encode("Answer:") + forced, params, matcher=matcher).result()
    whole = tok.decode(forced, skip_special_tokens=False) + text
    assert reason is FinishReason.STOP and json.loads(whole)["answer"] in ("yes", "no")
    fresh = compiler.matcher(compiler.json_schema(schema))  # no forced prefix: the whole object from the engine
    _, text, reason = client.add_request(tok.encode("Answer:"), params, matcher=fresh).result()
    assert reason is FinishReason.STOP and json.loads(text)["answer"] in ("yes", "no")
    with pytest.raises(ValueError, match="matcher"):

        class Local:
            key = None

        client.add_request(tok.encode("x"), params, matcher=Local())


def test_shutdown_ends_a_request_in_flight(core: tuple[EngineClient, object]) -> None:
    """Last of the module's tests on `core`: a graceful shutdown ends it with abort, exit 0."""
    client, loaded = core
    handle = client.add_request(loaded.tokenizer.encode("Go:"), SamplingParams(max_tokens=400, ignore_eos=True))  # type: ignore[attr-defined]
    next(iter(handle))
    client.shutdown()
    assert list(handle)[-1].finish_reason is FinishReason.ABORT
    assert client.proc.returncode == 0 and not client.alive
    with pytest.raises(EngineClosed):
        client.add_request(loaded.tokenizer.encode("Go:"), SamplingParams())  # type: ignore[attr-defined]


def test_death_ends_every_open_request(tiny_model: Path) -> None:
    client, loaded = _client(tiny_model)
    deaths: list[str] = []
    client.on_death = deaths.append
    ids = loaded.tokenizer.encode("Go:")  # type: ignore[attr-defined]
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    handle = client.add_request(ids, long)
    next(iter(handle))
    os.kill(client.pid, signal.SIGKILL)
    outs = list(handle)
    assert outs[-1].finish_reason is FinishReason.ERROR and "exited" in (outs[-1].error or "")
    assert deaths and not client.alive
    with pytest.raises(EngineClosed):
        client.add_request(ids, long)
    # Dropped without `shutdown` (its channel's socket left open): collecting it must not block.
    # A callback that holds its client, as a server's does, puts it in a reference cycle.
    client._reader.join(timeout=10)
    client.on_death = functools.partial(lambda c, reason: None, client)
    del client, handle
    collecting = threading.Thread(target=gc.collect, daemon=True)
    collecting.start()
    collecting.join(timeout=20)
    assert not collecting.is_alive(), "the garbage collector blocked on a dropped engine client"


def test_the_engine_process_exits_when_the_api_side_closes_the_channel(tiny_model: Path) -> None:
    """An API process that dies (or closes the channel) while its engine process runs: the
    engine process sees the channel's end of file and exits within seconds, whether it was
    waiting for `wire.Build` or serving (with a request in flight), instead of waiting for the
    parent-pid check or stepping on for no one."""
    spec = LoadSpec(load=dict(spec=str(tiny_model), dtype="float32", progress=False), config=CONFIG, threads=1)
    waiting = EngineClient(spec)
    serving, loaded = _client(tiny_model)
    try:
        waiting.wait_phase("loaded", timeout_s=120)
        ids = loaded.tokenizer.encode("Go:")  # type: ignore[attr-defined]
        serving.add_request(ids, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        for client, code in ((waiting, 1), (serving, 0)):
            client._channel.sock.shutdown(socket.SHUT_WR)  # the engine side reads its end of file
            assert client.proc.wait(30) == code
    finally:
        waiting.shutdown()
        serving.shutdown()


def test_server_answers_503_then_exits_1_when_its_engine_process_dies(tiny_model: Path, tmp_path: Path) -> None:
    import psutil

    args = ("--dtype", "float32", "--kv-cache-bytes", "4MiB", "--threads", "1")
    with shared_redis() as (url, _):
        server = start_server(tiny_model, "--redis-url", url, *args, log=tmp_path / "serve.log")
        try:
            engines = [p for p in psutil.Process(server.proc.pid).children() if "engine.process.main" in p.cmdline()]
            assert len(engines) == 1
            engines[0].kill()
            deadline, seen = time.monotonic() + 10, None
            while time.monotonic() < deadline and server.proc.poll() is None:
                status, body = http_get(server.url + "/ready", timeout_s=1.0)
                if status == 503:
                    seen = body
                    break
                time.sleep(0.02)
            assert seen is not None and seen["phase"] == "engine_stopped", server.log_tail()
            assert server.proc.wait(timeout=30) == 1, server.log_tail()
        finally:
            if server.proc.poll() is None:
                server.proc.kill()
                server.proc.wait()


def test_thread_placement() -> None:
    """2 cores: the engine gets both, the API process 1 thread; 16: the engine 14, the API 2;
    `--threads` sets the engine's."""
    from api.model_load import placement

    assert placement(0, 2) == (2, 1)
    assert placement(0, 16) == (14, 2)
    assert placement(4, 16) == (4, 2) and placement(1, 2) == (1, 1)


def test_a_lookups_end_wakes_the_loops_wait() -> None:
    """`FetchWake`: the store's `on_fetched`, called from another thread, ends the loop's wait
    (it returns True, long before its timeout); a wait with nothing to end it returns False; a
    message on the channel ends it too (False: not a lookup); after `close` the hook is gone and
    a late call sends nothing."""

    class Store:
        on_fetched: object = None

    ours, theirs, signal = Channel.pair()
    peer = Channel(theirs, signal_fd=os.dup(signal))
    store = Store()
    wake = FetchWake(ours, store)
    try:
        assert store.on_fetched == wake.fetched
        assert wake.wait(0) is False
        threading.Timer(0.05, wake.fetched).start()
        assert wake.wait(60_000) is True  # woken by the call, not by the timeout
        wake.fetched()
        wake.fetched()
        assert wake.wait(0) is True and wake.wait(0) is False  # every pending wake-up consumed at once
        threading.Timer(0.05, peer.send, (b"hello",)).start()
        t0 = time.monotonic()
        assert wake.wait(60_000) is False and time.monotonic() - t0 < 30
        assert ours.ready() == [b"hello"]
    finally:
        wake.close()
    assert store.on_fetched is None
    wake.fetched()  # (a lookup ending after the loop stopped) no error, nothing sent
    ours.close()
    peer.close()
