"""A `redis-server` that `longctx serve` runs itself when no `--redis-url` is given.

Layout under `$LONGCTX_HOME/redis/`, per instance NAME (`state`, `kv`):

    NAME.sock    the unix socket it listens on (no TCP port)
    NAME.pid     its process id
    NAME.users   process ids of the servers using it, one a line
    NAME/        its working directory (append-only files of `state`)
    NAME.log     its log
    lock         flock'ed around every start, stop and change of a users file

Servers on the same home share one instance: the first starts it, each adds its pid to the
users file, and the last to leave stops it. Users are pids rather than a bare count so a
server killed with SIGKILL does not keep the instance alive forever: dead pids are dropped
whenever the file is read. The instance runs in its own session, so a Ctrl-C meant for one
server never stops the Redis the others use; a watcher thread restarts it if it dies (any
user may, under the lock, so exactly one does).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import redis

log = logging.getLogger("longctx.redis")

INSTALL_HINT = (
    "redis-server is not on PATH: install it (Debian/Ubuntu: `apt-get install redis-server`; "
    "macOS: `brew install redis`) or pass --redis-url to use a running Redis"
)
MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux, less elsewhere


class RedisMissing(RuntimeError):
    """`redis-server` is not installed; the message says how to get it."""


def state_args(workdir: Path) -> list[str]:
    """Durable conversation state: every write in the append-only file, nothing ever evicted."""
    return [
        "--appendonly", "yes", "--appendfsync", "everysec", "--maxmemory-policy", "noeviction",
        "--dir", str(workdir),
    ]  # fmt: skip


def cache_args(workdir: Path, max_memory: int) -> list[str]:
    """The KV page cache: bounded, least-recently-used pages evicted, nothing persisted."""
    return [
        "--maxmemory", str(max_memory), "--maxmemory-policy", "allkeys-lru",
        "--save", "", "--appendonly", "no", "--dir", str(workdir),
    ]  # fmt: skip


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped by its parent, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust kill(0)
    return stat.rpartition(")")[2].split()[0] != "Z"


def _read_pids(path: Path) -> list[int]:
    try:
        return [int(x) for x in path.read_text().split() if x.strip().isdigit()]
    except OSError:
        return []


class ManagedRedis:
    """One shared `redis-server` instance under `root` (`$LONGCTX_HOME/redis`).

    Args:
        root: the directory holding sockets, pidfiles, users files and data.
        name: the instance (`state` or `kv`).
        args: its configuration flags (`state_args`, `cache_args`).
        check_s: how often the watcher checks that it is alive.
    """

    def __init__(self, root: Path, name: str, args: list[str], check_s: float = 0.5):
        self.root, self.name, self.args, self.check_s = root, name, args, check_s
        self.socket = root / f"{name}.sock"
        self.pidfile = root / f"{name}.pid"
        self.users = root / f"{name}.users"
        self.workdir = root / name
        self.logfile = root / f"{name}.log"
        self.url = f"unix://{self.socket}"
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        if len(str(self.socket)) > MAX_SOCKET_PATH:
            raise ValueError(f"{self.socket}: path too long for a unix socket; set LONGCTX_HOME to a shorter path")

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "lock", "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def pid(self) -> int | None:
        """The instance's pid while it runs (a reused pid of another program does not count)."""
        pids = _read_pids(self.pidfile)
        if not pids or not _alive(pids[0]):
            return None
        try:
            cmdline = Path(f"/proc/{pids[0]}/cmdline").read_bytes()
        except OSError:
            return pids[0]
        return pids[0] if b"redis-server" in cmdline else None

    def _wait_answering(self, timeout_s: float) -> bool:
        """Wait while it runs but does not answer yet (loading its append-only file)."""
        deadline = time.monotonic() + timeout_s
        while self.pid() is not None:
            if self.answers(timeout_s=2.0):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return False

    def answers(self, timeout_s: float = 0.5) -> bool:
        if not self.socket.exists():
            return False
        try:
            client = redis.Redis(unix_socket_path=str(self.socket), socket_timeout=timeout_s)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except redis.RedisError:
            return False

    def acquire(self) -> None:
        """Use the running instance, or start it; then watch it until `release`."""
        with self._locked():
            users = [p for p in _read_pids(self.users) if _alive(p) and p != os.getpid()]
            if self._wait_answering(timeout_s=30):
                log.info(
                    "managed redis-server (%s) pid %d at %s: shared with %d other server(s)",
                    self.name,
                    self.pid(),
                    self.url,
                    len(users),
                )
            elif self.pid() is not None:
                raise RuntimeError(f"managed redis-server ({self.name}) pid {self.pid()} does not answer at {self.url}")
            else:
                self._start()
            self.users.write_text("".join(f"{p}\n" for p in [*users, os.getpid()]))
        self._watcher = threading.Thread(target=self._watch, name=f"redis-{self.name}-watcher", daemon=True)
        self._watcher.start()

    def release(self) -> None:
        """Stop watching; the last user stops the instance."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        with self._locked():
            users = [p for p in _read_pids(self.users) if _alive(p) and p != os.getpid()]
            self.users.write_text("".join(f"{p}\n" for p in users))
            if users:
                log.info("managed redis-server (%s) left running for %d other server(s)", self.name, len(users))
                return
            self._stop_server()

    def _start(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RedisMissing(INSTALL_HINT)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)  # left behind by a server that was killed
        cmd = [exe, "--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700", *self.args]
        t0 = time.perf_counter()
        with open(self.logfile, "ab") as out:
            # Its own session: a signal to this server's process group must not stop a shared Redis.
            proc = subprocess.Popen(cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True)
        self._proc = proc
        self.pidfile.write_text(f"{proc.pid}\n")
        deadline = time.monotonic() + 30  # replaying a large append-only file takes a while
        while not self.answers():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server ({self.name}) did not start; see {self.logfile}: {' '.join(cmd)}")
            time.sleep(0.02)
        log.info(
            "started managed redis-server (%s) pid %d at %s in %.2fs",
            self.name,
            proc.pid,
            self.url,
            time.perf_counter() - t0,
        )

    def _stop_server(self) -> None:
        pid = self.pid()
        if pid is not None:
            os.kill(pid, signal.SIGTERM)  # redis-server flushes its append-only file and exits
            deadline = time.monotonic() + 10
            while _alive(pid) and time.monotonic() < deadline:
                if self._proc is not None and self._proc.pid == pid:
                    self._proc.poll()  # reap our own child so it does not linger as a zombie
                time.sleep(0.02)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
            log.info("stopped managed redis-server (%s) pid %d: no server uses it any more", self.name, pid)
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=1)
        self.pidfile.unlink(missing_ok=True)
        self.socket.unlink(missing_ok=True)

    def _watch(self) -> None:
        while not self._stop.wait(self.check_s):
            if self._proc is not None:
                self._proc.poll()  # reap a dead child of ours
            if self.pid() is not None:
                continue  # running (perhaps busy loading or saving: never start a second one)
            try:
                with self._locked():
                    # Another user may have restarted it while we waited for the lock.
                    if self._stop.is_set() or self.pid() is not None:
                        continue
                    log.warning("managed redis-server (%s) is gone: restarting it", self.name)
                    self._start()
                    self.restarts += 1
            except Exception:
                log.exception("could not restart managed redis-server (%s)", self.name)
