"""`longctx serve` as a process: readiness, the error object, managed Redis, shutdown.

A tiny random Llama saved with the demo tokenizer stands in for a real model: these tests
are about the process, not the text. Managed-mode tests run in a temporary `LONGCTX_HOME`
(short, so its unix socket paths fit) and check that no `redis-server` is left behind.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import pytest

from api.managed_redis import INSTALL_HINT, ManagedRedis, state_args
from engine.loading.model_source import longctx_home
from tests.redis_process import restartable_redis
from tests.redis_server import shared_redis
from tests.server import ROOT, Server, free_port, http_get, running_server, serve_command, start_server

pytestmark = pytest.mark.slow
TINY_ARGS = ("--dtype", "float32", "--kv-cache-bytes", "4MiB", "--threads", "1", "--served-model-name", "m")


KEEPALIVE_S = 0.05


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One request at a time (so that a second one waits), SSE comments after 0.05 s of silence."""
    log = tmp_path_factory.mktemp("logs") / "serve.log"
    env = {"LONGCTX_SSE_KEEPALIVE_S": str(KEEPALIVE_S)}
    with (
        shared_redis() as (url, _),
        running_server(tiny_model, *TINY_ARGS, "--max-num-seqs", "1", log=log, redis_url=url, env=env) as s,
    ):
        yield s


@pytest.fixture
def home() -> Iterator[Path]:
    """A temporary LONGCTX_HOME; fails the test if a managed redis-server outlives it."""
    with tempfile.TemporaryDirectory(prefix="lc-", dir="/tmp") as tmp:
        for shared in ("kernels", "compile"):  # built once per run, in the default home
            (longctx_home() / shared).mkdir(parents=True, exist_ok=True)
            Path(tmp, shared).symlink_to(longctx_home() / shared)
        yield Path(tmp)
        leftover = [p for p in Path(tmp, "redis").glob("*.pid") if _pid_alive(int(p.read_text()))]
        for p in leftover:
            os.kill(int(p.read_text()), signal.SIGKILL)
        assert not leftover, f"managed redis-server left running: {leftover}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rpartition(")")[2].split()[0] != "Z"


def _request(method: str, url: str, body: bytes | None = None, timeout: float = 10) -> tuple[int, dict[str, object]]:
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_health_answers_before_ready(server: Server) -> None:
    assert server.health_before_ready, f"/ready said {server.ready_phases} but /health never answered before"
    assert server.ready_phases, "/ready was never 503 during startup"
    assert set(server.ready_phases) <= {"starting", "redis", "model", "engine", "compile", "warm-up", "routes"}
    status, body = http_get(server.url + "/ready")
    assert status == 200 and body["status"] == "ready"
    phases = set(cast(dict[str, float], body["phase_seconds"]))
    assert phases == {"redis", "model", "engine", "compile", "warm-up", "routes"}


def test_unknown_route_is_an_openai_error(server: Server) -> None:
    status, body = _request("GET", server.url + "/v1/no-such-route")
    assert status == 404
    assert body == {
        "error": {
            "message": "no route for GET /v1/no-such-route",
            "type": "invalid_request_error",
            "param": None,
            "code": "not_found",
        }
    }
    status, body = _request("POST", server.url + "/health", b"{not json")
    assert status == 405 and set(cast(dict[str, Any], body["error"])) == {"message", "type", "param", "code"}


def test_without_redis_server_exits_2(tiny_model: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PATH": str(tmp_path), "LONGCTX_HOME": str(tmp_path / "home")}
    cmd = serve_command(tiny_model, 1, "lc")
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert INSTALL_HINT in result.stderr
    assert "apt-get install redis-server" in result.stderr


def _answers(instance: ManagedRedis) -> bool:
    return instance.pid() is not None and instance.answers()


def test_managed_redis_shared_restarted_and_stopped_by_the_last(tiny_model: Path, home: Path, tmp_path: Path) -> None:
    """Two servers share the managed redis-server, one restarts it when it dies, the last stops
    it; a conversation made before all that is there for a third server on the same home."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make test installs it)")
    env = {"LONGCTX_HOME": str(home)}
    state = ManagedRedis(home / "redis", "state", state_args(home / "redis" / "state"))
    kv = ManagedRedis(home / "redis", "kv", [])
    a = start_server(tiny_model, *TINY_ARGS, log=tmp_path / "a.log", env=env)
    try:
        conv_id, items = _conversation_with_a_turn(a.url)
        first_pid = state.pid()
        assert first_pid is not None and _answers(state) and _answers(kv)
        b = start_server(tiny_model, *TINY_ARGS, log=tmp_path / "b.log", env=env)
        try:
            assert state.pid() == first_pid, "the second server started its own redis-server"
            assert "shared with 1 other server" in b.log_tail(200)
            users = sorted(int(p) for p in state.users.read_text().split())
            assert users == sorted([a.proc.pid, b.proc.pid])

            os.kill(first_pid, signal.SIGKILL)  # one of the two servers must restart it
            deadline = time.monotonic() + 30
            while not (state.pid() not in (None, first_pid) and state.answers()):
                assert time.monotonic() < deadline, f"not restarted:\n{a.log_tail()}\n{b.log_tail()}"
                time.sleep(0.1)
            restarted = [s for s in (a, b) if "is gone: restarting it" in s.log_tail(400)]
            assert len(restarted) == 1, "exactly one server restarts the shared redis-server"
            for s in (a, b):
                assert http_get(s.url + "/ready")[0] == 200
            second_pid = state.pid()
            assert a.stop() == 0, a.log_tail()
            assert state.pid() == second_pid and state.answers(), "stopped while a server still uses it"
            assert "left running for 1 other server" in a.log_tail(50)
        finally:
            assert b.stop() == 0, b.log_tail()
        assert state.pid() is None and kv.pid() is None, "the last server did not stop the managed redis-servers"
        assert second_pid is not None and not _pid_alive(second_pid)
        assert not state.socket.exists()
        c = start_server(tiny_model, *TINY_ARGS, log=tmp_path / "c.log", env=env, prefix=a.prefix)
        try:
            assert _items(c.url, conv_id) == items
        finally:
            assert c.stop() == 0, c.log_tail()
        assert state.pid() is None and kv.pid() is None
    finally:
        a.stop()


def _conversation_with_a_turn(url: str) -> tuple[str, list[object]]:
    status, conv = _request("POST", url + "/v1/conversations", json.dumps({"items": [_user("Hello")]}).encode())
    assert status == 200, conv
    _respond(url, {"conversation": conv["id"]})
    items = _items(url, str(conv["id"]))
    assert len(items) >= 2  # the first message, the turn's input (the tiny model's output may be empty)
    return str(conv["id"]), items


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _respond(url: str, extra: dict[str, object]) -> dict[str, object]:
    body = {"model": "m", "input": [_user("Hi")], "max_output_tokens": 4, "temperature": 0, **extra}
    status, response = _request("POST", url + "/v1/responses", json.dumps(body).encode(), timeout=120)
    assert status == 200 and response["status"] in ("completed", "incomplete"), response
    return response


def _items(url: str, conv_id: str) -> list[object]:
    status, page = _request("GET", f"{url}/v1/conversations/{conv_id}/items?order=asc&limit=100")
    assert status == 200, page
    return list(page["data"])  # type: ignore[call-overload]


def test_a_redis_restarted_while_idle_answers_the_next_request(tiny_model: Path, tmp_path: Path) -> None:
    """A private append-only redis-server (state and KV pages) stopped and started again between
    two requests: the next request works and the conversation is as it was."""
    log = tmp_path / "serve.log"
    with restartable_redis() as redis, running_server(tiny_model, *TINY_ARGS, log=log, redis_url=redis.url) as s:
        conv_id, items = _conversation_with_a_turn(s.url)
        redis.stop()
        redis.start()
        _respond(s.url, {"conversation": conv_id})
        after = _items(s.url, conv_id)
        assert after[: len(items)] == items and len(after) > len(items)


def _sse_lines(url: str, body: dict[str, object], out: list[str], started: threading.Event) -> None:
    """POST a streaming response and keep every raw line of its HTTP body (comments included);
    `started` is set at the first text delta."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", "/v1/responses", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 200
        while line := response.readline():
            out.append(line.decode().rstrip("\n"))
            if out[-1] == "event: response.output_text.delta":
                started.set()
    finally:
        started.set()
        conn.close()


def test_a_waiting_stream_carries_keepalive_comments(server: Server) -> None:
    """The server runs one request at a time: a second stream waits for the first to finish, and
    its raw HTTP body carries `: keep-alive` comments between `response.in_progress` and its first
    delta (every LONGCTX_SSE_KEEPALIVE_S; 15 s by default)."""
    body = {"model": "m", "input": "Hello", "max_output_tokens": 400, "temperature": 0, "stream": True, "store": False}
    first: list[str] = []
    running = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        reader = pool.submit(_sse_lines, server.url, body, first, running)  # its asserts fail the test
        assert running.wait(120) and "event: response.output_text.delta" in first, first[-5:]
        second: list[str] = []
        _sse_lines(server.url, body, second, threading.Event())
        reader.result(120)
    start = second.index("event: response.in_progress")
    deltas = [i for i, line in enumerate(second) if line == "event: response.output_text.delta"]
    end = deltas[0] if deltas else len(second)
    assert ": keep-alive" in second[start:end], second[: end + 1]


def test_startup_failure_exits_1_naming_the_phase(tiny_model: Path, tmp_path: Path) -> None:
    cmd = serve_command(tiny_model, free_port(), "lc", *TINY_ARGS, "--redis-url", "redis://127.0.0.1:1/0")
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "startup failed in phase redis" in result.stderr
