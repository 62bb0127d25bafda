"""Tests talk to a real redis-server started for the session on a free loopback port (never 6379)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from rolloutpipe.broker.connect import connect
from rolloutpipe.broker.embedded import EmbeddedRedis
from rolloutpipe.broker.streams import Broker
from rolloutpipe.config import Config, load_config

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------ no silent skips


def engine_suite(module: str) -> list[str]:
    """``collect_ignore_glob`` for an engine's test folder (``tests/deepspeed``, ``tests/vllm``).

    Its script (``scripts/test-deepspeed.sh``, ``scripts/test-vllm.sh``) runs it in the engine's
    own venv with ``RP_SUITE=<module>``: there an engine that cannot be imported stops the run with
    an error, instead of skipping every test.  Elsewhere (the core suite in ``.venv``) the folder is
    not collected unless the engine happens to be installed.
    """
    if os.environ.get("RP_SUITE") == module:
        try:
            importlib.import_module(module)
        except Exception as e:  # ImportError, or an engine that fails while importing
            raise pytest.UsageError(
                f"RP_SUITE={module}: {module} cannot be imported by {sys.executable}: {type(e).__name__}: {e}"
            ) from e
        return []
    return [] if importlib.util.find_spec(module) is not None else ["test_*.py"]


def _ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


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
    elif skipped and _ci():
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


def make_config(tmp_path: Path, run: str, *overrides: str, base: str = "configs/demo.yaml") -> Config:
    return load_config(ROOT / base, [f"run={run}", f"out={tmp_path / run}", *overrides], environ={})


EMULATED_FAST = (
    "rollout.engine=emulated",
    "trainer.backend=emulated",
    "rollout.workers=2",
    "rollout.emulated.max_num_seqs=16",
    "rollout.emulated.length_median=200",
    "rollout.emulated.length_sigma=0.8",
    "rollout.emulated.max_response_tokens=2000",
    "rollout.emulated.time_scale=0.01",
    "trainer.emulated.time_scale=0.01",
    "trainer.emulated.tokens_per_s=20000",
    "controller.prompts_per_step=8",
    "controller.group_size=4",
    "controller.minibatches=2",
    "rollout.claim_idle_s=2.0",
    "rollout.heartbeat_s=0.3",
)


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Any]:
    """A local Redis Cluster (3 masters, one replica each) for the session: ``tests/rediscluster.py``."""
    from tests.rediscluster import LocalCluster

    lc = LocalCluster().start()
    try:
        yield lc
    finally:
        lc.stop()
