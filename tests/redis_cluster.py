"""A real 3-master Redis Cluster on loopback for tests: three `redis-server --cluster-enabled yes`
on free TCP ports in a temporary directory, joined by `redis-cli --cluster create`."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalCluster:
    def __init__(self, directory: Path, masters: int = 3, full_coverage: bool = True):
        exe, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if exe is None or cli is None:
            raise RuntimeError("redis-server and redis-cli are needed (make test installs them)")
        self.exe, self.cli, self.dir = exe, cli, directory
        # the cluster bus listens on port + 10000: keep ports low enough
        self.ports = [p for p in _free_ports(masters * 4) if p < 55000][:masters]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.full_coverage = full_coverage  # False: the other masters serve on when one dies

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}"

    def start_node(self, port: int) -> None:
        d = self.dir / str(port)
        d.mkdir(exist_ok=True)
        cmd = [self.exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d), "--save", ""]
        cmd += ["--appendonly", "no", "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
        cmd += ["--cluster-node-timeout", "2000", "--maxmemory-policy", "noeviction"]
        cmd += ["--cluster-require-full-coverage", "yes" if self.full_coverage else "no"]
        self.procs[port] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5).ping():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} did not start")
            time.sleep(0.05)

    def start(self) -> None:
        for port in self.ports:
            self.start_node(port)
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        subprocess.run(
            [self.cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while any(redis.Redis(port=p).cluster("info").get("cluster_state") != "ok" for p in self.ports):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not reach cluster_state:ok")
            time.sleep(0.1)

    def kill(self, port: int) -> None:
        proc = self.procs.pop(port)
        proc.kill()
        proc.wait(timeout=10)

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)


@contextmanager
def local_cluster(masters: int = 3, full_coverage: bool = True) -> Iterator[LocalCluster]:
    with tempfile.TemporaryDirectory(prefix="longctx-cluster-") as tmp:
        cluster = LocalCluster(Path(tmp), masters, full_coverage)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()
