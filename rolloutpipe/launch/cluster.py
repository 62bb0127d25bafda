"""``rolloutpipe run``: every role as a separate OS process against one Redis (embedded by default)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from rolloutpipe.broker import acl
from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.connect import connect_sync
from rolloutpipe.broker.embedded import EmbeddedRedis, Supervisor, find_redis_server, server_major_version
from rolloutpipe.broker.events import DeadLetter, PolicyVersion, StepMetrics
from rolloutpipe.broker.keys import Keys
from rolloutpipe.config import Config, TrainerConfig
from rolloutpipe.errors import CodecError, RequestFailedError, RoleError, VerifierFailedError
from rolloutpipe.launch.follow import ControlFollower

if TYPE_CHECKING:
    from rolloutpipe.roles.trainer.evaluate import EvalScore

log = logging.getLogger("rolloutpipe.run")


@dataclass
class RoleProc:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0


@dataclass
class Cluster:
    """The role processes of one run."""

    cfg: Config
    url: str
    out: Path
    procs: list[RoleProc] = field(default_factory=list)
    role_urls: dict[str, str] = field(default_factory=dict)  # per-role ACL users; else ``url``

    def spawn(
        self,
        role: str,
        name: str,
        extra: list[str] | None = None,
        *,
        devices: str = "",
        launcher: list[str] | None = None,
    ) -> RoleProc:
        logs = self.out / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        lp = logs / f"{name}.log"
        lf = lp.open("wb")
        cmd = [
            sys.executable,
            *(launcher or ["-m"]),
            "rolloutpipe",
            role,
            str(self.out / "config.yaml"),
            "--redis-url",
            self.role_urls.get(role, self.url),
            *(["--run", self.cfg.run] if role != "pool" and "--pool" not in (extra or []) else []),
            *(extra or []),
        ]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        env = {k: v for k, v in env.items() if not (k.startswith("RP_") and k != "RP_REDIS_SERVER")}
        if self.cfg.metrics.port > 0:  # one /metrics port a process: base port + spawn index
            cmd.append(f"metrics.port={self.cfg.metrics.port + len(self.procs)}")
        if devices:
            env["CUDA_VISIBLE_DEVICES"] = devices
        p = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        rp = RoleProc(name, p, lp, lf, cmd, env)
        self.procs.append(rp)
        return rp

    def respawn(self, rp: RoleProc) -> None:
        """Start a dead role again with the same command line; its log goes on in the same file.

        A role recovers its own state from Redis and ``--out`` (the trainer from its checkpoint, a
        worker's pending requests are reclaimed, the aggregator's and controller's keys are durable),
        so a new process with the same arguments carries on where the dead one stopped.
        """
        rp.log_file.close()
        rp.log_file = rp.log_path.open("ab")
        rp.log_file.write(f"\n--- rolloutpipe run: restarted after exit code {rp.proc.returncode}\n".encode())
        rp.log_file.flush()
        rp.proc = subprocess.Popen(
            rp.cmd, stdout=rp.log_file, stderr=subprocess.STDOUT, env=rp.env, start_new_session=True
        )
        rp.restarts += 1

    def start(self) -> None:
        self.cfg.dump_yaml(self.out / "config.yaml")
        tc, rc = self.cfg.trainer, self.cfg.rollout
        out = ["--out", str(self.out)]
        self.spawn("trainer", "trainer", out, devices=tc.devices, launcher=trainer_launcher(tc))
        shards = self.cfg.redis.sample_shards
        if shards == 1:
            self.spawn("aggregator", "aggregator")
        for i in range(shards if shards > 1 else 0):  # one aggregator a samples shard
            self.spawn("aggregator", f"aggregator-s{i}", ["--shard", str(i)])
        for i in range(rc.workers):
            devices = rc.devices[i % len(rc.devices)] if rc.devices else ""
            self.spawn("rollout", f"rollout-{i}", ["--worker-id", f"{self.cfg.run}-w{i}"], devices=devices)
        self.spawn("controller", "controller")

    def dead(self) -> list[RoleProc]:
        """The roles that exited with an error or a signal (a role ends with 0 once the run is done)."""
        return [rp for rp in self.procs if rp.proc.poll() not in (None, 0)]

    def failed(self) -> RoleProc | None:
        dead = self.dead()
        return dead[0] if dead else None

    def stop(self, grace: float = 10.0) -> None:
        for rp in self.procs:
            if rp.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    rp.proc.terminate()
        deadline = time.monotonic() + grace
        for rp in self.procs:
            try:
                rp.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rp.proc.kill()
                rp.proc.wait()
            rp.log_file.close()


def trainer_launcher(tc: TrainerConfig) -> list[str]:
    """``python -m torch.distributed.run … -m -- rolloutpipe trainer`` for the DeepSpeed backend.

    The ``--`` stops torchrun's parser from reading the trainer's ``--run`` as its ``--run-path``.
    """
    if tc.backend != "deepspeed":
        return ["-m"]
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tc.nproc}", "-m", "--"]


def tail(path: Path, n: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


WATCH = "watch the run: rolloutpipe status --run %s --redis-url %s --watch"
RUN_FILE = "run.json"  # OUT/run.json: which run this folder holds, and whether it finished
RESULTS = ("metrics.jsonl", "checkpoints", "weights", "timeline.jsonl")  # what an earlier run leaves


def previous_run(out: Path) -> dict[str, Any] | None:
    """What ``out`` holds of an earlier run: its ``run.json`` (run, steps, status), or
    ``{"status": "unknown"}`` for a folder with results but no ``run.json``; None when unused."""
    try:
        return dict(json.loads((out / RUN_FILE).read_text()))
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        return {"status": "unknown", "error": str(e)}
    if any((out / name).exists() for name in RESULTS):
        return {"status": "unknown"}
    return None


def steps_done(out: Path) -> list[StepMetrics]:
    """The trainer's durable record of the steps it committed (``metrics.jsonl``), one per step."""
    by_step: dict[int, StepMetrics] = {}
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
        if line.strip():
            m = StepMetrics.model_validate_json(line)
            by_step[m.step] = m
    return [by_step[k] for k in sorted(by_step)]


def clear_out(out: Path) -> None:
    """``--overwrite``: remove what an earlier run wrote in ``out`` (its results, logs, AOF)."""
    for name in (*RESULTS, RUN_FILE, "redis", "logs", "config.yaml", "groups.msgpack"):
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    for path in out.glob("report*"):
        path.unlink(missing_ok=True)


def _write_run_file(out: Path, cfg: Config, status: str, **extra: Any) -> None:
    rec = {"run": cfg.run, "steps": cfg.controller.steps, "status": status, "pid": os.getpid(), **extra}
    rec["at"] = time.time()
    tmp = out / f".{RUN_FILE}.tmp"
    tmp.write_text(json.dumps(rec))
    tmp.replace(out / RUN_FILE)


VERIFIER_WARN_SHARE = 0.5  # the share of a step's samples whose scoring failed that is warned about


def _check_verifier(m: StepMetrics, cfg: Config, out: Path) -> int:
    """Warn (or stop: ``task.verifier_failure_stop``) when a step's verifier mostly failed, and warn
    of any timeout (each one costs up to ``task.verifier_timeout_s``); returns the step's failed
    scorings.  A failed scoring is a reward of 0, so a step of mostly failures trains on noise."""
    failed = m.verifier_errors + m.verifier_timeouts
    share = failed / max(1, m.samples)
    if share >= VERIFIER_WARN_SHARE:
        what = (
            f"step {m.step}: the verifier failed on {failed} of {m.samples} samples ({m.verifier_errors} "
            f"errors, {m.verifier_timeouts} timeouts), each scored 0; see {out / 'logs'}/rollout-*.log"
        )
        stop = cfg.task.verifier_failure_stop
        if stop is not None and share >= stop:
            raise VerifierFailedError(f"{what}; stopping (task.verifier_failure_stop={stop})")
        log.warning("%s (task.verifier_failure_stop stops the run)", what)
    elif m.verifier_timeouts:  # fewer, but each one held its sample up to the timeout
        log.warning(
            "step %d: the verifier timed out on %d of %d samples (task.verifier_timeout_s=%g s each), "
            "scored 0; see %s/rollout-*.log",
            m.step, m.verifier_timeouts, m.samples, cfg.task.verifier_timeout_s, out / "logs",
        )  # fmt: skip
    return failed


def _check_failed_requests(r: Any, keys: Keys, cfg: Config) -> None:
    """Raise :class:`RequestFailedError` once a request has been dead-lettered after failing every
    attempt: its group can never be complete, so the step would wait forever."""
    n = int(r.hget(keys.stats, "failed_requests") or 0)
    if n == 0:
        return
    reason = ""
    for _id, fields in r.xrevrange(keys.dlq, count=200) or []:
        try:
            dl = DEFAULT_CODEC.decode_as(fields.get(b"d", b""), DeadLetter)
        except CodecError:
            continue
        if dl.reason.startswith("generation failed"):
            reason = f" The last: step {dl.step}: {dl.reason}."
            break
    raise RequestFailedError(
        f"{n} request(s) of run {cfg.run} failed on all {cfg.rollout.max_attempts} attempts "
        f"(rollout.max_attempts) and were dead-lettered, so the step cannot complete.{reason} "
        f"See them with: rolloutpipe dlq list --run {cfg.run} --reason 'generation failed'"
    )


def _await_trainer_exit(cluster: Cluster, max_restarts: int, timeout_s: float = 60.0) -> None:
    """Wait for the trainer to exit 0 after the last version, restarting it if it dies first.

    The exit code is read once per pass: a trainer that exits between two reads of ``poll()``
    (``None`` then ``0``) finished normally and must not be taken for a crash.
    """
    trainer = next((p for p in cluster.procs if p.name == "trainer"), None)
    wait_until, respawned = time.monotonic() + timeout_s, 0
    while trainer is not None:
        code = trainer.proc.poll()
        if code == 0:
            return
        if code is not None:
            if respawned >= max_restarts:
                raise RoleError(
                    f"the trainer exited with code {code} after the last version; "
                    f"last lines of {trainer.log_path}:\n" + tail(trainer.log_path)
                )
            respawned += 1
            cluster.respawn(trainer)
        if time.monotonic() > wait_until:
            log.warning("trainer still running %.0f s after the last version; stopping it", timeout_s)
            return
        time.sleep(0.1)


def run_cluster(
    cfg: Config,
    url: str,
    out: Path,
    *,
    progress: bool = True,
    timeout_s: float = 3600.0,
    role_urls: dict[str, str] | None = None,
    resume: bool = False,
    max_restarts: int = 0,
) -> list[StepMetrics]:
    """Start every role, follow the run until every step is trained, stop everything.

    The run is finished when the published policy version reaches ``controller.steps`` (version
    k+1 is published only once step k is committed).  ``resume`` keeps ``metrics.jsonl``: the roles
    carry on from Redis and the trainer's checkpoint.  A role that dies is started again, up to
    ``max_restarts`` times in a row without the run publishing a new version in between (0: a
    dead role ends the run with :class:`RoleError`).  Only a run that finished is marked done in
    Redis and in ``OUT/run.json``; an aborted one is marked ``aborted`` and can be resumed.
    Returns the trainer's metrics of every step, from ``metrics.jsonl``.
    """
    out.mkdir(parents=True, exist_ok=True)
    if not resume:
        (out / "metrics.jsonl").unlink(missing_ok=True)
    r = connect_sync(url)  # retries through a Redis restart, as the roles' clients do
    keys = Keys(cfg.run)
    cluster = Cluster(cfg, url, out, role_urls=dict(role_urls or {}))
    steps = cfg.controller.steps

    def version() -> int:
        raw: Any = r.get(keys.version)
        return -1 if raw is None else DEFAULT_CODEC.decode_as(raw, PolicyVersion).policy_version

    start_v = max(0, version())
    bar: Any = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=steps,
            initial=min(start_v, steps),
            desc=f"{cfg.run} [{cfg.mode}]",
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
        )
    follower = ControlFollower(r, [cfg.run])
    deadline = time.monotonic() + timeout_s
    seen: set[int] = set()
    held: dict[str, str] = {}
    vfail = 0  # failed scorings so far
    since_progress: dict[str, int] = {}  # deaths of each role since the version last moved
    last_v = start_v
    finished = False
    _write_run_file(out, cfg, "running")
    try:
        cluster.start()
        # the run ends at ``steps`` versions, or earlier when the controller marks it done (its
        # ``controller.max_rollouts`` was spent)
        while (v := version()) < steps and not (v > start_v and r.exists(keys.done)):
            if v > last_v:
                last_v = v
                since_progress.clear()
            for bad in cluster.dead():
                since_progress[bad.name] = since_progress.get(bad.name, 0) + 1
                no_ckpt = bad.name == "trainer" and cfg.trainer.backend == "deepspeed"
                if since_progress[bad.name] > max_restarts or no_ckpt:
                    why = f" {max_restarts} restart(s) in a row did not help;" if max_restarts else ""
                    if no_ckpt:  # it would resume the step from its initial weights
                        why = " the DeepSpeed backend keeps no checkpoint, so it is not restarted;"
                    raise RoleError(
                        f"role {bad.name} exited with code {bad.proc.returncode};{why} last lines of "
                        f"{bad.log_path}:\n" + tail(bad.log_path)
                    )
                n = since_progress[bad.name]
                log.warning("role %s exited with code %s at version %d; restarting it (%d of %d)",
                            bad.name, bad.proc.returncode, v, n, max_restarts)  # fmt: skip
                cluster.respawn(bad)
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {cfg.run} did not finish {steps} steps in {timeout_s:.0f}s")
            _check_failed_requests(r, keys, cfg)
            try:
                polled = follower.poll(block_ms=200)
            except CodecError as e:  # the controller dead-letters a bad control entry; read on
                log.warning("%s (skipped)", e)
                continue
            for _run, ev in polled:
                if ev.step >= start_v and ev.step not in seen:
                    seen.add(ev.step)
                    vfail += _check_verifier(ev, cfg, out)
                    if vfail:
                        held["verifier_failed"] = str(vfail)
                    if bar is not None:
                        if ev.eval_reward is not None:  # the latest held-out score stays shown
                            held = {"held_out": f"{ev.eval_reward:.3f}"}
                        bar.set_postfix(
                            reward=f"{ev.reward_mean:.2f}",
                            **held,
                            wait=f"{ev.trainer_wait_ratio:.2f}",
                            r2t=f"{ev.rollout_to_train_end_s:.2f}s",
                        )
                        bar.update(1)
        # The last version is out; the trainer still acknowledges the step's groups, then exits
        # once the controller marks the run done.  A trainer that dies here is restarted to finish.
        _await_trainer_exit(cluster, max_restarts)
        finished = True
    finally:
        if bar is not None:
            bar.close()
        if finished:
            r.set(keys.done, b"1")
        cluster.stop()
        status = "finished" if finished else "aborted"
        _write_run_file(out, cfg, status, version=max(last_v, version()) if finished else last_v)
        r.close()
    return steps_done(out)


SUMMARY_FIELDS = (
    "step",
    "reward_mean",
    "rollout_to_train_end_s",
    "trainer_wait_ratio",
    "first_group_s",
    "groups",
    "samples",
    "fence_rejections",
    "dead_letters",
    "verifier_errors",
    "verifier_timeouts",
)


def summary_table(metrics: list[StepMetrics], every: int = 1) -> str:
    """Every ``every``-th step and the last; with held-out scores (``eval:``), an ``eval_reward``
    column, and every scored step is shown; with tool calls (``task.tools``), ``tool_calls/sample``
    (the tool-use rate where an episode makes at most one call) and, with held-out scores, the
    eval episodes' tool-use rate."""
    evals = any(m.eval_reward is not None for m in metrics)
    tools = any(m.tool_calls for m in metrics)
    fields = list(SUMMARY_FIELDS[:2])
    fields += ["eval_reward"] if evals else []
    fields += ["tool_calls/sample"] if tools else []
    fields += ["eval_tool_rate"] if tools and evals else []
    fields += SUMMARY_FIELDS[2:]
    rows = [m for i, m in enumerate(metrics)
            if i % every == 0 or i == len(metrics) - 1 or m.eval_reward is not None]  # fmt: skip
    head = "| " + " | ".join(fields) + " |"
    sep = "|" + "|".join("---" for _ in fields) + "|"
    lines = [head, sep]
    for m in rows:
        d = m.model_dump()
        d["tool_calls/sample"] = m.tool_calls / m.samples if m.samples else None
        lines.append("| " + " | ".join(_fmt(d[f]) for f in fields) + " |")
    return "\n".join(lines)


def base_score(cfg: Config) -> EvalScore | None:
    """The base model's held-out score (version 0, before any step), scored as the trainer scores
    each version; None without ``eval.every``, or for a ``model.path`` checkpoint (which this
    process would have to load on its own device)."""
    if not cfg.eval.every or cfg.model.path:
        return None
    from rolloutpipe.model.lm import ensure_model, load_model
    from rolloutpipe.roles.trainer.evaluate import Evaluator

    return Evaluator(cfg).score(load_model(ensure_model(cfg.model), 1))


def held_out_line(base: EvalScore | None, metrics: list[StepMetrics]) -> str:
    """The base model's held-out score beside the last scored version's, with their intervals."""
    last = next((m for m in reversed(metrics) if m.eval_reward is not None), None)
    if base is None or last is None or last.eval_lo is None or last.eval_hi is None:
        return ""

    def tools(rate: float | None) -> str:
        return "" if rate is None else f", tool use {rate:.2f}"

    verdict = "the intervals overlap"
    if last.eval_lo > base.hi:
        verdict = "above the base's interval"
    elif last.eval_hi < base.lo:
        verdict = "below the base's interval"
    return (f"held-out reward (95% intervals over prompts): base {base.reward:.3f} [{base.lo:.3f}, "
            f"{base.hi:.3f}]{tools(base.tool_rate)} -> version {last.step + 1} {last.eval_reward:.3f} "
            f"[{last.eval_lo:.3f}, {last.eval_hi:.3f}]{tools(last.eval_tool_rate)}: {verdict}")  # fmt: skip


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def write_report(cfg: Config, metrics: list[StepMetrics], out: Path, base: EvalScore | None = None) -> Path:
    """``report.json`` plus a reward / timing picture (``report.png``); ``base``: the base model's
    held-out score (``base_score``)."""
    rep = {
        "run": cfg.run,
        "mode": cfg.mode,
        "steps": len(metrics),
        "reward_first": metrics[0].reward_mean if metrics else None,
        "reward_last": metrics[-1].reward_mean if metrics else None,
        "reward_best": max((m.reward_mean for m in metrics), default=None),
        "reward_first10_mean": _mean([m.reward_mean for m in metrics[:10]]),
        "reward_last10_mean": _mean([m.reward_mean for m in metrics[-10:]]),
        "first_step_reward_ge_0.6": next((m.step for m in metrics if m.reward_mean >= 0.6), None),
        "train_wall_s": (metrics[-1].train_end - metrics[0].step_start) if metrics else None,
        "median_rollout_to_train_end_s": _median([m.rollout_to_train_end_s for m in metrics]),
        "median_trainer_wait_ratio": _median([m.trainer_wait_ratio for m in metrics]),
        "fence_rejections": sum(m.fence_rejections for m in metrics),
        "dead_letters": sum(m.dead_letters for m in metrics),
        "samples": sum(m.samples for m in metrics),  # trained: the rollouts that counted
        "groups_skipped": sum(m.groups_skipped for m in metrics),
        "samples_wasted": sum(m.samples_wasted for m in metrics),
        "verifier_errors": sum(m.verifier_errors for m in metrics),
        "verifier_timeouts": sum(m.verifier_timeouts for m in metrics),
        # held-out reward (``eval:``): the step after which each version was scored, and its score
        "eval_reward": [[m.step, m.eval_reward] for m in metrics if m.eval_reward is not None],
        "eval_interval": [[m.step, m.eval_lo, m.eval_hi] for m in metrics if m.eval_reward is not None],
        "eval_base": None if base is None else dataclasses.asdict(base),
        # task.tools: the trained episodes' calls per sample, over the run and in its last 10 steps
        "tool_calls_per_sample": _rate(metrics),
        "tool_calls_per_sample_last10": _rate(metrics[-10:]),
        "eval_tool_rate": [[m.step, m.eval_tool_rate] for m in metrics if m.eval_tool_rate is not None],
    }
    (out / "report.json").write_text(json.dumps(rep, indent=2))
    if metrics:
        try:  # the same per-step picture as ``rolloutpipe report``: one unit per panel
            from rolloutpipe.tools.report import plot_steps

            plot_steps([m.model_dump(mode="json") for m in metrics], out, name="report.png")
        except ImportError:  # matplotlib is a dependency, but a picture is not worth a crash
            log.warning("matplotlib missing; report.png not written")
    return out / "report.json"


def _rate(metrics: list[StepMetrics]) -> float | None:
    samples = sum(m.samples for m in metrics)
    return sum(m.tool_calls for m in metrics) / samples if samples else None


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def run_embedded(
    cfg: Config,
    out: Path,
    url: str = "",
    progress: bool = True,
    *,
    resume: bool = False,
    max_restarts: int = 0,
) -> list[StepMetrics]:
    """Use ``url`` or start a private redis-server for the duration of the run.

    With ``redis.appendonly`` (the default) the private server keeps an AOF in ``OUT/redis``
    (``redis.appendfsync``), and is restarted from it if it dies during the run.  A new run starts
    it empty; ``resume`` replays it, so the run's streams, plans and versions come back.
    """
    kw: dict[str, Any] = {"progress": progress, "resume": resume, "max_restarts": max_restarts}
    if url:
        return run_cluster(cfg, url, out, **kw)
    rc = cfg.redis
    data = out / "redis"
    if rc.appendonly and not resume:
        shutil.rmtree(data, ignore_errors=True)  # a new run: never replay an older run's AOF
    extra: list[str] = []
    pw: dict[str, str] = {}
    if rc.acl:
        major = server_major_version(find_redis_server())
        if major >= 7:
            pw = acl.random_passwords()
            extra = acl.server_args(pw, admin_password=pw["admin"], sealed_default=secrets.token_hex(16))
        else:
            log.warning("redis-server %d has no per-key ACL selectors: running without role users", major)
    er = EmbeddedRedis(
        appendonly=rc.appendonly,
        appendfsync=rc.appendfsync,
        dir=str(data) if rc.appendonly else None,
        extra_args=extra,
    )
    with er, Supervisor(er) if rc.appendonly else contextlib.nullcontext():
        if not pw:
            log.info(WATCH, cfg.run, er.url)
            return run_cluster(cfg, er.url, out, **kw)
        urls = {role: acl.user_url(er.url, role, pw[role]) for role in acl.ROLES}
        log.info("Redis users per role; read-only access: --redis-url %s", urls["observer"])
        log.info(WATCH, cfg.run, urls["observer"])
        admin = acl.user_url(er.url, "admin", pw["admin"])
        return run_cluster(cfg, admin, out, role_urls=urls, **kw)
