"""A policy version's files over HTTP into this host's cache, verified, for workers without shared storage.

With ``rollout.weights_url`` set, the rollout worker hands the engine not the trainer's path but a
local copy (``WeightsFetcher.fetch``):

* **Where.** ``rollout.weights_cache``/RUN/vNNNNNN, the trainer's folder name.  Workers of one host
  share the cache: an exclusive ``flock`` on ``RUN/.lock`` lets one download a version while the
  others wait, then find it there.
* **Resumable.** Each file of the version's ``sha256`` map is fetched from ``URL/vNNNNNN/FILE``
  into ``RUN/.tmp-vNNNNNN/FILE``.  A connection that drops mid-body is retried with ``Range:
  bytes=N-`` from the bytes already on disk (206 appends, 200 starts over, 416 means they are
  all there); so is a partial file left by a killed worker.
* **Verified, then renamed.** Every file's sha256 must equal the ``PolicyVersion`` event's (read
  from Redis, not from the server); a mismatch deletes the file and raises
  :class:`~rolloutpipe.errors.WeightsVerificationError` (the worker counts it in
  ``weight_rejections`` and retries).  Only a fully verified folder is renamed to ``vNNNNNN``, so a
  half-download is never loaded; a folder already there is verified again before it is used.
* **Pruned.** After a fetch, all but the newest ``rollout.weights_cache_keep`` versions (never the
  one just fetched) and older partial folders are removed.

The engine still verifies the copy it loads, as it does on shared storage.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import re
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote

import aiohttp

from rolloutpipe.broker.events import PolicyVersion
from rolloutpipe.config import RolloutConfig
from rolloutpipe.errors import WeightsFetchError, WeightsVerificationError
from rolloutpipe.model.weights import sha256_file, verify_weights

log = logging.getLogger("rolloutpipe.rollout")
VERSION_DIR = re.compile(r"v(\d{6,})")
FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
CHUNK = 1 << 20
_CONTENT_RANGE = re.compile(r"bytes (?:(\d+)-\d+|\*)/(\d+|\*)")


class WeightsFetcher:
    """Fetches published versions from ``base_url`` into ``cache``/``run`` (one per worker process)."""

    def __init__(
        self,
        base_url: str,
        cache: Path,
        run: str,
        keep: int = 2,
        *,
        attempts: int = 5,
        backoff_s: float = 0.2,
        read_timeout_s: float = 60.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.dir = cache.expanduser() / run
        self.keep = keep
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=read_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def fetch(self, pv: PolicyVersion) -> PolicyVersion:
        """``pv`` with ``path`` set to its verified local copy (downloaded unless already cached)."""
        if not pv.sha256:
            return pv  # nothing to fetch (the emulated trainer publishes no files)
        name = Path(pv.path).name
        if not VERSION_DIR.fullmatch(name) or not all(FILE_NAME.fullmatch(f) for f in pv.sha256):
            raise WeightsFetchError(
                f"policy version {pv.policy_version}: {pv.path!r} / {sorted(pv.sha256)} are not a "
                "published version folder and plain file names"
            )
        final = self.dir / name
        local = pv.model_copy(update={"path": str(final)})
        async with self._locked():
            if final.is_dir():
                try:
                    await asyncio.to_thread(verify_weights, local)
                    return local
                except WeightsVerificationError as e:
                    log.warning("cached %s does not verify (%s): fetching it again", final, e)
                    await asyncio.to_thread(shutil.rmtree, final, True)
            t0 = time.monotonic()
            tmp = self.dir / f".tmp-{name}"
            tmp.mkdir(parents=True, exist_ok=True)
            got = 0
            for fname, want in pv.sha256.items():
                part = tmp / fname
                got += await self._download(f"{self.base_url}/{name}/{quote(fname)}", part)
                digest = await asyncio.to_thread(sha256_file, part)
                if digest != want:
                    part.unlink()  # which bytes are bad is unknown: the next try starts over
                    raise WeightsVerificationError(
                        f"policy version {pv.policy_version}: sha256 of {fname} from {self.base_url} is "
                        f"{digest[:12]}…, the PolicyVersion event says {want[:12]}…"
                    )
            await asyncio.to_thread(_replace, tmp, final)
            dt = time.monotonic() - t0
            log.info(
                "fetched policy version %d from %s into %s: %d files, %.1f MB in %.2f s, sha256 verified",
                pv.policy_version, self.base_url, final, len(pv.sha256), got / 1e6, dt,
            )  # fmt: skip
            await asyncio.to_thread(self.prune, final)
        return local

    async def _download(self, url: str, part: Path) -> int:
        """``url`` into ``part``, resuming from the bytes already there; returns the bytes received."""
        received = 0
        for attempt in range(1, self.attempts + 1):
            have = part.stat().st_size if part.exists() else 0
            # identity: the bytes as published (FileResponse would send a .gz sibling compressed)
            headers = {"Accept-Encoding": "identity", **({"Range": f"bytes={have}-"} if have else {})}
            try:
                async with self._client().get(url, headers=headers) as resp:
                    if resp.status == 416 and have:  # asked past the end: whole already, or too long
                        total = _content_range(resp.headers.get("Content-Range", ""))[1]
                        if total == have:
                            return received
                        part.unlink()
                        continue
                    if resp.status == 404:
                        raise WeightsFetchError(f"{url}: 404 (not published there, or pruned)")
                    if resp.status == 206:
                        start = _content_range(resp.headers.get("Content-Range", ""))[0]
                        if start != have:
                            raise WeightsFetchError(f"{url}: asked for bytes {have}-, got {start}-")
                        mode = "ab"
                    elif resp.status == 200:
                        mode = "wb"  # the server ignored Range: start over
                    else:
                        raise aiohttp.ClientResponseError(
                            resp.request_info, resp.history, status=resp.status, message=resp.reason or ""
                        )
                    with part.open(mode) as f:
                        async for chunk in resp.content.iter_chunked(CHUNK):
                            await asyncio.to_thread(f.write, chunk)
                            received += len(chunk)
                    return received
            except (aiohttp.ClientError, TimeoutError) as e:
                at = part.stat().st_size if part.exists() else 0
                if attempt == self.attempts:
                    raise WeightsFetchError(f"{url}: {type(e).__name__}: {e} ({attempt} attempts)") from e
                log.warning(
                    "fetching %s: %s: %s at byte %d; resuming (attempt %d of %d)",
                    url, type(e).__name__, e, at, attempt + 1, self.attempts,
                )  # fmt: skip
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
        raise WeightsFetchError(f"{url}: no complete response in {self.attempts} attempts")

    def prune(self, current: Path) -> list[Path]:
        """Remove all but the newest ``keep`` versions (never ``current``) and older partial folders."""
        versions = sorted(
            (int(m[1]), d) for d in self.dir.iterdir() if (m := VERSION_DIR.fullmatch(d.name)) and d.is_dir()
        )
        now = int(current.name[1:])
        old = [d for _, d in (versions[: -self.keep] if self.keep > 0 else []) if d != current]
        old += [
            d
            for d in self.dir.glob(".tmp-v*")
            if (m := VERSION_DIR.fullmatch(d.name.removeprefix(".tmp-"))) and int(m[1]) < now
        ]
        for d in old:
            shutil.rmtree(d, ignore_errors=True)
        if old:
            log.info("pruned %s from the weights cache", ", ".join(d.name for d in old))
        return old

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        return self._session

    @contextlib.asynccontextmanager
    async def _locked(self) -> AsyncIterator[None]:
        """This host's cache, exclusively (other workers poll; a dead holder's lock is released)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(0.05)
            yield
        finally:
            os.close(fd)  # releases the lock


def _content_range(value: str) -> tuple[int | None, int | None]:
    """``bytes 100-199/200`` -> (100, 200); ``bytes */200`` -> (None, 200)."""
    m = _CONTENT_RANGE.fullmatch(value.strip())
    if m is None:
        return None, None
    return (int(m[1]) if m[1] else None), (int(m[2]) if m[2] != "*" else None)


def _replace(tmp: Path, final: Path) -> None:
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def make_fetcher(rc: RolloutConfig, run: str) -> WeightsFetcher | None:
    """The fetcher ``rollout.weights_url`` asks for; None: engines read the version's path itself."""
    if not rc.weights_url:
        return None
    return WeightsFetcher(rc.weights_url, Path(rc.weights_cache), run, rc.weights_cache_keep)
