"""``rolloutpipe run``: every role as a separate OS process against one Redis (embedded by default)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rolloutpipe.broker import acl
from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.embedded import EmbeddedRedis, Supervisor, find_redis_server, server_major_version
from rolloutpipe.broker.events import StepMetrics
from rolloutpipe.broker.streams import Keys, connect_sync
from rolloutpipe.config import Config, TrainerConfig
from rolloutpipe.errors import CodecError, RoleError

log = logging.getLogger("rolloutpipe.run")


@dataclass
class RoleProc:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]


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
        rp = RoleProc(name, p, lp, lf)
        self.procs.append(rp)
        return rp

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

    def failed(self) -> RoleProc | None:
        for rp in self.procs:
            code = rp.proc.poll()
            if code is not None and code != 0:
                return rp
        return None

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


def run_cluster(
    cfg: Config,
    url: str,
    out: Path,
    *,
    progress: bool = True,
    timeout_s: float = 3600.0,
    role_urls: dict[str, str] | None = None,
) -> list[StepMetrics]:
    """Start every role, follow the trainer's step metrics on ``control``, stop everything."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    r = connect_sync(url)  # retries through a Redis restart, as the roles' clients do
    keys = Keys(cfg.run)
    cluster = Cluster(cfg, url, out, role_urls=dict(role_urls or {}))
    metrics: list[StepMetrics] = []
    bar: Any = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=cfg.controller.steps,
            desc=f"{cfg.run} [{cfg.mode}]",
            unit="step",
            file=sys.stderr,
            dynamic_ncols=True,
        )
    last_id = "0-0"
    deadline = time.monotonic() + timeout_s
    try:
        cluster.start()
        while len(metrics) < cfg.controller.steps:
            bad = cluster.failed()
            if bad is not None:
                raise RoleError(
                    f"role {bad.name} exited with code {bad.proc.returncode}; last lines of {bad.log_path}:\n"
                    + tail(bad.log_path)
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"run {cfg.run} did not finish {cfg.controller.steps} steps in {timeout_s:.0f}s"
                )
            resp: Any = r.xread({keys.control: last_id}, count=100, block=200)
            for _stream, items in resp or []:
                for eid, fields in items:
                    last_id = eid.decode()
                    try:
                        ev = DEFAULT_CODEC.decode(fields.get(b"d", b""))
                    except CodecError:
                        continue  # the controller dead-letters bad control entries

                    if isinstance(ev, StepMetrics):
                        metrics.append(ev)
                        if bar is not None:
                            held_out = [m.eval_reward for m in metrics if m.eval_reward is not None]
                            bar.set_postfix(
                                reward=f"{ev.reward_mean:.2f}",
                                **({"held_out": f"{held_out[-1]:.3f}"} if held_out else {}),
                                wait=f"{ev.trainer_wait_ratio:.2f}",
                                r2t=f"{ev.rollout_to_train_end_s:.2f}s",
                            )
                            bar.update(1)
        # The trainer sends a step's metrics just before publishing its weights; let it finish.
        trainer = next((p for p in cluster.procs if p.name == "trainer"), None)
        if trainer is not None:
            try:
                trainer.proc.wait(60)
            except subprocess.TimeoutExpired:
                log.warning("trainer still running 60 s after its last step; stopping it")
    finally:
        if bar is not None:
            bar.close()
        r.set(keys.done, b"1")
        cluster.stop()
        r.close()
    return metrics


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
)


def summary_table(metrics: list[StepMetrics], every: int = 1) -> str:
    """Every ``every``-th step and the last; with held-out scores (``eval:``), an ``eval_reward``
    column, and every scored step is shown."""
    evals = any(m.eval_reward is not None for m in metrics)
    fields = (*SUMMARY_FIELDS[:2], "eval_reward", *SUMMARY_FIELDS[2:]) if evals else SUMMARY_FIELDS
    rows = [m for i, m in enumerate(metrics)
            if i % every == 0 or i == len(metrics) - 1 or m.eval_reward is not None]  # fmt: skip
    head = "| " + " | ".join(fields) + " |"
    sep = "|" + "|".join("---" for _ in fields) + "|"
    lines = [head, sep]
    for m in rows:
        d = m.model_dump()
        lines.append("| " + " | ".join(_fmt(d[f]) for f in fields) + " |")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def write_report(cfg: Config, metrics: list[StepMetrics], out: Path) -> Path:
    """``report.json`` plus a reward / timing picture (``report.png``)."""
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
        # held-out reward (``eval:``): the step after which each version was scored, and its score
        "eval_reward": [[m.step, m.eval_reward] for m in metrics if m.eval_reward is not None],
    }
    (out / "report.json").write_text(json.dumps(rep, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
        xs = [m.step for m in metrics]
        ax[0].plot(xs, [m.reward_mean for m in metrics], marker=".", label="train (this step's rollouts)")
        scored = [(m.step, m.eval_reward) for m in metrics if m.eval_reward is not None]
        if scored:
            ax[0].plot([x for x, _ in scored], [y for _, y in scored], marker="o", color="tab:red",
                       label="held-out (eval split)")  # fmt: skip
            ax[0].legend(loc="lower right", fontsize="small")
        ax[0].set(title="mean reward", xlabel="step", ylim=(0, 1.05))
        ax[1].plot(xs, [m.rollout_to_train_end_s for m in metrics], label="rollout-to-train-end (s)")
        ax[1].plot(xs, [m.trainer_wait_ratio for m in metrics], label="trainer wait ratio")
        ax[1].set(title=f"timing ({cfg.mode})", xlabel="step")
        ax[1].legend()
        fig.tight_layout()
        fig.savefig(out / "report.png", dpi=100)
        plt.close(fig)
    except ImportError:  # matplotlib is a dependency, but a picture is not worth a crash
        log.warning("matplotlib missing; report.png not written")
    return out / "report.json"


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def run_embedded(cfg: Config, out: Path, url: str = "", progress: bool = True) -> list[StepMetrics]:
    """Use ``url`` or start a private redis-server for the duration of the run.

    With ``redis.appendonly`` (the default) the private server keeps an AOF in ``OUT/redis``
    (``redis.appendfsync``), started empty, and is restarted from it if it dies during the run.
    """
    if url:
        return run_cluster(cfg, url, out, progress=progress)
    rc = cfg.redis
    data = out / "redis"
    if rc.appendonly:
        shutil.rmtree(data, ignore_errors=True)  # a new run: never replay an older run's AOF
    extra: list[str] = []
    pw: dict[str, str] = {}
    if rc.acl:
        major = server_major_version(find_redis_server())
        if major >= 7:
            pw = acl.random_passwords()
            extra = acl.server_args(pw, admin_password=pw["admin"])
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
            return run_cluster(cfg, er.url, out, progress=progress)
        urls = {role: acl.user_url(er.url, role, pw[role]) for role in acl.ROLES}
        log.info("Redis users per role; read-only access: --redis-url %s", urls["observer"])
        admin = acl.user_url(er.url, "admin", pw["admin"])
        return run_cluster(cfg, admin, out, progress=progress, role_urls=urls)
