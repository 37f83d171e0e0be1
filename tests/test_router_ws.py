"""`longctx route` relaying the Responses WebSocket mode to two real replicas (keyed, one Redis),
through a real websocket client, and the router's own key check (`--api-keys-file`).

- Keys: with the replicas' keys file, the router answers `/health`, `/ready`, `/metrics` and
  `/v1/...` with the status a replica gives for no key, a wrong key and a good one (401 bodies
  byte-identical), and refuses a WebSocket handshake as a replica does (403); without it a
  replica's refusal is passed on, naming the replica.
- Relay: the handshake names its replica; through the `openai` client's WebSocket mode, a
  connection's `store: false` chain continues on one replica (the chain lives in its
  connection); a first message whose `prompt_cache_key` went to the other
  replica over HTTP moves the connection there; a replica SIGKILLed mid-turn ends the client's
  socket with an `error` event (`replica_failed`) and close code 1011, and the next connection
  goes to the other replica."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response
from websockets.exceptions import ConnectionClosedError, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from tests.redis_server import delete_prefix, shared_redis, unique_prefix
from tests.router_process import router_metrics, start_router, stop_router, wait_router
from tests.server import TEST_KEY, Server, keys_args, start_server

ARGS = ("--dtype", "float32", "--threads", "1", "--kv-cache-bytes", "64MiB", "--background-workers", "0",
        "--served-model-name", "demo")  # fmt: skip
AUTH = {"Authorization": f"Bearer {TEST_KEY}"}
REQUESTS = "longctx_router_requests_total"
ENDS = ("response.completed", "response.incomplete", "response.failed", "error")


def ws(base: str, headers: dict[str, str] = AUTH) -> ClientConnection:
    return connect(base.replace("http://", "ws://") + "/v1/responses", additional_headers=headers,
                   open_timeout=30, max_size=None, proxy=None)  # fmt: skip


def turn(socket: ClientConnection, **body: Any) -> list[dict[str, Any]]:
    """One `response.create`: its events up to the terminal one (or the error event)."""
    socket.send(json.dumps({"type": "response.create", "model": "demo", "temperature": 0, **body}))
    events: list[dict[str, Any]] = []
    while not events or events[-1]["type"] not in ENDS:
        events.append(json.loads(socket.recv(timeout=120)))
    return events


def official_turn(conn: Any, **body: Any) -> Response:
    """One turn through the `openai` client's WebSocket connection: its final response."""
    conn.response.create(model="demo", temperature=0, **body)
    for event in conn:
        assert event.type not in ("error", "response.failed"), event
        if event.type in ENDS[:2]:
            return event.response
    raise AssertionError("the connection closed before the turn ended")


def replica_of(socket: ClientConnection) -> str:
    """The replica the router named in the handshake's answer."""
    assert socket.response is not None
    return socket.response.headers["x-longctx-replica"]


def refused(base: str, headers: dict[str, str]) -> int:
    with pytest.raises(InvalidStatus) as e:
        ws(base, headers).close()
    return e.value.response.status_code


def test_router_keys_and_websocket_relay(demo_gguf: Path, tmp_path: Path) -> None:
    prefix = unique_prefix()
    keys = keys_args(tmp_path)
    with shared_redis() as (url, _):
        args = ("--redis-url", url, "--kv-redis-url", url, *ARGS, *keys)
        with ThreadPoolExecutor(2) as pool:
            starting = [pool.submit(start_server, demo_gguf, *args, log=tmp_path / f"{n}.log", prefix=prefix)
                        for n in "ab"]  # fmt: skip
            servers: list[Server] = [f.result() for f in starting]
        replicas = [x for s in servers for x in ("--replica", s.url)]
        base, router = start_router(*replicas, *keys, log=tmp_path / "router.log")
        open_base, open_router = start_router(*replicas, log=tmp_path / "open-router.log")
        try:
            wait_router(base, router, 2)
            wait_router(open_base, open_router, 2)

            # the router's own routes and /v1 answer as a replica does, key by key
            for path in ("/health", "/ready", "/metrics", "/v1/models"):
                for headers in ({}, {"Authorization": "Bearer sk-wrong"}, AUTH):
                    mine = httpx.get(base + path, headers=headers, timeout=30)
                    theirs = httpx.get(servers[0].url + path, headers=headers, timeout=30)
                    assert mine.status_code == theirs.status_code, (path, headers, mine.text, theirs.text)
                    if theirs.status_code == 401:
                        assert mine.content == theirs.content and "x-longctx-replica" not in mine.headers
            before = router_metrics(base)
            assert refused(base, {}) == refused(servers[0].url, {}) == 403
            assert refused(base, {"Authorization": "Bearer sk-wrong"}) == 403
            assert router_metrics(base) == before  # refused at the router: no replica saw them
            with pytest.raises(InvalidStatus) as passed_on:
                ws(open_base, {"Authorization": "Bearer sk-wrong"}).close()
            assert passed_on.value.response.status_code == 403
            assert passed_on.value.response.headers["x-longctx-replica"] in {s.url for s in servers}

            # the official client's WebSocket mode through the router: a store:false chain
            # (kept in the replica's connection) continues, every turn on one replica
            before = router_metrics(base)
            client = openai.OpenAI(base_url=base + "/v1", api_key=TEST_KEY, max_retries=0, timeout=120)
            with client.responses.connect(max_retries=0) as conn:
                first = official_turn(conn, input="Say hi.", store=False, max_output_tokens=6)
                nxt = official_turn(conn, input="Again.", previous_response_id=first.id, store=False,
                                    max_output_tokens=6)  # fmt: skip
                assert first.status in ("completed", "incomplete") and nxt.status in ("completed", "incomplete")
            after = router_metrics(base)
            served = {s.url: after[(REQUESTS, s.url)] - before[(REQUESTS, s.url)] for s in servers}
            assert sorted(served.values()) == [0, 2], served
            home = next(url for url, n in served.items() if n == 2)

            # a prompt_cache_key served over HTTP on the other replica, made the busier one: a new
            # socket opens on the least used (home), and its first message moves it to the key's
            def post(cache_key: str) -> str:
                body = {"model": "demo", "input": "Hi.", "prompt_cache_key": cache_key, "max_output_tokens": 4}
                r = httpx.post(base + "/v1/responses", headers=AUTH, json=body, timeout=120)
                assert r.status_code == 200, r.text
                return r.headers["x-longctx-replica"]

            key_home = post("ws-k")  # the least used: not the chain's
            assert key_home != home
            m = router_metrics(base)
            while m[(REQUESTS, key_home)] <= m[(REQUESTS, home)]:
                assert post("ws-k") == key_home
                m = router_metrics(base)
            before = router_metrics(base)
            with ws(base) as socket:
                opened_on = replica_of(socket)
                events = turn(socket, input="Hello again.", prompt_cache_key="ws-k", max_output_tokens=4)
                assert events[-1]["type"] in ENDS[:2], events[-1]
                assert [e["sequence_number"] for e in events] == list(range(len(events)))
            after = router_metrics(base)
            served = {s.url: after[(REQUESTS, s.url)] - before[(REQUESTS, s.url)] for s in servers}
            assert opened_on == home and served == {key_home: 1, home: 0}, (opened_on, served)
            assert (
                after[("longctx_router_affinity_hits_total", "")]
                == before[("longctx_router_affinity_hits_total", "")] + 1
            )

            # the replica dies mid-turn: error event, close 1011; the next socket goes elsewhere
            with ws(base) as socket:
                dying = next(s for s in servers if s.url == replica_of(socket))
                socket.send(json.dumps({"type": "response.create", "model": "demo", "temperature": 0,
                                        "input": "Count from 1 to 200.", "max_output_tokens": 300}))  # fmt: skip
                got = [json.loads(socket.recv(timeout=120))]
                assert got[0]["type"] == "response.created"
                dying.proc.send_signal(signal.SIGKILL)
                with pytest.raises(ConnectionClosedError) as closed:
                    while True:
                        got.append(json.loads(socket.recv(timeout=60)))
                assert got[-1]["type"] == "error" and got[-1]["error"]["code"] == "replica_failed", got[-1]
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011
            dying.proc.wait()
            assert router_metrics(base)[("longctx_router_replica_up", dying.url)] == 0
            with ws(base) as socket:
                assert replica_of(socket) != dying.url
                assert turn(socket, input="Still there?", max_output_tokens=4)[-1]["type"] in ENDS[:2]
        finally:
            for proc in (router, open_router):
                stop_router(proc)
            for s in servers:
                if s.proc.poll() is None:
                    s.stop()
            delete_prefix(url, prefix)
    for name in ("router.log", "open-router.log"):  # nothing the relay did logged an error
        text = (tmp_path / name).read_text()
        assert "ERROR" not in text and "Traceback" not in text, text[-3000:]
