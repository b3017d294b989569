"""Real Redis servers for the tests and the fleet benchmark: ``redis-server`` (the Debian
package) on free loopback ports, in a temporary directory, with no persistence; standalone or a
three-node Cluster built with ``redis-cli --cluster create``. No fakes: a test that needs Redis
fails with the reason if the binary is missing (the README's test command and ``.ci/run``
install it)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from contextlib import closing
from pathlib import Path

_START_TIMEOUT_SECONDS = 10.0


def _port_free(port: int) -> bool:
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _free_port(cluster: bool = False) -> int:
    """A free loopback port; for a Cluster node one at most 55535 whose bus port (+10000) is
    free too (Redis refuses higher ones)."""
    while True:
        with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not cluster:
            return port
        port = 20000 + port % 30000
        if _port_free(port) and _port_free(port + 10000):
            return port


def binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"{name} is not installed: `apt-get install redis-server` "
                           "(the README's test command and .ci/run install it)")
    return path


class RedisServer:
    """One ``redis-server`` process; ``stop`` kills it (SIGKILL: an outage, not a shutdown) and
    ``start`` brings it back on the same port, empty."""

    def __init__(self, workdir: Path, port: int | None = None, cluster: bool = False) -> None:
        self.port = port or _free_port(cluster)
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [binary("redis-server"), "--port", str(self.port), "--bind", "127.0.0.1",
                "--save", "", "--appendonly", "no", "--dir", str(self.dir)]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file",
                     str(self.dir / "nodes.conf"), "--cluster-node-timeout", "2000"]
        self._process = subprocess.Popen(args, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + _START_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self.cli("PING", check=False).strip() == "PONG":
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING")

    def cli(self, *args: str, check: bool = True) -> str:
        done = subprocess.run([binary("redis-cli"), "-p", str(self.port), *args],
                              capture_output=True, text=True, check=False, timeout=10)
        if check and done.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=10)
            self._process = None


class RedisCluster:
    """Three masters, no replicas, every slot assigned."""

    def __init__(self, workdir: Path) -> None:
        self.nodes = [RedisServer(workdir, cluster=True) for _ in range(3)]

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()  # no node outlives a failed start
            raise

    def _start(self) -> None:
        for n in self.nodes:
            n.start()
        subprocess.run([binary("redis-cli"), "--cluster", "create",
                        *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", "0", "--cluster-yes"],
                       capture_output=True, text=True, check=True, timeout=30)
        deadline = time.monotonic() + _START_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if "cluster_state:ok" in self.nodes[0].cli("CLUSTER", "INFO"):
                return
            time.sleep(0.1)
        raise RuntimeError("the Redis cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
