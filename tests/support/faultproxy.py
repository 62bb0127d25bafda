"""A fault-injecting TCP proxy for Redis: replies lost after Redis executed the command.

Listens on a free loopback port and forwards every connection to a redis-server.  Client -> server
bytes always go through untouched (so Redis executes what it was sent); on the way back a reply can
be:

* ``drop``: swallowed, then both sides closed: the command ran, its reply never arrives (redis-py
  retries it on a fresh connection: the "executed, reply lost" case);
* ``cut``: its first half forwarded, then both sides closed (a connection dying mid-reply);
* ``delay``: held back for a while, then forwarded (order on the connection is kept).

Faults are chosen either deterministically (:meth:`FaultProxy.lose_next`: the reply to the next
command whose name matches) or at random per reply (``rates``), from a seeded RNG.  Each fault
injected is counted by kind and by the name of the command whose reply it hit (``faults``).

A reply is taken whole before a ``drop`` or ``cut``: bytes are collected until the server has been
quiet for ``settle_s``, so a pipeline whose ``EXEC`` arrives in a later TCP segment has run before
the connection is cut.  Redis-py sends one command (or one pipeline) at a time on a connection,
so the bytes that come back after a command are its reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

KINDS = ("drop", "cut", "delay")
_COMMAND = re.compile(rb"\*\d+\r\n\$\d+\r\n([A-Za-z|]+)\r\n")


def last_command(chunk: bytes) -> str:
    """The name of the last command in a chunk of RESP requests ("" if none is visible)."""
    names = _COMMAND.findall(chunk)
    return names[-1].decode().upper() if names else ""


@dataclass(eq=False)
class _Conn:
    client_w: asyncio.StreamWriter
    server_w: asyncio.StreamWriter
    command: str = ""  # the last command sent on this connection
    armed: str = ""  # a fault to inject on the next reply (deterministic mode)


@dataclass
class FaultProxy:
    """``rates``: probability per reply of each kind (``{"drop": 0.01, ...}``); ``command_rates``: other
    rates for the replies to some commands (``{"EVALSHA": {...}}``); ``only``: command names whose
    replies may be faulted at random (empty: every reply)."""

    upstream_host: str
    upstream_port: int
    seed: int = 0
    rates: dict[str, float] = field(default_factory=dict)
    command_rates: dict[str, dict[str, float]] = field(default_factory=dict)
    only: frozenset[str] = frozenset()
    delay_s: tuple[float, float] = (0.005, 0.05)
    settle_s: float = 0.02
    faults: Counter[tuple[str, str]] = field(default_factory=Counter)  # (kind, command) -> n
    replies: int = 0
    connections: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._arm: list[tuple[str, frozenset[str]]] = []  # (kind, command names), in order
        self.enabled = True

    # ------------------------------------------------------------------ control

    async def start(self) -> FaultProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return self

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def lose_next(self, commands: Iterable[str] = ("EXEC", "EVALSHA"), kind: str = "drop") -> None:
        """Lose (``drop`` or ``cut``) the reply to the next command named in ``commands``."""
        assert kind in KINDS
        self._arm.append((kind, frozenset(c.upper() for c in commands)))

    @property
    def armed(self) -> int:
        """Deterministic faults asked for and not injected yet."""
        return len(self._arm)

    def count(self, kind: str | None = None, commands: Iterable[str] | None = None) -> int:
        names = None if commands is None else {c.upper() for c in commands}
        return sum(
            n
            for (k, c), n in self.faults.items()
            if (kind is None or k == kind) and (names is None or c in names)
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self._conns):
            _close(c)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def __aenter__(self) -> FaultProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ forwarding

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError:
            client_w.close()
            return
        self.connections += 1
        conn = _Conn(client_w, server_w)
        self._conns.add(conn)
        up = asyncio.create_task(self._upstream(conn, client_r))
        down = asyncio.create_task(self._downstream(conn, server_r))
        for t in (up, down):
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        _close(conn)
        self._conns.discard(conn)

    async def _upstream(self, conn: _Conn, client_r: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await client_r.read(65536):
                name = last_command(data)
                if name:
                    conn.command = name
                    if self._arm and not conn.armed and name in self._arm[0][1]:
                        conn.armed = self._arm.pop(0)[0]
                conn.server_w.write(data)
                await conn.server_w.drain()

    def _choose(self, conn: _Conn) -> str:
        if conn.armed:
            kind, conn.armed = conn.armed, ""
            return kind
        rates = self.command_rates.get(conn.command, self.rates)
        if not self.enabled or not rates or (self.only and conn.command not in self.only):
            return ""
        x = self.rng.random()
        for kind in KINDS:
            p = rates.get(kind, 0.0)
            if x < p:
                return kind
            x -= p
        return ""

    async def _downstream(self, conn: _Conn, server_r: asyncio.StreamReader) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await server_r.read(65536):
                self.replies += 1
                kind = self._choose(conn)
                if kind in ("drop", "cut"):
                    data += await _settle(server_r, self.settle_s)  # the whole reply: it has run
                    self.faults[(kind, conn.command)] += 1
                    if kind == "cut" and len(data) > 1:
                        conn.client_w.write(data[: len(data) // 2])
                        with contextlib.suppress(OSError):
                            await conn.client_w.drain()
                    return  # _accept closes both sides
                if kind == "delay":
                    self.faults[(kind, conn.command)] += 1
                    await asyncio.sleep(self.rng.uniform(*self.delay_s))
                conn.client_w.write(data)
                await conn.client_w.drain()


async def _settle(r: asyncio.StreamReader, quiet_s: float) -> bytes:
    """Whatever else the server sends until it has been quiet for ``quiet_s``."""
    out = b""
    while True:
        try:
            more = await asyncio.wait_for(r.read(65536), quiet_s)
        except TimeoutError:
            return out
        if not more:
            return out
        out += more


def _close(conn: _Conn) -> None:
    for w in (conn.client_w, conn.server_w):
        with contextlib.suppress(Exception):
            w.close()
