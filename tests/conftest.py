"""Tests talk to a real redis-server started for the session on a free loopback port (never 6379)."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from rolloutpipe.broker.connect import connect
from rolloutpipe.broker.embedded import EmbeddedRedis
from rolloutpipe.broker.streams import Broker
from tests.support.config import ci

# ------------------------------------------------------------------------------------ no silent skips


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A silent skip is a hidden failure: a run whose every test skipped fails, and under ``CI=true``
    any skip fails the run (CI installs what each test needs: Redis >= 7 for the ACL and TLS tests,
    docker-compose, the engines' venvs), naming the tests and their reasons."""
    tr = session.config.pluginmanager.get_plugin("terminalreporter")
    if tr is None:
        return
    skipped = tr.stats.get("skipped", [])
    ran = sum(len(tr.stats.get(k, [])) for k in ("passed", "failed", "error", "xfailed", "xpassed"))
    why = ""
    if skipped and ran == 0:
        why = f"every test skipped ({len(skipped)})"
    elif skipped and ci():
        why = f"{len(skipped)} test(s) skipped under CI=true"
    if why:
        tr.ensure_newline()
        tr.write_line(f"FAILED: {why}; a silent skip is a hidden failure:", red=True, bold=True)
        for rep in skipped:
            reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            tr.write_line(f"  {rep.nodeid}: {reason}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as er:
        assert er.port != 6379
        yield er


@pytest.fixture(scope="session")
def redis_url(redis_server: EmbeddedRedis) -> str:
    return redis_server.url


@pytest.fixture()
def run_name() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture()
async def ar(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    r = connect(redis_url)
    yield r
    await r.aclose()


@pytest.fixture()
def sr(redis_url: str) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_url)
    yield r
    r.close()


@pytest.fixture()
async def broker(ar: aioredis.Redis, run_name: str) -> Broker:
    return Broker(ar, run_name, "test")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Shared cache of the tiny model (built once per session, no download)."""
    env = os.environ.get("RP_TEST_MODEL_CACHE")
    return env or str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Any]:
    """A local Redis Cluster (3 masters, one replica each) for the session:
    ``tests/support/rediscluster.py``."""
    from tests.support.rediscluster import LocalCluster

    lc = LocalCluster().start()
    try:
        yield lc
    finally:
        lc.stop()
