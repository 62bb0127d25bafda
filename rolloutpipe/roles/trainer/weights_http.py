"""The trainer's published weights over HTTP, read-only, for workers that cannot read its filesystem.

``trainer.weights_serve: host:port`` starts this server inside the trainer role (rank 0 under
DeepSpeed).  It answers ``GET`` and ``HEAD /vNNNNNN/FILE`` with aiohttp's ``FileResponse``, which
honours ``Range`` (206 Partial Content; 416 past the end), so a worker resumes a download that a
dropped connection cut (``rolloutpipe/model/fetch.py``).  Nothing else is served: only a
published version folder (``v`` and digits; never a ``.tmp-*`` folder that ``publish_weights`` is
still writing), only a plain file name inside it (no ``/``, no leading ``.``), and only a regular
file whose real path is inside that folder (a symlink out of it is refused).  Anything else is 404.

Integrity does not rest on this server: a worker checks every file against the sha256 of the
``PolicyVersion`` event it read from Redis, so a corrupted or substituted file is refused, never
loaded.  The server has no authentication; bind it to a private interface.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from rolloutpipe.config import parse_listen

log = logging.getLogger("rolloutpipe.trainer")
VERSION_DIR = re.compile(r"v\d{6,}")  # publish_weights' final folders: v000123
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def resolve(root: Path, version: str, name: str) -> Path | None:
    """The file to serve for ``/version/name``, or None when that path must not be served."""
    if not VERSION_DIR.fullmatch(version) or not FILE_NAME.fullmatch(name):
        return None
    base = root.resolve()
    folder = (base / version).resolve()
    f = (folder / name).resolve()
    if folder.parent != base or f.parent != folder or not f.is_file():
        return None
    return f


def make_app(root: Path) -> web.Application:
    async def get_file(request: web.Request) -> web.StreamResponse:
        f = resolve(root, request.match_info["version"], request.match_info["name"])
        if f is None:
            raise web.HTTPNotFound()
        log.debug("serving %s to %s (Range %s)", f, request.remote, request.headers.get("Range", "-"))
        return web.FileResponse(f, headers={"Cache-Control": "no-store"})

    app = web.Application()
    app.router.add_get("/{version}/{name}", get_file)  # HEAD too
    return app


@dataclass
class WeightsServer:
    runner: web.AppRunner
    url: str  # http://host:port of the bound socket

    async def close(self) -> None:
        await self.runner.cleanup()


async def serve_weights(root: Path, listen: str) -> WeightsServer:
    """Serve ``root``'s published versions on ``listen`` (``host:port``) until ``close``."""
    host, port = parse_listen(listen)
    root.mkdir(parents=True, exist_ok=True)
    runner = web.AppRunner(make_app(root), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = int(runner.addresses[0][1])  # the real port when ``listen`` asked for 0
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{bound}"
    log.info("serving the weights under %s at %s (read-only: published versions only)", root, url)
    return WeightsServer(runner, url)
