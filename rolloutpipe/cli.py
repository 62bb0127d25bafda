"""Command line: ``rolloutpipe run|bench|controller|rollout|aggregator|trainer|pool|tail|status|report|dlq``.

Config is loaded (YAML, ``RP_…`` env, ``dotted.key=value`` overrides) before any event loop starts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path

from rolloutpipe.config import MODES, Config, load_config
from rolloutpipe.errors import ConfigError, RolloutPipeError
from rolloutpipe.runtime import run_async, setup_logging

log = logging.getLogger("rolloutpipe.cli")
ROLES = ("controller", "rollout", "aggregator", "trainer")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rolloutpipe", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)

    run = sub.add_parser("run", help="run every role as a separate process (embedded Redis by default)")
    run.add_argument("config", help="a YAML file under configs/ (configs/digits.yaml is make demo's)")
    run.add_argument("--mode", choices=MODES, help="a preset of controller.policy and trainer.schedule")
    run.add_argument("--steps", type=int, help="controller.steps: rollout steps to train (at least 1)")
    run.add_argument(
        "--out", help="the run's folder (default: the config's out): metrics, checkpoints, logs, AOF"
    )
    run.add_argument(
        "--redis-url",
        default="",
        help="use this Redis (or redis+cluster://), not a private redis-server",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    run.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (YAML) and exit; start nothing",
    )
    again = run.add_mutually_exclusive_group()
    again.add_argument(
        "--resume",
        action="store_true",
        help="continue the run that --out holds (a finished one is shown again); an empty --out starts one",
    )
    again.add_argument(
        "--overwrite", action="store_true", help="delete the earlier run that --out holds and train afresh"
    )
    run.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="N",
        help="restart a role that dies, up to N times in a row without progress (default 3; 0: stop the run)",
    )
    run.add_argument("overrides", nargs="*", help="dotted.key=value")

    bench = sub.add_parser("bench", help="sync vs cgp vs cgp-fgd on the emulated engine, side by side")
    bench.add_argument("config", nargs="?", default="")
    bench.add_argument("--out", default="runs/bench")
    bench.add_argument("--steps", type=int)
    bench.add_argument("--redis-url", default="")
    bench.add_argument(
        "--suite",
        default="",
        help="a suite under configs/bench/ (paper, paper-kv, allocation, broker, multiplex)",
    )
    bench.add_argument(
        "--quick",
        action="store_true",
        help="allocation: one seed, a few steps; broker: two small rows; multiplex: 2 runs, static vs "
        "lookahead, once (checks the path)",
    )
    bench.add_argument("--scale", type=float, help="wall seconds per emulated second (overrides the config)")
    bench.add_argument(
        "--only",
        default="",
        metavar="GLOBS",
        help="paper suites: run only the settings whose name matches one of these comma-separated globs; "
        "allocation suites: the regimes",
    )
    bench.add_argument(
        "--modes",
        default="",
        metavar="LIST",
        help="paper suites: run only these comma-separated modes (sync always; e.g. cgp-fgd,fgd-critical)",
    )
    bench.add_argument("--no-progress", action="store_true")
    bench.add_argument("overrides", nargs="*", help="dotted.key=value")

    for role in ROLES:
        rp = sub.add_parser(role, help=f"run the {role} role alone")
        rp.add_argument("config", help="the run's YAML config (rolloutpipe run writes it to OUT/config.yaml)")
        rp.add_argument("--redis-url", required=True, help="the run's Redis (every role of a run uses one)")
        rp.add_argument(
            "--run", required=role != "rollout", default="",
            help="the run's name: its keys are rp:{RUN}:…" + (" (or --pool)" if role == "rollout" else ""),
        )  # fmt: skip
        out_help = {
            "trainer": "where weights, checkpoints and metrics.jsonl go (default: the config's out)",
        }.get(role, "not used by this role (accepted so that every role takes one command line)")
        rp.add_argument("--out", help=out_help)
        if role == "rollout":
            rp.add_argument("--worker-id", default="", help="stable consumer name (default host-pid)")
            rp.add_argument(
                "--pool", default="", help="serve the runs of shared pool NAME, as its scheduler leases"
            )
            rp.add_argument("--engine", choices=["transformers", "emulated", "vllm"], help="rollout.engine")
        if role == "aggregator":
            rp.add_argument(
                "--shard", type=int, default=None,
                help="serve samples stream I of redis.sample_shards (default: every shard)",
            )  # fmt: skip
        if role == "trainer":
            rp.add_argument("--backend", choices=["torch", "emulated", "deepspeed"], help="trainer.backend")
        rp.add_argument("overrides", nargs="*", help="dotted.key=value")

    pool = sub.add_parser("pool", help="the scheduler of a rollout pool shared by several runs")
    pool.add_argument("config")
    pool.add_argument("--redis-url", required=True)
    pool.add_argument("--pool", required=True, help="the pool's name (its workers: rollout --pool NAME)")
    pool.add_argument("--runs", required=True, help="comma-separated runs to lease the pool's workers to")
    pool.add_argument(
        "--policy", choices=["greedy", "lookahead", "stagger", "static"], help="rollout.pool.policy"
    )
    pool.add_argument("overrides", nargs="*", help="dotted.key=value")

    report = sub.add_parser("report", help="timeline and per-step pictures plus one HTML page of a run")
    report.add_argument("dir", help="the run's --out directory (metrics.jsonl, timeline.jsonl)")

    from rolloutpipe.broker.keys import STREAMS
    from rolloutpipe.tools.view import stream_name

    url_help = "default: $RP_REDIS_URL or redis://127.0.0.1:6379/0"
    tail = sub.add_parser("tail", help="print a run's stream entries as JSON lines (read-only)")
    tail.add_argument(
        "stream", metavar="STREAM", type=stream_name,
        help=f"one of {', '.join(STREAMS)}, or samples:N (shard N of redis.sample_shards)",
    )  # fmt: skip
    tail.add_argument("--run", required=True)
    tail.add_argument("--redis-url", default="", help=url_help)
    tail.add_argument("-n", type=int, default=20, help="the last N matching entries (default 20; 0: none)")
    follow_help = "keep printing new entries until Ctrl-C (default: --no-follow)"
    tail.add_argument("--follow", action=argparse.BooleanOptionalAction, default=False, help=follow_help)
    tail.add_argument("--from-start", action="store_true", help="every entry from the first (ignores -n)")
    tail.add_argument("--group", help="only entries of this group_id")
    tail.add_argument("--policy-version", type=int, help="only entries of this policy version")
    tail.add_argument("--kind", help="only events of this kind (request, sample, group, …; error)")
    tail.add_argument("--pretty", action="store_true", help="one readable line per entry instead of JSON")

    status = sub.add_parser("status", help="stream lengths, lag, pending, workers, version, frontier")
    status.add_argument("--run", required=True)
    status.add_argument("--redis-url", default="", help=url_help)
    status.add_argument("--json", action="store_true", help="one JSON object per snapshot")
    status.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=2.0,
        metavar="SECONDS",
        help="refresh every SECONDS (default 2)",
    )
    status.add_argument(
        "--check", action="store_true", help="exit 0 ok, 1 no live worker or trainer stuck, 2 no Redis or run"
    )
    status.add_argument(
        "--worker", metavar="ID", help="--check only this rollout worker's heartbeat (healthchecks)"
    )
    status.add_argument(
        "--stuck-after",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="--check: the trainer is stuck when groups wait for it and no version came for this long",
    )

    dlq = sub.add_parser("dlq", help="list, show and replay a run's dead letters")
    dsub = dlq.add_subparsers(dest="dlq_cmd", required=True)
    dlist = dsub.add_parser("list", help="one line per dead letter, then counts by reason and source")
    dshow = dsub.add_parser("show", help="everything about one dead letter, its payload decoded")
    dshow.add_argument("id", metavar="ID", help="the dead letter's entry id in dlq (from dlq list)")
    dreplay = dsub.add_parser("replay", help="put dead letters' payloads back on their source streams")
    dreplay.add_argument("ids", metavar="ID", nargs="*", help="dead letter entry ids (or --all)")
    dreplay.add_argument("--all", action="store_true", help="every matching dead letter, oldest first")
    dreplay.add_argument("--dry-run", action="store_true", help="say what would be replayed; change nothing")
    dreplay.add_argument("--yes", action="store_true", help="--all: do not ask for confirmation")
    dreplay.add_argument(
        "--force",
        action="store_true",
        help="replay even what would be dead-lettered again (undecodable, stale) or was replayed",
    )
    for dp in (dlist, dshow, dreplay):
        dp.add_argument("--run", required=True)
        dp.add_argument("--redis-url", default="", help=url_help)
    for dp in (dlist, dreplay):
        dp.add_argument("--reason", help="only dead letters whose reason contains this (any case)")
        dp.add_argument("--source", help="only dead letters from this stream (samples, or its full key)")
    dlist.add_argument("-n", type=int, default=50, help="the last N matching dead letters (default 50)")
    dlist.add_argument("--json", action="store_true", help="one JSON object: dead letters and counts")
    return p


def _cfg(args: argparse.Namespace, extra: list[str]) -> Config:
    return load_config(args.config or None, [*args.overrides, *extra])


def check_task(cfg: Config) -> None:
    """Read the dataset (and its held-out split) once here, so that a bad file or field is one clear
    error before any role starts, not a role that dies; rows without an answer, and prompts the model
    cannot take (``task.max_prompt_length``), are reported here.
    The reward function is loaded and classified here too."""
    from rolloutpipe.model.lm import prompt_measure
    from rolloutpipe.tasks.datasets import task_prompts
    from rolloutpipe.tasks.reward import check_verifier

    check_verifier(cfg.task)
    measure = prompt_measure(cfg)
    task_prompts(cfg.task, cfg.task.num_prompts, cfg.task.seed, measure=measure)
    if cfg.eval.every:
        task_prompts(cfg.task, cfg.eval.num_prompts, cfg.eval.seed, split="eval", measure=measure)


def _preflight(cfg: Config, url: str) -> None:
    """What would fail only after every role has started, or train nothing, is refused here, before
    anything is started or written."""
    import importlib.util

    if cfg.controller.steps < 1:
        raise ConfigError(f"controller.steps (--steps) must be at least 1, not {cfg.controller.steps}")
    for kind in cfg.trainer.log_to:
        if importlib.util.find_spec(kind) is None:
            raise ConfigError(f"trainer.log_to has {kind!r} but {kind} is not installed: pip install {kind}")
    if cfg.controller.group_size == 1:
        log.warning(
            "controller.group_size=1: a group of one sample has a group-relative advantage of 0, so "
            "GRPO learns nothing from it (unless an allocation policy gives groups more samples)"
        )
    if url:
        from rolloutpipe.broker.connect import connect_sync
        from rolloutpipe.tools import view

        try:
            r = connect_sync(url, fail_fast=True)
            try:
                r.ping()
            finally:
                r.close()
        except (*view.REDIS_DOWN, view.REDIS_REFUSED) as e:
            raise ConfigError(f"{view.redis_failure(url, e)}; nothing was started") from e


def _reuse_out(cfg: Config, out: Path, args: argparse.Namespace) -> bool | None:
    """What to do with an ``--out`` that holds an earlier run: refuse (the default: nothing is
    touched), ``--overwrite`` it, or ``--resume`` it.  Returns whether the run resumes, or None
    for a finished run that ``--resume`` only shows again."""
    from rolloutpipe.launch.cluster import clear_out, previous_run, steps_done
    from rolloutpipe.model.weights import pid_alive

    prev = previous_run(out)
    if prev is None:
        return False
    done = steps_done(out)
    status = prev.get("status", "unknown")
    what = (f"run '{prev.get('run', '?')}' ({status}, {len(done)} of {prev.get('steps', '?')} steps in "
            f"{out / 'metrics.jsonl'})")  # fmt: skip
    pid = prev.get("pid")
    if status == "running" and isinstance(pid, int) and pid != os.getpid() and pid_alive(pid):
        raise ConfigError(f"{out} is in use: the {what} is still running (rolloutpipe run, pid {pid})")
    if args.overwrite:
        clear_out(out)
        log.warning("--overwrite: deleted the earlier %s", what)
        return False
    if not args.resume:
        raise ConfigError(
            f"{out} already holds {what}; nothing was changed. Add --resume to continue it (a finished "
            "run is shown again), --overwrite to delete it and train afresh, or give another --out"
        )
    if prev.get("run", cfg.run) != cfg.run:
        other = prev["run"]
        raise ConfigError(f"--resume: {out} holds run '{other}', not '{cfg.run}' (set run={other})")
    if status == "finished":
        if len(done) >= cfg.controller.steps:
            log.warning("%s: the %s is finished; showing its results (--overwrite trains afresh)", out, what)
            return None
        raise ConfigError(
            f"--resume: {out} holds a finished {what}; training it past its last step is not supported "
            f"(--steps {cfg.controller.steps}); --overwrite trains afresh"
        )
    aof = out / "redis"
    if not args.redis_url and not (cfg.redis.appendonly and aof.is_dir() and any(aof.iterdir())):
        raise ConfigError(
            f"--resume: {out} holds no Redis AOF ({aof}) to replay the {what} from "
            "(redis.appendonly was off, or it was deleted); --overwrite trains afresh"
        )
    log.warning("resuming the %s", what)
    return True


def cmd_run(args: argparse.Namespace) -> int:
    from rolloutpipe.launch.cluster import (
        base_score,
        held_out_line,
        run_embedded,
        steps_done,
        summary_table,
        write_report,
    )

    extra = []
    if args.mode:
        extra.append(f"controller.mode={args.mode}")
    if args.steps is not None:
        extra.append(f"controller.steps={args.steps}")
    if args.out:
        extra.append(f"out={args.out}")
    cfg = _cfg(args, extra)
    if args.print_config:
        print(cfg.to_yaml(), end="")
        return 0
    setup_logging(cfg.log_level, "run")
    out = Path(cfg.out)
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, not {args.max_restarts}")
    _preflight(cfg, args.redis_url)
    resume = _reuse_out(cfg, out, args)
    if resume is None:  # --resume of a finished run: show it again
        metrics = steps_done(out)
    else:
        check_task(cfg)
        if cfg.rollout.engine == "transformers" or cfg.trainer.backend == "torch":
            from rolloutpipe.model.lm import ensure_model

            log.info("model: %s", ensure_model(cfg.model))
        metrics = run_embedded(
            cfg,
            out,
            url=args.redis_url,
            progress=not args.no_progress,
            resume=resume,
            max_restarts=args.max_restarts,
        )
    base = base_score(cfg) if any(m.eval_reward is not None for m in metrics) else None
    write_report(cfg, metrics, out, base)
    print(summary_table(metrics, every=max(1, len(metrics) // 12)))
    if line := held_out_line(base, metrics):
        print(f"\n{line}")
    errors, timeouts = (sum(getattr(m, f) for m in metrics) for f in ("verifier_errors", "verifier_timeouts"))
    if errors or timeouts:
        print(f"\nverifier: {errors} errors and {timeouts} timeouts over the run, each scored 0 "
              f"(reasons in {out / 'logs'}/rollout-*.log)")  # fmt: skip
    print(f"\nmetrics: {out / 'metrics.jsonl'}   report: {out / 'report.json'}, {out / 'report.png'}")
    if metrics:
        from rolloutpipe.tools.report import write_html_report

        print(f"page: {write_html_report(out)['html']}  (rolloutpipe report {out} redraws it)")
    return 0


def _report(table: str, where: str) -> int:
    """A benchmark's table on stdout, where its files are on stderr."""
    print(table)
    print(f"\n{where}", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from rolloutpipe.bench.allocation import is_allocation_suite, run_allocation
    from rolloutpipe.bench.broker import is_broker_suite, run_broker
    from rolloutpipe.bench.paper import run_bench

    setup_logging("WARNING", "bench")
    other = args.suite and (
        is_broker_suite(args.suite) or args.suite == "multiplex" or is_allocation_suite(args.suite)
    )
    alloc = bool(args.suite) and is_allocation_suite(args.suite)
    if (args.modes and other) or (args.only and other and not alloc):
        raise ConfigError(
            "--only and --modes select settings and modes of a paper-style suite (--suite paper|paper-kv), "
            "and --only the regimes of an allocation suite, not " + args.suite
        )
    if args.suite and is_broker_suite(args.suite):
        if args.overrides or args.steps is not None or args.scale is not None or args.config:
            raise ConfigError(
                "--suite broker takes its settings from configs/bench/broker.yaml "
                "(or a copy given as --suite FILE), not overrides, --steps or --scale"
            )
        table, where = run_broker(
            args.suite, Path(args.out), url=args.redis_url, progress=not args.no_progress, quick=args.quick
        )
        return _report(table, where)
    if args.suite == "multiplex":
        from rolloutpipe.bench.multiplex import run_multiplex

        if args.config or args.scale is not None or args.steps is not None:
            raise ConfigError(
                "--suite multiplex takes its settings from configs/bench/multiplex.yaml and overrides"
            )
        table, where = run_multiplex(
            Path(args.out),
            args.overrides,
            url=args.redis_url,
            progress=not args.no_progress,
            quick=args.quick,
        )
        return _report(table, where)
    if args.suite and is_allocation_suite(args.suite):
        extra = [*args.overrides, *([f"controller.steps={args.steps}"] if args.steps is not None else [])]
        table, where = run_allocation(
            args.suite,
            Path(args.out),
            extra,
            url=args.redis_url,
            progress=not args.no_progress,
            quick=args.quick,
            only=args.only,
        )
        return _report(table, where)
    if args.quick:
        raise ConfigError("--quick is for the allocation and broker suites (--suite allocation|broker)")
    table, where = run_bench(
        args.config or None,
        Path(args.out),
        args.overrides,
        steps=args.steps,
        url=args.redis_url,
        progress=not args.no_progress,
        suite=args.suite,
        scale=args.scale,
        only=args.only,
        modes=args.modes,
    )
    return _report(table, where)


def cmd_pool(args: argparse.Namespace) -> int:
    runs = [r for r in args.runs.split(",") if r]
    extra = [f"rollout.pool.name={args.pool}", f"rollout.pool.runs={json.dumps(runs)}"]
    if args.policy:
        extra.append(f"rollout.pool.policy={args.policy}")
    cfg = _cfg(args, extra)
    setup_logging(cfg.log_level, "pool")
    from rolloutpipe.roles.pool import run_pool

    return run_async(lambda stop: run_pool(cfg, args.redis_url, stop))


def cmd_role(args: argparse.Namespace) -> int:
    pool = getattr(args, "pool", "")
    if args.cmd == "rollout" and not (args.run or pool):
        raise ConfigError("rollout: give --run RUN, or --pool NAME to serve a shared pool's runs")
    extra = [f"run={args.run}"] if args.run else []
    if pool:
        extra.append(f"rollout.pool.name={pool}")
    if getattr(args, "engine", None):
        extra.append(f"rollout.engine={args.engine}")
    if getattr(args, "backend", None):
        extra.append(f"trainer.backend={args.backend}")
    cfg = _cfg(args, extra)
    setup_logging(cfg.log_level, args.cmd)
    url = args.redis_url

    async def main(stop: asyncio.Event) -> int:
        if args.cmd == "controller":
            from rolloutpipe.roles.controller import run_controller

            return await run_controller(cfg, url, args.run, stop)
        if args.cmd == "rollout" and pool:
            from rolloutpipe.roles.pool import run_pool_worker

            return await run_pool_worker(cfg, url, stop, args.worker_id)
        if args.cmd == "rollout":
            from rolloutpipe.roles.rollout import run_rollout

            return await run_rollout(cfg, url, args.run, stop, args.worker_id)
        if args.cmd == "aggregator":
            from rolloutpipe.roles.aggregator import run_aggregator

            return await run_aggregator(cfg, url, args.run, stop, args.shard)
        from rolloutpipe.roles.trainer.trainer import run_trainer

        return await run_trainer(cfg, url, args.run, Path(args.out or cfg.out), stop)

    return run_async(main)


def cmd_report(args: argparse.Namespace) -> int:
    from rolloutpipe.tools.report import write_html_report

    written = write_html_report(Path(args.dir))
    for path in written.values():
        print(path)
    return 0


def cmd_tail(args: argparse.Namespace) -> int:
    from rolloutpipe.broker.connect import connect_sync
    from rolloutpipe.broker.keys import Keys
    from rolloutpipe.tools import tail as stream_tail
    from rolloutpipe.tools import view

    url = view.redis_url(args.redis_url)
    r = connect_sync(url, fail_fast=True)
    where = stream_tail.Filter(group=args.group, policy_version=args.policy_version, kind=args.kind)
    try:
        exists = view.stream_exists(r, args.run, args.stream)
        if not exists:
            print(f"rolloutpipe: note: run {args.run!r} has no {args.stream} stream (yet)", file=sys.stderr)
        done_key = Keys(args.run).done
        written = stream_tail.tail(
            r,
            args.run,
            args.stream,
            sys.stdout,
            n=args.n,
            from_start=args.from_start,
            follow=args.follow,
            where=where,
            pretty=args.pretty,
            stop=lambda: bool(r.exists(done_key)),  # --follow ends with the run
        )
        if args.follow:
            print(f"rolloutpipe: note: run {args.run!r} is done; nothing more will come", file=sys.stderr)
        elif exists and written == 0 and (args.n > 0 or args.from_start):
            held = int(r.xlen(view.stream_key(Keys(args.run), args.stream)) or 0)
            trimmed = "it holds none now (entries are trimmed once consumed: redis.trim); --follow waits"
            why = f"none of its {held} entries matches" if held else trimmed
            print(f"rolloutpipe: note: no {args.stream} entry printed: {why}", file=sys.stderr)
    except (*view.REDIS_DOWN, view.REDIS_REFUSED) as e:
        print(f"rolloutpipe: error: {view.redis_failure(url, e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # `| head`: the reader is gone; exit quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    finally:
        r.close()
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import json
    import time

    from rolloutpipe.broker.connect import connect_sync
    from rolloutpipe.tools import status, view

    url = view.redis_url(args.redis_url)
    r = connect_sync(url, fail_fast=True)
    try:
        while True:
            try:
                st = status.collect_status(r, args.run)
            except (*view.REDIS_DOWN, view.REDIS_REFUSED) as e:
                why = view.redis_failure(url, e)
                if args.check:
                    print(f"unhealthy: {why}")
                else:
                    print(f"rolloutpipe: error: {why}", file=sys.stderr)
                return 2
            if args.check and args.worker:
                code, why = status.worker_health(r, args.run, args.worker)
                print(why)
                return code
            if args.check:
                code, why = status.health(st, args.stuck_after)
                print(why)
                return code
            if args.json:
                print(json.dumps(st), flush=True)
            else:
                if args.watch and sys.stdout.isatty():
                    print("\x1b[2J\x1b[H", end="")  # clear the screen
                print(status.render_status(st) + ("\n" if args.watch else ""), flush=True)
            if not args.watch:
                return 0 if st["exists"] else 2
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    finally:
        r.close()


def cmd_dlq(args: argparse.Namespace) -> int:
    """``dlq list|show|replay``: 0 done, 1 some dead letter refused to replay, 2 bad input or no Redis."""
    import json

    from rolloutpipe.broker.connect import connect_sync
    from rolloutpipe.tools import dlq, view

    url = view.redis_url(args.redis_url)
    r = connect_sync(url, fail_fast=True)
    try:
        if args.dlq_cmd == "show":
            print(dlq.render_detail(dlq.detail(dlq.get(r, args.run, args.id))))
            return 0
        where = dlq.Where(reason=args.reason, source=args.source)
        if args.dlq_cmd == "list":
            lst = dlq.listing(r, args.run, args.n, where)
            print(json.dumps(dlq.listing_json(lst)) if args.json else dlq.render_listing(lst, args.run))
            return 0
        if bool(args.ids) == args.all:
            print("rolloutpipe: error: dlq replay takes dead letter IDs or --all (not both)", file=sys.stderr)
            return 2
        if args.ids:
            records = [dlq.get(r, args.run, i) for i in dict.fromkeys(args.ids)]
        else:
            records = [rec for rec in dlq.scan(r, args.run) if where(rec)]
            if not records:
                print(f"no matching dead letters in run {args.run!r}")
                return 0
            if not (args.yes or args.dry_run):
                question = f"replay {len(records)} dead letters of run {args.run!r}? [y/N] "
                if not sys.stdin.isatty():
                    print(
                        f"rolloutpipe: error: --all would replay {len(records)} dead letters; "
                        "pass --yes (or --dry-run to see them)",
                        file=sys.stderr,
                    )
                    return 2
                if input(question).strip().lower() not in ("y", "yes"):
                    return 1
        done = dlq.replay(r, args.run, records, force=args.force, dry_run=args.dry_run)
        for rp in done:
            print(dlq.describe(rp))
        refused = sum(1 for rp in done if rp.refused)
        verb = "would replay" if args.dry_run else "replayed"
        hint = " (--force would replay some)" if any(rp.forceable for rp in done if rp.refused) else ""
        print(f"{verb} {len(done) - refused}, refused {refused}{hint}")
        return 1 if refused else 0
    except (*view.REDIS_DOWN, view.REDIS_REFUSED) as e:
        print(f"rolloutpipe: error: {view.redis_failure(url, e)}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, EOFError):
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        r.close()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    # dotted overrides may come after options; argparse leaves those in ``unknown``
    bad = [u for u in unknown if u.startswith("-") or "=" not in u]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    args.overrides = [*getattr(args, "overrides", []), *unknown]
    if args.cmd == "bench" and "=" in args.config:  # `bench a.b=c`: no config, just overrides
        args.overrides.insert(0, args.config)
        args.config = ""
    try:
        if args.cmd in ("run", "bench"):
            # SIGTERM (kill, a CI timeout) unwinds like Ctrl-C, so the roles and the private Redis
            # that this process started are stopped by its ``finally`` blocks, not left running.
            signal.signal(signal.SIGTERM, _interrupt)
            return cmd_run(args) if args.cmd == "run" else cmd_bench(args)
        if args.cmd in ("tail", "status", "report", "dlq"):
            if args.overrides:
                parser.error(f"unrecognized arguments: {' '.join(args.overrides)}")
            ops_cmds = {"tail": cmd_tail, "status": cmd_status, "report": cmd_report, "dlq": cmd_dlq}
            return ops_cmds[args.cmd](args)
        if args.cmd == "pool":
            return cmd_pool(args)
        return cmd_role(args)
    except RolloutPipeError as e:
        print(f"rolloutpipe: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
