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
import shlex
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.embedded import EmbeddedRedis, find_redis_server
from rolloutpipe.broker.events import Lease
from rolloutpipe.broker.keys import DATA, Keys, pool_keys
from rolloutpipe.broker.once import MIGRATE_LUA
from rolloutpipe.cli import ROLES, _parser
from rolloutpipe.config import load_config
from tests.support.config import ROOT

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


def docker_compose() -> str:
    exe = shutil.which("docker-compose")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose (Debian's v1) must be installed in CI; .ci/run installs it")
        pytest.skip("docker-compose is not installed")
    return exe


def test_docker_compose_config_validates() -> None:
    exe = docker_compose()
    p = subprocess.run([exe, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr


def compose_config(profile: str, env: dict[str, str], tmp_path: Path) -> dict[str, Any]:
    """``docker-compose --profile PROFILE config``: the services as compose renders them (variables
    interpolated, anchors and merge keys resolved), from ``env`` alone (no shell RP_…, no .env)."""
    exe = docker_compose()
    empty = tmp_path / "empty.env"
    empty.write_text("")
    base = {k: v for k, v in os.environ.items() if not k.startswith("RP_")}
    p = subprocess.run(
        [exe, "-f", str(COMPOSE), "--env-file", str(empty), "--profile", profile, "config"],
        capture_output=True, text=True, cwd=ROOT, env={**base, **env},
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    svcs: dict[str, Any] = yaml.safe_load(p.stdout)["services"]
    return svcs


def _role_args(svc: dict[str, Any]) -> list[str]:
    cmd = list(svc["command"])
    return cmd


def test_every_service_runs_a_valid_rolloutpipe_command() -> None:
    svcs = services()
    assert {"redis", "trainer", "aggregator", "controller", "rollout", "cpu-trainer"} <= svcs.keys()
    roles: dict[str, set[str]] = {}
    for name, svc in svcs.items():
        if name == "redis":
            continue
        args = _role_args(svc)
        ns, unknown = _parser().parse_known_args(args)
        assert ns.cmd in (*ROLES, "pool"), (name, args)
        assert all("=" in u and not u.startswith("-") for u in unknown), (name, unknown)
        cfg = load_config(ROOT / ns.config, [*ns.overrides, *unknown], environ={})  # the config loads
        assert ns.redis_url.startswith(f"redis://{ns.cmd}:"), f"{name} must use its own ACL user"
        (profile,) = svc["profiles"]
        roles.setdefault(profile, set()).add(ns.cmd)
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
    assert roles == {"gpu": set(ROLES), "cpu": set(ROLES), "pool": {*ROLES, "pool"}}
    trainer = svcs["trainer"]
    assert trainer["entrypoint"][:1] == ["torchrun"] and trainer["entrypoint"][-2:] == ["--", "rolloutpipe"]
    gpus = [svcs[f"rollout-gpu{i}"]["deploy"]["resources"]["reservations"]["devices"][0] for i in range(6)]
    assert [g["device_ids"] for g in gpus] == [[str(i)] for i in range(6)]  # one GPU per worker


# ----------------------------------------------------------------- the pool profile: one pool, two runs

POOL_ENVS = {
    "defaults": {},
    "renamed": {"RP_RUN_A": "alpha", "RP_RUN_B": "beta", "RP_POOL": "p1", "RP_POOL_POLICY": "greedy"},
}


def check_pool_profile(svcs: dict[str, Any], runs: list[str], pool: str, policy: str) -> None:
    """The ``pool`` profile starts one pool scheduler leasing to ``runs``, one scalable pool-worker
    service (``--pool``, no ``--run``), and for each run its own controller, aggregator, trainer."""
    mine = {n: s for n, s in svcs.items() if "pool" in s.get("profiles", [])}
    parsed = {n: _parser().parse_known_args([str(a) for a in s["command"]]) for n, s in mine.items()}
    by_role: dict[str, list[str]] = {}
    for n, (ns, _) in parsed.items():
        by_role.setdefault(ns.cmd, []).append(n)
    assert sorted(by_role) == ["aggregator", "controller", "pool", "rollout", "trainer"], by_role
    (sched,) = by_role["pool"]
    sns = parsed[sched][0]
    assert (sns.pool, sns.runs.split(","), sns.policy) == (pool, runs, policy)
    (workers,) = by_role["rollout"]  # one service, scaled with --scale
    wns, wsvc = parsed[workers][0], mine[workers]
    assert wns.pool == pool and wns.run == "" and "--run" not in wsvc["command"]
    assert not wns.worker_id and "RP_WORKER_ID" not in wsvc.get("environment", {})  # one id per replica
    assert "container_name" not in wsvc and "deploy" not in wsvc
    shell, cmd = wsvc["healthcheck"]["test"]
    argv = shlex.split(cmd.replace("$$", "$").replace("$(hostname)", "HOST"))
    hns, hunk = _parser().parse_known_args(argv[1:])
    assert shell == "CMD-SHELL" and argv[0] == "rolloutpipe" and not hunk
    assert (hns.cmd, hns.run, hns.check, hns.worker) == ("status", f"pool:{pool}", True, "HOST-1")
    assert hns.redis_url.startswith("redis://observer:")
    per_run: dict[tuple[str, str], list[str]] = {}
    roles = ("controller", "aggregator", "trainer")
    for role in roles:
        for n in by_role[role]:
            per_run.setdefault((parsed[n][0].run, role), []).append(n)
    assert sorted(per_run) == sorted((r, role) for r in runs for role in roles)
    assert all(len(ns) == 1 for ns in per_run.values()), per_run
    for run in runs:
        (ctl,), (agg,), (trainer,) = (per_run[run, role] for role in roles)
        assert parsed[trainer][0].out == f"runs/{run}"
        # the controller starts last, as in the cpu profile: its run's roles and the pool healthy
        deps = mine[ctl]["depends_on"]
        assert {"redis", trainer, agg, sched, workers} <= set(deps), (ctl, deps)
        assert all(d["condition"] == "service_healthy" for d in deps.values())
        cns, cunk = _parser().parse_known_args(mine[ctl]["healthcheck"]["test"][2:])
        assert (cns.cmd, cns.run, cns.check, cunk) == ("status", run, True, [])
        assert trainer in wsvc["depends_on"]  # workers load each run's first version
    for n, s in mine.items():  # `--profile pool up` starts everything the profile needs
        assert all(d in mine or not svcs[d].get("profiles") for d in s.get("depends_on", {})), n
    # the runs of a pool share one engine, task and verifier (docs/architecture.md, "Limits")
    cfgs = [load_config(ROOT / ns.config, [*ns.overrides, *unk], environ={}) for ns, unk in parsed.values()]
    assert len({(c.rollout.engine, c.task.model_dump_json(), c.model.model_dump_json()) for c in cfgs}) == 1


def _pool_names(env: dict[str, str]) -> tuple[list[str], str, str]:
    runs = [env.get("RP_RUN_A", "run-a"), env.get("RP_RUN_B", "run-b")]
    return runs, env.get("RP_POOL", "shared"), env.get("RP_POOL_POLICY", "lookahead")


@pytest.mark.parametrize("env", POOL_ENVS.values(), ids=POOL_ENVS.keys())
def test_pool_profile_one_pool_two_runs(env: dict[str, str]) -> None:
    check_pool_profile(services(env), *_pool_names(env))


@pytest.mark.parametrize("env", POOL_ENVS.values(), ids=POOL_ENVS.keys())
def test_docker_compose_config_of_the_pool_profile(env: dict[str, str], tmp_path: Path) -> None:
    """The same, on what ``docker-compose --profile pool config`` renders (it also validates the file)."""
    check_pool_profile(compose_config("pool", env, tmp_path), *_pool_names(env))


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


def test_acl_handback_and_trimming_old_steps(acl_redis: EmbeddedRedis) -> None:
    """A pool worker moved to another run hands its running requests back (``Broker.migrate``:
    ``MIGRATE_LUA`` writes ``migrated:k``) as ``rollout``, and the controller deletes old steps'
    keys (``Keys.step_keys``, ``migrated:k`` among them) as ``controller``."""
    k = Keys("aclmig")
    ro = redis.Redis.from_url(_url("rollout", acl_redis.port))
    keys = [k.ops(0), k.requests, k.migrated(0), k.finished_ids(0), k.stats]
    # ARGV: token, consumer group, entry, origin, continuation payload, step, tokens carried, maxlen
    out = ro.eval(MIGRATE_LUA, len(keys), *keys, "tok", "rollout", "1-0", "1-0", b"x", 0, 3, 1000)
    assert out not in (b"0", "0")  # the continuation is on `requests`
    ctl = redis.Redis.from_url(_url("controller", acl_redis.port))
    assert ctl.delete(*k.step_keys(0)) == 2  # ops:0 and migrated:0
    ro.close()
    ctl.close()


class Local:
    """Services of the compose file started as local processes against ``port`` (their logs in
    ``tmp_path``), as ``test_cpu_profile_runs_green_as_local_processes`` does."""

    def __init__(self, tmp_path: Path, port: int, model_cache: str) -> None:
        self.dir, self.port, self.model_cache = tmp_path, port, model_cache
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        (tmp_path / "configs").symlink_to(ROOT / "configs")  # the image's working_dir /app holds configs/

    def args(self, argv: list[str]) -> list[str]:
        return [a.replace("127.0.0.1:6379", f"127.0.0.1:{self.port}") for a in argv]

    def start(self, name: str, svc: dict[str, Any]) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RP_") or k == "RP_REDIS_SERVER"}
        env.update({k: str(v) for k, v in svc.get("environment", {}).items()})
        env.update(RP_METRICS__PORT=str(_free_port()), OMP_NUM_THREADS="1")
        env.update(RP_MODEL__CACHE_DIR=self.model_cache)
        with (self.dir / f"{name}.log").open("wb") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "rolloutpipe", *self.args(svc["command"])], cwd=self.dir, env=env,
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        return self.procs[name]

    def log(self, name: str) -> str:
        return (self.dir / f"{name}.log").read_text(errors="replace")

    def check(self, *, exited_ok: bool = False) -> None:
        """Fail at once on a role that died, or on NOPERM in a log (an ACL gap)."""
        for n, p in self.procs.items():
            at = self.log(n).find("NoPermissionError")
            assert at < 0, f"{n}: {self.log(n)[at : at + 400]}"
            code = p.poll()
            assert code is None or (exited_ok and code == 0), f"{n} exited {code}: {self.log(n)[-2000:]}"

    def rolloutpipe(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "rolloutpipe", *self.args(list(argv))],
                              capture_output=True, text=True, timeout=60)  # fmt: skip

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def test_pool_scheduler_and_pool_worker_run_as_their_compose_users(
    acl_redis: EmbeddedRedis, tmp_path: Path, model_cache: str
) -> None:
    """The pool profile's scheduler (as ``pool``) and a pool worker (as ``rollout``) against the
    compose Redis's users: the scheduler leases the worker to a run, the worker serves it (its
    heartbeat in the run's ``workers``), and the commands docs/operations.md gives to watch a pool
    work as ``observer``: the worker's healthcheck, ``status --run pool:NAME``, ``tail leases``."""
    tag = uuid.uuid4().hex[:6]
    env = {"RP_RUN_A": f"pa{tag}", "RP_RUN_B": f"pb{tag}", "RP_POOL": f"p{tag}", "RP_REDIS_HOST": "127.0.0.1"}
    runs, pool, _ = _pool_names(env)
    svcs = services(env)
    local = Local(tmp_path, acl_redis.port, model_cache)
    obs = redis.Redis.from_url(_url("observer", acl_redis.port))
    pk = pool_keys(pool)
    try:
        local.start("pool-scheduler", svcs["pool-scheduler"])
        local.start("pool-rollout", svcs["pool-rollout"])
        deadline, served = time.monotonic() + 180, ("", "")
        while time.monotonic() < deadline and not served[0]:
            local.check()
            lease: Any = obs.hgetall(pk.lease)
            for wid, run in lease.items():
                if run.decode() in runs and obs.zscore(Keys(run.decode()).workers, wid) is not None:
                    served = (wid.decode(), run.decode())
            time.sleep(0.5)
        assert served[0], f"no pool worker served a run: {local.log('pool-scheduler')[-1500:]}"
        wid, run = served
        obs_url = svcs["pool-rollout"]["healthcheck"]["test"][1].split("--redis-url ")[1]
        health = local.rolloutpipe("status", "--run", f"pool:{pool}", "--check", "--worker", wid,
                                   "--redis-url", obs_url)  # fmt: skip
        assert health.returncode == 0, health.stdout + health.stderr
        st = local.rolloutpipe("status", "--run", f"pool:{pool}", "--json", "--redis-url", obs_url)
        assert st.returncode == 0, st.stderr
        assert json.loads(st.stdout)["pool"]["lease"].get(wid) == run
        tail = local.rolloutpipe("tail", "leases", "--run", f"pool:{pool}", "--redis-url", obs_url)
        assert tail.returncode == 0 and wid in tail.stdout and run in tail.stdout, tail.stdout + tail.stderr
        st = local.rolloutpipe("status", "--run", run, "--json", "--redis-url", obs_url)
        assert st.returncode == 0 and wid in [w["id"] for w in json.loads(st.stdout)["workers"]], st.stdout
        local.check()
    finally:
        local.stop()
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


@pytest.mark.slow
@pytest.mark.timeout(600)  # nine processes on a loaded 2-core machine: 77-158 s measured
def test_pool_profile_runs_green_as_local_processes(
    acl_redis: EmbeddedRedis, tmp_path: Path, model_cache: str
) -> None:
    """The ``pool`` profile's command lines, two pool workers as ``--scale pool-rollout=2``: both
    runs train all their steps, every sample generated by a pool worker, the moves in ``leases``."""
    tag = uuid.uuid4().hex[:6]
    env = {"RP_STEPS": "3", "RP_RUN_A": f"ca{tag}", "RP_RUN_B": f"cb{tag}", "RP_POOL": f"cp{tag}",
           "RP_REDIS_HOST": "127.0.0.1"}  # fmt: skip
    runs, pool, _ = _pool_names(env)
    svcs = {n: s for n, s in services(env).items() if "pool" in s.get("profiles", [])}
    local = Local(tmp_path, acl_redis.port, model_cache)
    obs = redis.Redis.from_url(_url("observer", acl_redis.port))
    ends = [n for n in svcs if n != "pool-rollout"]  # all but the pool's workers end by themselves
    deadline = time.monotonic() + 540
    try:
        # compose's depends_on order: each run's trainer and aggregator, the scheduler, the workers
        # (after the trainers), then the controllers once each run has a live worker
        for n in (*(f"run-{x}-{r}" for x in "ab" for r in ("trainer", "aggregator")), "pool-scheduler"):
            local.start(n, svcs[n])
        workers = [local.start(f"pool-rollout-{i}", svcs["pool-rollout"]) for i in range(2)]
        for x in "ab":
            health, last = svcs[f"run-{x}-controller"]["healthcheck"]["test"], ""
            while time.monotonic() < deadline:
                hp = local.rolloutpipe(*health[2:])
                if hp.returncode == 0:
                    break
                last = hp.stdout + hp.stderr[-2000:]
                local.check()
                time.sleep(0.5)
            else:
                pytest.fail(f"status --check of run-{x} never became healthy: {last}")
        for x in "ab":
            local.start(f"run-{x}-controller", svcs[f"run-{x}-controller"])
        while time.monotonic() < deadline and any(local.procs[n].poll() is None for n in ends):
            local.check(exited_ok=True)
            time.sleep(0.5)
        alive = [n for n in ends if local.procs[n].poll() is None]
        assert not alive, f"still running at the deadline: {alive}: {[local.log(n)[-600:] for n in alive]}"
        local.check(exited_ok=True)  # every role but the workers exited 0
        assert all(p.poll() is None for p in workers)  # they wait for the next lease
        wids = {f"{socket.gethostname()}-{p.pid}" for p in workers}
        for run in runs:
            metrics = (tmp_path / "runs" / run / "metrics.jsonl").read_text().splitlines()
            assert len(metrics) == 3, run
            timeline = (tmp_path / "runs" / run / "timeline.jsonl").read_text().splitlines()
            served = {s[0] for line in timeline for g in json.loads(line)["groups"] for s in g["samples"]}
            assert served and served <= wids, (run, served, wids)
        entries: Any = obs.xrange(pool_keys(pool).leases)
        leases = [DEFAULT_CODEC.decode_as(f[DATA], Lease) for _, f in entries]
        assert {x.worker for x in leases} == wids and {x.to_run for x in leases} <= set(runs)
    finally:
        local.stop()
        obs.close()
