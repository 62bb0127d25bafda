"""docker-compose.yml run for real: the images built, the ``cpu`` profile up in containers with three
rollout replicas, every service healthy, ``rolloutpipe status --check`` passing from outside the
containers as the read-only ``observer`` user, two rollout containers killed mid-step and brought
back, and the run still trains every planned group exactly once (the trainer's committed-group
log, ``runs/RUN/groups.msgpack``, read out of the ``runs`` volume).

Run by ``scripts/test-compose.sh`` (``make test``'s last stage), not by the core suite.  It uses the
Docker engine that is running, else starts ``dockerd`` (root) and stops that one by its PID at the
end.  Where ``redis:7.2`` or ``python:3.11-slim`` cannot be pulled it builds the Debian base image
(``scripts/docker-base.sh``) and runs Redis and the CPU image from it; where pip's own config has a
local ``torch==2.13.0`` CPU wheel, that wheel goes into the build context (``TORCH_SOURCE=local``).
No engine at all: a failure under ``CI=true``, a skip (with the reason) elsewhere.

Two kills, because Docker treats them differently:
* ``docker kill`` is a manual stop for Docker's restart manager: no restart policy (``on-failure``,
  ``always``, ``unless-stopped``) restarts the container (moby's ``killWithSignal`` marks it
  ``HasBeenManuallyStopped``; tried on this engine).  The survivors reclaim its pending requests
  (``XAUTOCLAIM`` after ``rollout.claim_idle_s``) and compose brings it back:
  ``docker-compose start rollout``.
* A worker that dies by itself (SIGKILL from the host: the OOM killer, a crash) exits 137, and
  ``restart: on-failure`` restarts it with no one's help.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from rolloutpipe.broker.keys import Keys
from rolloutpipe.config import load_config
from tests.support.config import ROOT, ci
from tests.support.helpers import audit_group_log, version

COMPOSE = ROOT / "docker-compose.yml"
BASE = "rolloutpipe-base:bookworm"  # scripts/docker-base.sh's default
RUN = "dockerdemo"
STEPS = 150  # 0.5-1 s a step on 2 cores: the two kills and restarts are over by step ~80
ROLES = ("cpu-trainer", "cpu-aggregator", "rollout", "cpu-controller")


def sh(
    *args: str, timeout: float = 60, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def log(msg: str) -> None:
    print(f"[compose-docker {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------ defaults


def test_build_defaults_stay_public() -> None:
    """Without any RP_ variable the images build as before, from public sources: the compose file's
    build-arg defaults are the Dockerfile's own, and Redis is redis:7.2."""
    doc = yaml.safe_load(COMPOSE.read_text())
    args = doc["x-cpu-image"]["build"]["args"]
    defaults = {k: re.fullmatch(r"\$\{RP_\w+:-(.*)\}", v).group(1) for k, v in args.items()}  # type: ignore[union-attr]
    assert defaults == {
        "BASE_IMAGE": "python:3.11-slim",
        "TORCH_SOURCE": "https://download.pytorch.org/whl/cpu",
    }
    dockerfile = (ROOT / "docker" / "Dockerfile.cpu").read_text()
    for k, v in defaults.items():
        assert f"ARG {k}={v}\n" in dockerfile
    assert doc["services"]["redis"]["image"] == "${RP_REDIS_IMAGE:-redis:7.2}"


# ------------------------------------------------------------------------------------------ engine


def _engine_up() -> bool:
    try:
        return sh("docker", "info", timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@pytest.fixture(scope="module")
def docker_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int | None]:
    """The running engine (None), else a ``dockerd`` started here (its PID), stopped by that PID."""
    why = ""
    proc: subprocess.Popen[bytes] | None = None
    if shutil.which("docker") is None:
        why = "no `docker` CLI on PATH (Debian: apt-get install docker.io)"
    elif _engine_up():
        log("using the Docker engine that is running")
    elif shutil.which("dockerd") is None:
        why = "no Docker engine is running and there is no `dockerd` to start (apt-get install docker.io)"
    elif os.geteuid() != 0:
        why = "no Docker engine is running and starting `dockerd` needs root"
    else:
        logfile = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
        with logfile.open("wb") as f:
            proc = subprocess.Popen(["dockerd"], stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 90 and proc.poll() is None and not _engine_up():
            time.sleep(1)
        if proc.poll() is None and _engine_up():
            log(f"started dockerd, pid {proc.pid}, in {time.monotonic() - t0:.0f} s")
        else:
            _stop(proc)
            tail = logfile.read_text(errors="replace")[-1500:]
            why = f"`dockerd` did not start (exit {proc.returncode}); its log ends: {tail}"
            proc = None
    if why:
        msg = f"docker-compose.yml cannot run in containers here: {why}"
        if ci():
            pytest.fail(msg + "  (CI must run it: .ci/run installs docker.io; dockerd needs root)")
        pytest.skip(msg)
    try:
        yield None if proc is None else proc.pid
    finally:
        if proc is not None:
            _stop(proc)
            log(f"stopped dockerd pid {proc.pid}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)  # dockerd stops its containers and its containerd
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)


# ------------------------------------------------------------------------------------------ images


def _have_or_pull(image: str) -> bool:
    if sh("docker", "image", "inspect", image).returncode == 0:
        return True
    try:
        return sh("docker", "pull", "-q", image, timeout=300).returncode == 0
    except subprocess.TimeoutExpired:
        return False


@pytest.fixture(scope="module")
def compose_env(docker_engine: int | None) -> dict[str, str]:
    """The environment compose runs with: our run, fresh passwords, and where the images come from."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RP_")}
    env.update(RP_RUN=RUN, RP_STEPS=str(STEPS), COMPOSE_PROJECT_NAME=f"rptest{uuid.uuid4().hex[:8]}")
    for role in ("controller", "rollout", "aggregator", "trainer", "observer"):  # not the -dev defaults
        env[f"RP_REDIS_{role.upper()}_PASSWORD"] = f"{role}-{secrets.token_hex(6)}"
    redis_ok, python_ok = _have_or_pull("redis:7.2"), _have_or_pull("python:3.11-slim")
    if not (redis_ok and python_ok):
        t0 = time.monotonic()
        p = sh("bash", "scripts/docker-base.sh", BASE, timeout=900)
        assert p.returncode == 0, f"scripts/docker-base.sh failed: {p.stderr[-3000:]}"
        log(f"base image {BASE}: {p.stderr.strip()} ({time.monotonic() - t0:.0f} s)")
        if not redis_ok:
            env["RP_REDIS_IMAGE"] = BASE
        if not python_ok:
            env["RP_BASE_IMAGE"] = BASE
    # pip's own wheel source (find-links in pip's config), no index: the CPU wheel, if it has one
    wheels = ROOT / "docker" / "wheels"
    p = sh(sys.executable, "-m", "pip", "download", "-q", "--no-index", "--no-deps", "torch==2.13.0",
           "-d", str(wheels), timeout=300)  # fmt: skip
    if p.returncode == 0 and list(wheels.glob("torch-2.13.0*.whl")):
        env["RP_TORCH_SOURCE"] = "local"
    log(
        "images: "
        + ", ".join(
            f"{k}={env[k]}" for k in ("RP_REDIS_IMAGE", "RP_BASE_IMAGE", "RP_TORCH_SOURCE") if k in env
        )
    )
    return env


# ------------------------------------------------------------------------------------------ the run


class Compose:
    def __init__(self, env: dict[str, str], out: Path) -> None:
        self.env, self.out = env, out
        self.project = env["COMPOSE_PROJECT_NAME"]
        self.healthy_at: dict[str, float] = {}

    def __call__(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return sh(
            "docker-compose", "-f", str(COMPOSE), "--profile", "cpu", *args, timeout=timeout, env=self.env
        )

    def containers(self) -> dict[str, dict[str, Any]]:
        """``docker inspect`` of this project's containers, by service_N name."""
        ids = sh(
            "docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}"
        ).stdout.split()
        if not ids:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for c in json.loads(sh("docker", "inspect", *ids).stdout):
            labels = c["Config"]["Labels"]
            name = f"{labels['com.docker.compose.service']}_{labels['com.docker.compose.container-number']}"
            out[name] = c
            if c["State"].get("Health", {}).get("Status") == "healthy":
                self.healthy_at.setdefault(name, time.monotonic())
        return out

    def redis(self, user: str) -> redis.Redis:
        c = self.containers()["redis_1"]
        ip = next(iter(c["NetworkSettings"]["Networks"].values()))["IPAddress"]
        return redis.Redis(
            host=ip, port=6379, username=user, password=self.env[f"RP_REDIS_{user.upper()}_PASSWORD"]
        )

    def url(self, user: str) -> str:
        r = self.redis(user)
        kw = r.connection_pool.connection_kwargs
        return f"redis://{user}:{kw['password']}@{kw['host']}:6379/0"

    def logs(self) -> str:
        return self("logs", "--no-color", timeout=120).stdout


def _status_check(c: Compose, *extra: str) -> subprocess.CompletedProcess[str]:
    """``rolloutpipe status --check`` from this machine, outside every container, as ``observer``."""
    return sh(sys.executable, "-m", "rolloutpipe", "status", "--run", RUN, "--check", *extra,
              "--redis-url", c.url("observer"), timeout=60)  # fmt: skip


def _worker_id(container: dict[str, Any]) -> str:
    return f"{container['Config']['Hostname']}-1"  # the entrypoint is PID 1 (the healthcheck's id)


def _wait(what: str, cond: Any, c: Compose, timeout: float) -> None:
    t0 = time.monotonic()
    while not cond():
        bad = {n: x["State"]["ExitCode"] for n, x in c.containers().items()
               if x["State"]["Status"] == "exited" and x["State"]["ExitCode"] not in (0, 137)}  # fmt: skip
        assert not bad, f"while waiting for {what}: containers exited {bad}"
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.5)


def _kill_mid_step(c: Compose, name: str, how: str) -> tuple[str, int, float]:
    """Kill rollout replica ``name`` while it holds pending requests of a step in flight."""
    keys, obs = Keys(RUN), c.redis("observer")
    wid = _worker_id(c.containers()[name])

    def busy() -> int:
        info: Any = obs.xpending(keys.requests, "rollout")
        return next((int(x["pending"]) for x in info["consumers"] if x["name"].decode() == wid), 0)

    _wait(f"{name} ({wid}) holding requests", lambda: busy() > 0, c, 120)
    held, step = busy(), version(obs, RUN)
    if how == "docker kill":
        p = sh("docker", "kill", c.containers()[name]["Id"])
        assert p.returncode == 0, p.stderr
    else:  # its main process, from the host: what the OOM killer or a crash does
        os.kill(int(c.containers()[name]["State"]["Pid"]), signal.SIGKILL)
    t = time.time()
    log(f"{how}: {name} ({wid}) holding {held} pending requests, policy version {step}")
    return wid, step, t


def _back(c: Compose, wid: str, killed_at: float) -> bool:
    """The worker's heartbeat was written after its kill (so by the restarted process: the old one
    is dead, and its key lives on for up to three heartbeats), and ``status --check --worker`` says
    it is alive."""
    raw: Any = c.redis("observer").get(Keys(RUN).heartbeat(wid))
    if raw is None or json.loads(raw)["t"] <= killed_at:
        return False
    return _status_check(c, "--worker", wid).returncode == 0


def _audit(out: Path, cfg_steps: int) -> dict[str, Any]:
    """The chaos test's exactly-once audit, on the trainer's committed-group log."""
    cfg = load_config(ROOT / "configs/demo.yaml", [], environ={})
    B, G = cfg.controller.prompts_per_step, cfg.controller.group_size
    trained, result = audit_group_log(out, cfg_steps, B, G)
    log(f"audit: {json.dumps(result)}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(cfg_steps))
    return {**result, "trained": trained}


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_cpu_profile_in_containers_survives_killed_rollouts(
    compose_env: dict[str, str], tmp_path: Path
) -> None:
    c = Compose(compose_env, tmp_path)
    times: dict[str, float] = {}
    try:
        t0 = time.monotonic()
        p = c("build", timeout=1200)
        assert p.returncode == 0, f"docker-compose build failed: {p.stdout[-3000:]}{p.stderr[-3000:]}"
        times["build_s"] = time.monotonic() - t0

        t0 = time.monotonic()
        p = c("up", "-d", "--scale", "rollout=3", timeout=600)  # waits for depends_on: service_healthy
        assert p.returncode == 0, f"docker-compose up failed: {p.stderr[-3000:]}"
        names = {"redis_1", "cpu-trainer_1", "cpu-aggregator_1", "rollout_1", "rollout_2", "rollout_3",
                 "cpu-controller_1"}  # fmt: skip
        assert set(c.containers()) == names
        _wait("every service healthy", lambda: c.containers() and names <= set(c.healthy_at), c, 300)
        times["up_to_healthy_s"] = time.monotonic() - t0
        obs = c.redis("observer")
        assert 0 <= version(obs, RUN) < STEPS - 20, "the run got too far before every service was healthy"

        # the run's health from outside the containers, as the read-only observer
        st = _status_check(c)
        assert st.returncode == 0, st.stdout + st.stderr
        with pytest.raises(redis.exceptions.NoPermissionError):
            obs.xadd(Keys(RUN).samples, {"d": b"x"})
        log(f"status --check from the host as observer: ok; version {version(obs, RUN)}")

        # 1) `docker kill` mid-step: Docker leaves it stopped; the survivors reclaim; compose restarts it
        t_kill = time.monotonic()
        wid1, v1, t1 = _kill_mid_step(c, "rollout_1", "docker kill")
        time.sleep(8)  # > rollout.claim_idle_s (5 s): the other replicas take its requests over
        x = c.containers()["rollout_1"]
        st1 = x["State"]
        log(f"after docker kill: {st1['Status']}, exit {st1['ExitCode']}, restarts {x['RestartCount']}")
        assert x["State"]["ExitCode"] == 137
        p = c("start", "rollout")
        assert p.returncode == 0, p.stderr
        _wait("rollout_1 running again", lambda: c.containers()["rollout_1"]["State"]["Running"], c, 60)
        _wait(f"{wid1}'s heartbeat back", lambda: _back(c, wid1, t1), c, 120)
        times["docker_kill_to_heartbeat_s"] = time.monotonic() - t_kill

        # 2) the worker's process dies by itself (host SIGKILL): restart: on-failure brings it back
        t_kill = time.monotonic()
        wid2, v2, t2 = _kill_mid_step(c, "rollout_2", "SIGKILL of its main process from the host")
        _wait("rollout_2 restarted by its restart policy",
              lambda: c.containers()["rollout_2"]["RestartCount"] >= 1, c, 60)  # fmt: skip
        _wait(f"{wid2}'s heartbeat back", lambda: _back(c, wid2, t2), c, 120)
        times["sigkill_to_heartbeat_s"] = time.monotonic() - t_kill
        v_back = version(obs, RUN)
        log(f"both killed workers heartbeat again at policy version {v_back} of {STEPS}")
        assert v_back < STEPS - 1, "the run ended before the restarted workers could rejoin it"

        # the run ends by itself: every role exits 0
        t0 = time.monotonic()
        roles = names - {"redis_1"}
        _wait(
            "every role exited",
            lambda: all(c.containers()[n]["State"]["Status"] == "exited" for n in roles),
            c,
            900,
        )
        times["rest_of_run_s"] = time.monotonic() - t0
        codes = {n: c.containers()[n]["State"]["ExitCode"] for n in roles}
        assert set(codes.values()) == {0}, codes
        assert version(obs, RUN) == STEPS
        logs = c.logs()
        for bad in ("NoPermissionError", "Traceback"):
            at = logs.find(bad)
            assert at < 0, logs[max(0, at - 1500) : at + 500]

        # the committed-group log, out of the runs volume
        trainer = c.containers()["cpu-trainer_1"]["Id"]
        p = sh("docker", "cp", f"{trainer}:/app/runs/{RUN}", str(tmp_path / "out"))
        assert p.returncode == 0, p.stderr
        audit = _audit(tmp_path / "out", STEPS)
        by_worker: dict[str, set[int]] = {}
        for g in audit["trained"]:
            for s in g.samples:
                by_worker.setdefault(s.worker, set()).add(g.step)
        assert len(by_worker) == 3, sorted(by_worker)
        for wid, v in ((wid1, v1), (wid2, v2)):  # each killed worker generated again after its restart
            assert max(by_worker[wid]) > v, (wid, v, max(by_worker[wid]))
        log(f"killed at versions {v1} and {v2}; both workers generated again up to steps "
            f"{max(by_worker[wid1])} and {max(by_worker[wid2])}; times: "
            + json.dumps({k: round(v, 1) for k, v in times.items()}))  # fmt: skip
    except BaseException:
        (tmp_path / "compose.log").write_text(c.logs())
        log(f"compose logs: {tmp_path / 'compose.log'}")
        raise
    finally:
        c("down", "-v", "--remove-orphans", timeout=300)  # the images stay: Docker's layer cache
