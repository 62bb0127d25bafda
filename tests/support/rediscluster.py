"""A local Redis Cluster for the tests: 3 masters with one replica each, on free loopback ports.

Started from ``redis-server --cluster-enabled yes`` processes (the binary ``EmbeddedRedis`` finds)
and formed with redis-py alone (``CLUSTER ADDSLOTSRANGE``, ``MEET``, ``REPLICATE``), so no
``redis-cli`` is needed.  ``stop()`` ends every process it started.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from rolloutpipe.broker.embedded import find_redis_server, free_port, ping
from rolloutpipe.errors import EmbeddedRedisError

SLOTS = 16384
NODE_TIMEOUT_MS = 1000


@dataclass
class Node:
    port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = None
    id: str = ""

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class LocalCluster:
    masters: int = 3
    replicas: int = 1
    nodes: list[Node] = field(default_factory=list)
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        """``redis+cluster://`` to any one node (the client discovers the rest)."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}/0"

    def node_url(self, node: Node) -> str:
        return f"redis+cluster://127.0.0.1:{node.port}/0"

    # ------------------------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 30.0) -> LocalCluster:
        self._tmp = tempfile.TemporaryDirectory(prefix="rolloutpipe-cluster-")
        try:
            for i in range(self.masters * (1 + self.replicas)):
                d = Path(self._tmp.name) / f"n{i}"
                d.mkdir()
                node = Node(port=self._free_port(), dir=d)
                self.nodes.append(node)
                self._spawn(node)
            for node in self.nodes:
                for _ in range(4):  # a port (or its bus port, + 10000) taken since it was picked
                    if self._up(node, timeout):
                        break
                    node.port = self._free_port()
                    self._spawn(node)
                else:
                    raise EmbeddedRedisError(f"cluster node did not start: {self._log(node)}")
                node.id = str(node.client().execute_command("CLUSTER", "MYID"), "ascii")
            masters, replicas = self.nodes[: self.masters], self.nodes[self.masters :]
            per = SLOTS // self.masters
            for i, m in enumerate(masters):
                hi = SLOTS - 1 if i == self.masters - 1 else (i + 1) * per - 1
                m.client().execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, hi)
            first = masters[0].client()
            for node in self.nodes[1:]:
                first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
            for node in self.nodes:
                self._wait(lambda n=node: self._known(n) == len(self.nodes), timeout, "every node met")
            for j, rep in enumerate(replicas):
                master = masters[j % self.masters]
                self._wait(lambda r=rep, m=master: self._replicate(r, m), timeout, "CLUSTER REPLICATE")
            for rep in replicas:
                self._wait(lambda r=rep: self._linked(r), timeout, "replicas in sync")
            self.wait_ok(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            self._kill(node)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def kill(self, node: Node) -> None:
        """SIGKILL one node (no shutdown, no last write to anyone)."""
        if node.proc is not None and node.proc.poll() is None:
            node.proc.kill()
            node.proc.wait()

    def restart(self, node: Node, timeout: float = 30.0) -> None:
        """Start a killed node again on its port and ``nodes.conf``: it rejoins (as a replica if a
        failover promoted its replica meanwhile)."""
        self._kill(node)
        self._spawn(node)
        self._wait(lambda: ping(node.port), timeout, f"redis-server on {node.port} again")
        self._wait(  # a replica again once it has synced (a later CLUSTER FAILOVER needs that)
            lambda: self._replication(node).get("role") == "master" or self._linked(node),
            timeout,
            "the restarted node in sync",
        )

    # ------------------------------------------------------------------------------------ topology

    def info_cluster(self, node: Node) -> dict[str, str]:
        raw = node.client().execute_command("CLUSTER", "INFO")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def slot_owner(self, slot: int, asker: Node | None = None) -> Node:
        """The master that serves ``slot``, as ``asker`` (any live node) sees it."""
        asker = asker or next(n for n in self.nodes if n.alive())
        for lo, hi, master, *_ in asker.client().execute_command("CLUSTER", "SLOTS"):
            if int(lo) <= slot <= int(hi):
                port = int(master[1])
                return next(n for n in self.nodes if n.port == port)
        raise AssertionError(f"slot {slot} is not served")

    def replicas_of(self, master: Node) -> list[Node]:
        out = []
        for node in self.nodes:
            if node is master or not node.alive():
                continue
            info = self._replication(node)
            if info.get("role") == "slave" and int(info.get("master_port", 0)) == master.port:
                out.append(node)
        return out

    def wait_ok(self, timeout: float = 30.0, nodes: list[Node] | None = None) -> None:
        """Until every live node says ``cluster_state:ok`` and agrees on who serves every slot."""

        def ok() -> bool:
            live = [n for n in (nodes or self.nodes) if n.alive()]
            try:
                if any(self.info_cluster(n).get("cluster_state") != "ok" for n in live):
                    return False
                maps = {self._slot_map(n) for n in live}
            except redis.RedisError:
                return False
            return len(maps) == 1

        self._wait(ok, timeout, "cluster_state:ok on every node")

    # ------------------------------------------------------------------------------------ internals

    def _free_port(self) -> int:
        taken = {n.port for n in self.nodes}
        while True:  # the cluster bus listens on port + 10000: keep both below 65536 and free
            p = free_port()
            if p + 10000 < 65536 and p not in taken:
                return p

    def _spawn(self, node: Node) -> None:
        node.proc = subprocess.Popen(
            [
                find_redis_server(),
                "--port", str(node.port), "--bind", "127.0.0.1", "--dir", str(node.dir),
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--save", "", "--appendonly", "no",
                "--protected-mode", "yes", "--daemonize", "no", "--logfile", str(node.dir / "redis.log"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def _kill(self, node: Node) -> None:
        if node.proc is None:
            return
        if node.proc.poll() is None:
            node.proc.terminate()
            try:
                node.proc.wait(5)
            except subprocess.TimeoutExpired:
                node.proc.kill()
                node.proc.wait()

    def _up(self, node: Node, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if node.proc is None or node.proc.poll() is not None:
                return False
            if ping(node.port):
                return True
            time.sleep(0.02)
        return False

    def _log(self, node: Node) -> str:
        log = node.dir / "redis.log"
        return log.read_text(errors="replace")[-2000:] if log.exists() else ""

    def _known(self, node: Node) -> int:
        raw = node.client().execute_command("CLUSTER", "NODES")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return sum(1 for line in text.splitlines() if line and "handshake" not in line)

    def _replicate(self, rep: Node, master: Node) -> bool:
        try:
            rep.client().execute_command("CLUSTER", "REPLICATE", master.id)
        except redis.ResponseError:  # the replica does not know the master yet
            return False
        return True

    def _linked(self, rep: Node) -> bool:
        return self._replication(rep).get("master_link_status") == "up"

    def _replication(self, node: Node) -> dict[str, str]:
        info: Any = node.client().info("replication")
        return {str(k): str(v) for k, v in info.items()}

    def _slot_map(self, node: Node) -> tuple[tuple[int, int, int], ...]:
        slots: Any = node.client().execute_command("CLUSTER", "SLOTS")
        return tuple(sorted((int(lo), int(hi), int(m[1])) for lo, hi, m, *_ in slots))

    def _wait(self, cond: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if cond():
                    return
            except (redis.RedisError, OSError):
                pass
            for n in self.nodes:
                if n.proc is not None and n.proc.poll() is not None and what.startswith("redis-server"):
                    raise EmbeddedRedisError(f"cluster node on {n.port} exited: {self._log(n)}")
            if time.monotonic() > deadline:
                raise EmbeddedRedisError(f"local cluster: timed out waiting for {what}")
            time.sleep(0.05)
