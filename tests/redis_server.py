"""Redis for tests: the shared test server (only our own keys, under a unique prefix) or a
private `redis-server` on a unix socket in a temporary directory, for tests that pause,
stop or restart it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

DEFAULT_URL = "redis://127.0.0.1:6379/15"


def unique_prefix() -> str:
    return f"longctx-test-{uuid.uuid4().hex[:12]}"


def answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5).ping())
    except redis.RedisError:
        return False


def delete_prefix(url: str, prefix: str) -> int:
    """Delete our keys (`prefix*`) only; never FLUSH*."""
    r = redis.Redis.from_url(url)
    n = 0
    keys = list(r.scan_iter(match=f"{prefix}*", count=1000))
    for start in range(0, len(keys), 500):
        n += r.delete(*keys[start : start + 500])
    return n


@contextmanager
def private_redis(*args: str) -> Iterator[str]:
    """A `redis-server` of our own on a unix socket (no TCP port); yields its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (make test installs it)")
    with tempfile.TemporaryDirectory(prefix="longctx-redis-") as tmp:
        sock = Path(tmp) / "redis.sock"
        cmd = [exe, "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no", "--dir", tmp, *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"unix://{sock}"
        try:
            deadline = time.monotonic() + 10
            while not (sock.exists() and answers(url)):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start ({' '.join(cmd)})")
                time.sleep(0.02)
            yield url
        finally:
            proc.terminate()
            proc.wait(timeout=10)


@contextmanager
def shared_redis() -> Iterator[tuple[str, str]]:
    """(url, unique key prefix) on LONGCTX_TEST_REDIS_URL, or on a private server when none answers;
    our keys are deleted afterwards."""
    url = os.environ.get("LONGCTX_TEST_REDIS_URL", DEFAULT_URL)
    prefix = unique_prefix()
    if answers(url):
        try:
            yield url, prefix
        finally:
            delete_prefix(url, prefix)
    else:
        with private_redis() as private:
            yield private, prefix
