"""A private `redis-server` a test can stop and start again on the same unix socket, with an
append-only file in the same directory so that its data survives the restart."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.redis_server import answers


class RestartableRedis:
    def __init__(self, directory: Path, *args: str):
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (make test installs it)")
        self.sock = directory / "redis.sock"
        self.url = f"unix://{self.sock}"
        self.cmd = [exe, "--port", "0", "--unixsocket", str(self.sock), "--dir", str(directory), "--save", ""]
        self.cmd += ["--appendonly", "yes", "--appendfsync", "always", *args]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self.proc is None, "already running"
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not (self.sock.exists() and answers(self.url)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start ({' '.join(self.cmd)})")
            time.sleep(0.02)

    def pause(self, paused: bool = True) -> None:
        """Stall the server (SIGSTOP: connections stay open, nothing answers) or resume it."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            self.pause(False)
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


@contextmanager
def restartable_redis(*args: str) -> Iterator[RestartableRedis]:
    """A started RestartableRedis in a temporary directory, stopped and removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="longctx-redis-") as tmp:
        server = RestartableRedis(Path(tmp), *args)
        server.start()
        try:
            yield server
        finally:
            server.stop()
