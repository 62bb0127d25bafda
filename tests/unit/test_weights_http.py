"""Weights across hosts: the trainer's HTTP endpoint (``roles/trainer/weights_http.py``) and the worker's
fetcher (``model/fetch.py``), against a real aiohttp server on loopback.

Catches: a path outside the published version folders served (``..``, encoded slashes, a ``.tmp-*``
folder still being written, a hidden file, a symlink out of the folder); corrupted bytes loaded or
left in the cache under the version's name; a dropped connection that restarts the download from
byte 0 (or leaves a short file) instead of resuming with a Range request; a partial file left by a
killed worker thrown away; a bad checksum not counted in ``weight_rejections`` or not retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from aiohttp import web

from rolloutpipe.broker.events import PolicyVersion
from rolloutpipe.broker.streams import Broker
from rolloutpipe.config import parse_listen
from rolloutpipe.errors import ConfigError, WeightsVerificationError
from rolloutpipe.model.fetch import WeightsFetcher
from rolloutpipe.model.weights import WEIGHTS_FILE, publish_weights, sha256_file, verify_weights
from rolloutpipe.roles.rollout import RolloutWorker
from rolloutpipe.roles.trainer.weights_http import WeightsServer, make_app, serve_weights
from tests.support.config import make_config


def _state(seed: int, n: int = 1 << 18) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(7, generator=g)}  # n floats: 4n bytes


@contextlib.asynccontextmanager
async def serving(root: Path, app: web.Application | None = None) -> AsyncIterator[str]:
    """The weights app on a free loopback port; yields its base URL."""
    if app is None:
        server: WeightsServer = await serve_weights(root, "127.0.0.1:0")
        try:
            yield server.url
        finally:
            await server.close()
        return
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def _raw_get(url: str, target: str) -> int:
    """The status of ``GET target`` sent byte for byte (no client normalises ``..`` or ``%2F`` away)."""
    host, port = url.removeprefix("http://").split(":")
    r, w = await asyncio.open_connection(host, int(port))
    w.write(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    await w.drain()
    status = int((await r.readline()).split()[1])
    w.close()
    await w.wait_closed()
    return status


async def test_fetch_copies_a_version_verified_into_the_cache_and_prunes(tmp_path: Path) -> None:
    root, cache = tmp_path / "A" / "weights", tmp_path / "B"
    pvs = [publish_weights(_state(v), root, "r", v) for v in range(3)]
    async with serving(root) as url:
        f = WeightsFetcher(url, cache, "r", keep=2)
        try:
            locals_ = [await f.fetch(pv) for pv in pvs]
        finally:
            await f.close()
    for pv, local in zip(pvs, locals_, strict=True):
        assert Path(local.path) == cache / "r" / Path(pv.path).name
        assert local.sha256 == pv.sha256 and local.policy_version == pv.policy_version
    verify_weights(locals_[-1])
    assert sha256_file(Path(locals_[-1].path) / WEIGHTS_FILE) == pvs[-1].sha256[WEIGHTS_FILE]
    # pruned to the newest two; no partial folder left; only files of the sha256 map were fetched
    assert sorted(p.name for p in (cache / "r").iterdir() if not p.name.startswith(".lock")) == [
        "v000001",
        "v000002",
    ]
    assert [p.name for p in (cache / "r" / "v000002").iterdir()] == [WEIGHTS_FILE]


async def test_traversal_tmp_folders_and_hidden_files_are_not_served(tmp_path: Path) -> None:
    root = tmp_path / "weights"
    publish_weights(_state(0, 64), root, "r", 1)
    (tmp_path / "secret.txt").write_text("not for workers")
    tmp_dir = root / ".tmp-v000002-4242-somehost"  # a version still being written
    tmp_dir.mkdir()
    (tmp_dir / WEIGHTS_FILE).write_bytes(b"half")
    (root / "v000001" / ".hidden").write_text("x")
    (root / "v000001" / "link").symlink_to(tmp_path / "secret.txt")
    (root / "vnotaversion").mkdir()
    (root / "vnotaversion" / "f").write_text("x")
    async with serving(root) as url:
        assert await _raw_get(url, f"/v000001/{WEIGHTS_FILE}") == 200
        assert await _raw_get(url, "/v000001/manifest.json") == 200
        refused = [
            "/v000001/../../secret.txt",
            "/v000001/..%2F..%2Fsecret.txt",
            "/..%2Fsecret.txt/x",
            "/v000001/%2e%2e%2f%2e%2e%2fsecret.txt",
            "/%2e%2e/secret.txt",
            f"/.tmp-v000002-4242-somehost/{WEIGHTS_FILE}",
            f"/.tmp-v000002-4242-somehost%2F{WEIGHTS_FILE}",
            "/v000001/.hidden",
            "/v000001/link",  # a symlink out of the version folder
            "/vnotaversion/f",
            "/v000001",
            "/v000001/",
            "/",
            "/secret.txt",
        ]
        got = {t: await _raw_get(url, t) for t in refused}
    assert all(s in (400, 404) for s in got.values()), got


async def test_corrupted_bytes_are_rejected_and_never_land_in_the_cache(tmp_path: Path) -> None:
    root, cache = tmp_path / "weights", tmp_path / "B"
    pv = publish_weights(_state(1), root, "r", 1)
    f = root / "v000001" / WEIGHTS_FILE
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same length
    f.write_bytes(bytes(data))
    async with serving(root) as url:
        fetcher = WeightsFetcher(url, cache, "r")
        try:
            with pytest.raises(WeightsVerificationError, match=r"sha256 of model\.safetensors"):
                await fetcher.fetch(pv)
        finally:
            await fetcher.close()
    assert not (cache / "r" / "v000001").exists(), "a version folder appears only verified"
    assert not (cache / "r" / ".tmp-v000001" / WEIGHTS_FILE).exists(), "bad bytes are not resumed from"


class _CutProxy:
    """A TCP proxy that forwards only the first ``cut_after`` response bytes of its first connection,
    then closes it (a connection dropped mid-body); later connections pass through whole."""

    def __init__(self, upstream: str, cut_after: int) -> None:
        self.host, port = upstream.removeprefix("http://").split(":")
        self.port = int(port)
        self.cut_after = cut_after
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _accept(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.connections += 1
        limit = self.cut_after if self.connections == 1 else None
        sr, sw = await asyncio.open_connection(self.host, self.port)

        async def pump(r: asyncio.StreamReader, w: asyncio.StreamWriter, limit: int | None) -> None:
            sent = 0
            with contextlib.suppress(ConnectionError):
                while chunk := await r.read(1 << 16):
                    if limit is not None and sent + len(chunk) >= limit:
                        w.write(chunk[: limit - sent])
                        await w.drain()
                        break
                    w.write(chunk)
                    await w.drain()
                    sent += len(chunk)
            for x in (w, cw, sw):
                x.close()

        await asyncio.gather(pump(cr, sw, None), pump(sr, cw, limit), return_exceptions=True)


async def test_a_dropped_connection_resumes_with_a_range_request(tmp_path: Path) -> None:
    root, cache = tmp_path / "weights", tmp_path / "B"
    pv = publish_weights(_state(2, 1 << 20), root, "r", 1)  # ~4 MiB
    size = (root / "v000001" / WEIGHTS_FILE).stat().st_size
    app = make_app(root)
    ranges: list[str] = []

    async def record(request: web.Request, response: web.StreamResponse) -> None:
        ranges.append(request.headers.get("Range", ""))

    app.on_response_prepare.append(record)
    async with serving(root, app) as url:
        proxy = _CutProxy(url, cut_after=size // 3)
        purl = await proxy.start()
        fetcher = WeightsFetcher(purl, cache, "r", backoff_s=0.01)
        try:
            local = await fetcher.fetch(pv)
        finally:
            await fetcher.close()
            await proxy.close()
    assert proxy.connections == 2
    assert ranges[0] == "" and ranges[1].startswith("bytes=")
    resumed_at = int(ranges[1].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at < size // 3, "resumed from the bytes that arrived, not from 0"
    verify_weights(local)
    assert Path(local.path) == cache / "r" / "v000001"


async def test_a_partial_file_left_behind_is_resumed(tmp_path: Path) -> None:
    root, cache = tmp_path / "weights", tmp_path / "B"
    pv = publish_weights(_state(3), root, "r", 4)
    src = (root / "v000004" / WEIGHTS_FILE).read_bytes()
    part = cache / "r" / ".tmp-v000004" / WEIGHTS_FILE  # as a killed worker leaves it
    part.parent.mkdir(parents=True)
    part.write_bytes(src[:1000])
    app = make_app(root)
    ranges: list[str] = []

    async def record(request: web.Request, response: web.StreamResponse) -> None:
        ranges.append(request.headers.get("Range", ""))

    app.on_response_prepare.append(record)
    async with serving(root, app) as url:
        fetcher = WeightsFetcher(url, cache, "r")
        try:
            local = await fetcher.fetch(pv)
            again = await fetcher.fetch(pv)  # already cached: verified, not downloaded again
        finally:
            await fetcher.close()
    assert ranges == ["bytes=1000-"]
    assert (Path(local.path) / WEIGHTS_FILE).read_bytes() == src and again.path == local.path


class _LoadingEngine:
    """Verifies and records what it loads, like the real engines (``load_verified_state``)."""

    def __init__(self) -> None:
        self.loaded: list[tuple[int, str]] = []

    @property
    def capacity(self) -> int:
        return 1

    async def start(self) -> None:
        pass

    async def load_weights(self, pv: PolicyVersion) -> None:
        verify_weights(pv)
        self.loaded.append((pv.policy_version, pv.path))

    async def close(self) -> None:
        pass


async def test_worker_counts_a_bad_checksum_retries_and_loads_only_verified_weights(
    tmp_path: Path, run_name: str, broker: Broker
) -> None:
    root, cache = tmp_path / "A", tmp_path / "B"
    good = _state(5)
    pv = publish_weights(good, root, run_name, 1)
    f = root / "v000001" / WEIGHTS_FILE
    original = f.read_bytes()
    f.write_bytes(original[:-8] + b"\0" * 8)  # corrupt on the trainer's side
    async with serving(root) as url:
        cfg = make_config(
            tmp_path, run_name, "rollout.engine=emulated", f"rollout.weights_url={url}",
            f"rollout.weights_cache={cache}",
        )  # fmt: skip
        engine = _LoadingEngine()
        worker = RolloutWorker(cfg, broker, engine, "w0")  # type: ignore[arg-type]
        await broker.r.set(broker.keys.version, broker.encode(pv))
        stop = asyncio.Event()
        task = asyncio.create_task(worker.ensure_version(1, stop))
        deadline = time.monotonic() + 20
        while await broker.stat("weight_rejections") < 2:
            assert time.monotonic() < deadline and not task.done()
            await asyncio.sleep(0.05)
        assert engine.loaded == [] and worker.version == -1, "a bad checksum is never loaded"
        f.write_bytes(original)  # the trainer's file is whole again: the retry loads it
        assert await asyncio.wait_for(task, 20)
        assert worker.fetcher is not None
        await worker.fetcher.close()
    assert engine.loaded == [(1, str(cache / run_name / "v000001"))]
    assert worker.version == 1


def test_config_keys_are_checked(tmp_path: Path) -> None:
    cfg = make_config(
        tmp_path, "c", "trainer.weights_serve=0.0.0.0:8700", "rollout.weights_url=http://h:8700"
    )
    assert cfg.rollout.weights_url == "http://h:8700" and cfg.rollout.weights_cache_keep == 2
    assert parse_listen(cfg.trainer.weights_serve) == ("0.0.0.0", 8700)
    assert parse_listen("[::1]:0") == ("::1", 0)  # (quoted in YAML: "[::1]:0")
    for bad in ("trainer.weights_serve=8700", "trainer.weights_serve=h:99999", "rollout.weights_url=h:8700"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            make_config(tmp_path, "c", bad)


async def test_workers_of_one_host_share_one_download(tmp_path: Path) -> None:
    """Two fetchers (two workers) on one cache: the lock lets one download, the other finds the copy."""
    root, cache = tmp_path / "weights", tmp_path / "B"
    pv = publish_weights(_state(6), root, "r", 2)
    app = make_app(root)
    gets: list[str] = []

    async def record(request: web.Request, response: web.StreamResponse) -> None:
        gets.append(request.path)

    app.on_response_prepare.append(record)
    async with serving(root, app) as url:
        a, b = WeightsFetcher(url, cache, "r"), WeightsFetcher(url, cache, "r")
        try:
            la, lb = await asyncio.gather(a.fetch(pv), b.fetch(pv))
        finally:
            await a.close()
            await b.close()
    assert gets == [f"/v000002/{WEIGHTS_FILE}"]
    assert la.path == lb.path == str(cache / "r" / "v000002")
    verify_weights(la)


def test_no_url_means_no_fetcher(tmp_path: Path) -> None:
    """Without rollout.weights_url the engine gets the event as published (shared storage)."""
    from rolloutpipe.model.fetch import make_fetcher

    assert make_fetcher(make_config(tmp_path, "c").rollout, "c") is None
    f = make_fetcher(make_config(tmp_path, "c", "rollout.weights_url=http://h:1/").rollout, "c")
    assert (
        f is not None and f.base_url == "http://h:1" and f.dir == Path.home() / ".cache/rolloutpipe/weights/c"
    )
