"""docker-compose.yml: valid, every command a real ``rolloutpipe`` invocation, and the CPU profile
run green as local processes against a Redis started with the compose file's own ACL users.

Here the containers' command lines are run as local processes (tests/docker runs them in real
containers, as ``scripts/test-compose.sh``, a stage of its own): the same
arguments, the same environment, ``redis:6379`` replaced by a private redis-server that was given
the compose Redis's ``--user`` lines (so every role works with exactly the permissions it has in
compose), and ``rollout`` started three times as ``--scale rollout=3`` would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from rolloutpipe.broker.embedded import EmbeddedRedis, find_redis_server
from rolloutpipe.cli import ROLES, _parser
from rolloutpipe.config import load_config

from .conftest import ROOT

COMPOSE = ROOT / "docker-compose.yml"
_VAR = re.compile(r"\$\{([A-Z0-9_]+)(?::-([^}]*))?\}")


def interpolate(v: Any, env: dict[str, str]) -> Any:
    """Compose's ``${VAR:-default}`` substitution and ``$$`` escape."""
    if isinstance(v, str):
        v = _VAR.sub(lambda m: env.get(m.group(1)) or (m.group(2) or ""), v)
        return v.replace("$$", "$")
    if isinstance(v, list):
        return [interpolate(x, env) for x in v]
    if isinstance(v, dict):
        return {k: interpolate(x, env) for k, x in v.items()}
    return v


def services(env: dict[str, str] | None = None) -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    return {k: v for k, v in interpolate(doc["services"], env or {}).items()}


def test_docker_compose_config_validates() -> None:
    exe = shutil.which("docker-compose")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose (Debian's v1) must be installed in CI; .ci/run installs it")
        pytest.skip("docker-compose is not installed")
    p = subprocess.run([exe, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr


def _role_args(svc: dict[str, Any]) -> list[str]:
    cmd = list(svc["command"])
    return cmd


def test_every_service_runs_a_valid_rolloutpipe_command() -> None:
    svcs = services()
    assert {"redis", "trainer", "aggregator", "controller", "rollout", "cpu-trainer"} <= svcs.keys()
    roles = set()
    for name, svc in svcs.items():
        if name == "redis":
            continue
        args = _role_args(svc)
        ns, unknown = _parser().parse_known_args(args)
        assert ns.cmd in ROLES, (name, args)
        assert all("=" in u and not u.startswith("-") for u in unknown), (name, unknown)
        cfg = load_config(ROOT / ns.config, [*ns.overrides, *unknown], environ={})  # the config loads
        assert ns.redis_url.startswith(f"redis://{ns.cmd}:"), f"{name} must use its own ACL user"
        roles.add((ns.cmd, "gpu" in svc["profiles"]))
        if "gpu" in svc["profiles"]:
            assert cfg.model.path and (
                ns.cmd != "rollout" or cfg.rollout.engine == "vllm" or ns.engine == "vllm"
            )
        # healthchecks that call rolloutpipe are valid invocations too
        test = svc.get("healthcheck", {}).get("test", [])
        if test[:2] == ["CMD", "rolloutpipe"]:
            hns, hunk = _parser().parse_known_args(test[2:])
            assert hns.cmd == "status" and hns.check and not hunk
            assert hns.redis_url.startswith("redis://observer:")
        assert svc.get("depends_on", {}).get("redis", {}).get("condition") == "service_healthy"
        assert "container_name" not in svc
    assert roles == {(r, gpu) for r in ROLES for gpu in (True, False)}
    trainer = svcs["trainer"]
    assert trainer["entrypoint"][:1] == ["torchrun"] and trainer["entrypoint"][-2:] == ["--", "rolloutpipe"]
    gpus = [svcs[f"rollout-gpu{i}"]["deploy"]["resources"]["reservations"]["devices"][0] for i in range(6)]
    assert [g["device_ids"] for g in gpus] == [[str(i)] for i in range(6)]  # one GPU per worker


def test_compose_acl_is_the_one_rolloutpipe_run_uses() -> None:
    """One source of ACL rules: the compose Redis's --user lines are acl.server_args'."""
    from rolloutpipe.broker import acl

    dev = {role: f"{role}-dev" for role in acl.ROLES}
    assert _redis_acl_args(services()["redis"]) == acl.server_args(dev)


def _redis_acl_args(svc: dict[str, Any]) -> list[str]:
    cmd = svc["command"]
    i = cmd.index("--user")
    return [str(x) for x in cmd[i:]]


@pytest.fixture(scope="module")
def acl_redis() -> Any:
    """A private redis-server with the compose file's ACL users (needs Redis >= 7: %R~ selectors)."""
    out = subprocess.run([find_redis_server(), "--version"], capture_output=True, text=True).stdout
    major = int(re.search(r"v=(\d+)", out).group(1))  # type: ignore[union-attr]
    if major < 7:
        pytest.skip(
            f"the compose ACLs need Redis 7 (%R~ key permissions); this redis-server is {out.strip()}"
        )
    with EmbeddedRedis(extra_args=_redis_acl_args(services()["redis"])) as er:
        yield er


def _url(user: str, port: int) -> str:
    return f"redis://{user}:{user}-dev@127.0.0.1:{port}/0"


def test_acl_rollout_worker_cannot_write_groups_control_or_version(acl_redis: EmbeddedRedis) -> None:
    r = redis.Redis.from_url(_url("rollout", acl_redis.port))
    assert r.xadd("rp:{acl}:samples", {"d": b"x"})  # its own output
    for op in (
        lambda: r.xadd("rp:{acl}:groups", {"d": b"x"}),
        lambda: r.xadd("rp:{acl}:control", {"d": b"x"}),
        lambda: r.set("rp:{acl}:version", b"x"),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            op()
    assert r.get("rp:{acl}:version") is None  # reading the version is allowed
    obs = redis.Redis.from_url(_url("observer", acl_redis.port))
    assert obs.xlen("rp:{acl}:samples") == 1
    with pytest.raises(redis.exceptions.NoPermissionError):
        obs.xadd("rp:{acl}:samples", {"d": b"x"})  # tail/status are read-only
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=acl_redis.port).ping()  # the default user is off
    r.close()
    obs.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_cpu_profile_runs_green_as_local_processes(
    acl_redis: EmbeddedRedis, tmp_path: Path, model_cache: str
) -> None:
    env_vars = {"RP_STEPS": "3", "RP_RUN": "composecpu", "RP_REDIS_HOST": "127.0.0.1"}
    svcs = {n: s for n, s in services(env_vars).items() if "cpu" in s.get("profiles", [])}
    assert set(svcs) == {"cpu-trainer", "cpu-aggregator", "rollout", "cpu-controller"}
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # the image's working_dir /app holds configs/
    procs: dict[str, subprocess.Popen[bytes]] = {}
    ports: dict[str, int] = {}
    logs: list[Any] = []

    def start(name: str, svc: dict[str, Any]) -> None:
        args = [a.replace("127.0.0.1:6379", f"127.0.0.1:{acl_redis.port}") for a in svc["command"]]
        ports[name] = _free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("RP_") or k == "RP_REDIS_SERVER"}
        env.update({k: str(v) for k, v in svc.get("environment", {}).items()})
        env.update(RP_METRICS__PORT=str(ports[name]), RP_MODEL__CACHE_DIR=model_cache, OMP_NUM_THREADS="1")
        log = (tmp_path / f"{name}.log").open("wb")
        logs.append(log)
        procs[name] = subprocess.Popen([sys.executable, "-m", "rolloutpipe", *args], cwd=tmp_path, env=env,
                                       stdout=log, stderr=subprocess.STDOUT)  # fmt: skip

    # compose's depends_on order: trainer and aggregator, then the rollout replicas, then the controller
    start("cpu-trainer", svcs["cpu-trainer"])
    start("cpu-aggregator", svcs["cpu-aggregator"])
    for i in range(3):  # --scale rollout=3
        start(f"rollout-{i}", svcs["rollout"])
    health = svcs["cpu-controller"]["healthcheck"]["test"]
    checked, last = False, ""
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and not checked:  # the controller waits for healthy workers
            hc = [a.replace("127.0.0.1:6379", f"127.0.0.1:{acl_redis.port}") for a in health[1:]]
            hp = subprocess.run([sys.executable, "-m", *hc], capture_output=True, text=True)
            checked, last = hp.returncode == 0, hp.stdout + hp.stderr[-2000:]
            for n, p in procs.items():
                assert p.poll() is None, f"{n} exited: {(tmp_path / f'{n}.log').read_text()[-2000:]}"
            time.sleep(0.5)
        assert checked, f"status --check never became healthy: {last}"
        start("cpu-controller", svcs["cpu-controller"])
        for name in procs:  # every role ends by itself once the controller marks the run done
            while procs[name].poll() is None and time.monotonic() < deadline:
                for n in procs:  # an ACL gap shows up as NOPERM in a role's log: fail at once
                    text = (tmp_path / f"{n}.log").read_text(errors="replace")
                    at = text.find("NoPermissionError")
                    assert at < 0, f"{n}: {text[at : at + 400]}"
                time.sleep(0.5)
            if procs[name].poll() is None:
                alive = [n for n, p in procs.items() if p.poll() is None]
                tails = {n: (tmp_path / f"{n}.log").read_text(errors="replace")[-600:] for n in alive}
                pytest.fail(f"still running at the deadline: {alive}; their logs end: {tails}")
            code = procs[name].wait(1)
            assert code == 0, f"{name} exited {code}: {(tmp_path / f'{name}.log').read_text()[-3000:]}"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    metrics = (tmp_path / "runs" / "composecpu" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 3
    # the trainer's timeline (the demo config records it) names the worker of every trained sample;
    # the streams themselves are trimmed once consumed
    timeline = (tmp_path / "runs" / "composecpu" / "timeline.jsonl").read_text().splitlines()
    workers = {s[0] for line in timeline for g in json.loads(line)["groups"] for s in g["samples"]}
    assert len(workers) == 3, f"all three replicas generated: {workers}"
