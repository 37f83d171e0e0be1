"""`longctx serve` as a subprocess for HTTP tests: started on a free port, ready, stopped with SIGTERM.

    with running_server(model_path, *keys_args(tmp), redis_url=url) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=TEST_KEY, max_retries=0)

One server per test module (a module-scoped fixture around `running_server`). Each gets a
unique `--redis-prefix`; with the shared test Redis its keys are deleted afterwards. Stopping
asserts the process exits 0 after SIGTERM. While waiting for `/ready`, the phases `/ready`
reported and whether `/health` answered before it are recorded on the `Server`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.cores import THREADS_ARG
from tests.redis_server import delete_prefix, shared_redis, unique_prefix

ROOT = Path(__file__).resolve().parent.parent
TEST_KEY, TEST_TENANT = "sk-test-a", "tenant-a"  # the key clients of `keys_args` servers use
READY_TIMEOUT_S = 120.0
# A server with the compiled step is ready at once and compiles (or loads) and self-checks its
# buckets in the background: cold, on 2 busy cores, minutes (`wait_compiled`).
COMPILED_READY_TIMEOUT_S = 900.0
STOP_TIMEOUT_S = 60.0


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    prefix: str
    log: Path
    ready_phases: list[str] = field(default_factory=list)  # what /ready said before it turned 200
    health_before_ready: bool = False
    redis_url: str | None = None  # its `--redis-url` (None: managed mode)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, then wait; returns the exit code (SIGKILL and an error after `timeout_s`)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                tail = self.log_tail()
                raise AssertionError(f"server did not exit within {timeout_s}s of SIGTERM:\n{tail}") from None
        return self.proc.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout_s: float = 5.0) -> tuple[int, dict[str, object]]:
    """(status, JSON body) of a GET; (0, {}) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, {}


def keys_args(directory: Path, pairs: tuple[tuple[str, str], ...] = ((TEST_KEY, TEST_TENANT),)) -> tuple[str, ...]:
    """`--api-keys-file` flags for a keys file written in `directory` (`KEY TENANT` lines), so
    the HTTP tests run authenticated, as a server exposed beyond loopback must."""
    path = directory / "api-keys"
    path.write_text("# key tenant\n" + "".join(f"{k} {t}\n" for k, t in pairs))
    return ("--api-keys-file", str(path))


def serve_command(model: str | Path, port: int, prefix: str, *args: str) -> list[str]:
    # Eager unless the test asks for `--compile`: compiling the step is tested in test_compile.py
    # and would add its compile phase to every server start here.
    eager = () if "--compile" in args else ("--no-compile",)
    return [sys.executable, "-m", "api.cli", "serve", "--model", str(model), "--port", str(port),
            "--redis-prefix", prefix, *eager, *args]  # fmt: skip


def start_server(
    model: str | Path,
    *args: str,
    log: Path,
    env: dict[str, str] | None = None,
    prefix: str | None = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Server:
    """Start `longctx serve` (from this checkout) and wait until `/ready` answers 200 (a
    sharded server compiles before it is ready: benchmarks starting one cold wait longer)."""
    port = free_port()
    prefix = prefix or unique_prefix()
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            serve_command(model, port, prefix, *args), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
    server = Server(f"http://127.0.0.1:{port}", proc, prefix, log)
    timeout = ready_timeout_s
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode} before ready:\n{server.log_tail()}")
        if time.monotonic() > deadline:
            server.stop()
            raise AssertionError(f"server not ready within {timeout}s:\n{server.log_tail()}")
        status, body = http_get(server.url + "/ready", timeout_s=2.0)
        if status == 200:
            return server
        if status == 503:
            server.ready_phases.append(str(body.get("phase")))
            if not server.health_before_ready:
                server.health_before_ready = http_get(server.url + "/health")[0] == 200
        time.sleep(0.02)


def wait_compiled(server: Server, timeout_s: float = COMPILED_READY_TIMEOUT_S) -> dict[str, object]:
    """`/ready` once no bucket of the compiled step is compiling any more (the server waits for
    that event itself: `?wait_compiled_s`); fails if some still is after `timeout_s`."""
    status, body = http_get(f"{server.url}/ready?wait_compiled_s={timeout_s}", timeout_s=timeout_s + 10)
    assert status == 200 and not body.get("compiling_buckets"), f"{status} {body}\n{server.log_tail()}"
    return body


@contextmanager
def running_server(
    model: str | Path,
    *args: str,
    log: Path,
    redis_url: str | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[Server]:
    """A ready server for the duration of the block; it must exit 0 on SIGTERM.

    Args:
        model: `--model` (a tiny model directory, or the demo GGUF).
        args: more `serve` flags.
        log: file collecting the server's output (shown when something fails).
        redis_url: `--redis-url` (its keys under the server's prefix are deleted afterwards);
            None: managed mode, in the `LONGCTX_HOME` of `env`.
    """
    extra = ["--redis-url", redis_url] if redis_url else []
    server = start_server(model, *extra, *args, log=log, env=env)
    server.redis_url = redis_url
    try:
        yield server
    finally:
        code = server.stop()
        if redis_url:
            delete_prefix(redis_url, server.prefix)
        assert code == 0, f"server exited with {code} after SIGTERM:\n{server.log_tail()}"


def demo_args(kv_cache_bytes: str, background_workers: int) -> tuple[str, ...]:
    """`serve` flags of the session-layer tests on the demo model: float32 (texts are compared), 2
    threads, and the name `demo` their clients ask for."""
    return ("--dtype", "float32", "--threads", THREADS_ARG, "--kv-cache-bytes", kv_cache_bytes,
            "--background-workers", str(background_workers), "--served-model-name", "demo")  # fmt: skip


@contextmanager
def keyed_server(model: str | Path, *args: str, log_dir: Path) -> Iterator[Server]:
    """`running_server` on the shared test Redis, behind a keys file (clients use `TEST_KEY`)."""
    with shared_redis() as (url, _), running_server(model, *args, *keys_args(log_dir), log=log_dir / "serve.log",
                                                    redis_url=url) as server:  # fmt: skip
        yield server
