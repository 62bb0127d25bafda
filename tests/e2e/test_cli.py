"""The CLI contract: `run` writes metrics.jsonl with every field, `bench` compares the three modes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.config import EMULATED_FAST, ROOT

METRIC_FIELDS = {
    "step", "mode", "rollout_to_train_end_s", "trainer_wait_ratio", "first_group_s", "reward_mean",
    "groups", "samples", "fence_rejections", "dead_letters",
}  # fmt: skip


def _run_past_step_2(out: Path, **popen: Any) -> subprocess.Popen[str]:
    """A long ``rolloutpipe run`` into ``out``, returned once two steps are in its metrics.jsonl."""
    import time

    p = subprocess.Popen(
        [sys.executable, "-m", "rolloutpipe", "run", "configs/demo.yaml", "--steps", "500", "--out", str(out),
         "--no-progress", *EMULATED_FAST],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen,
    )  # fmt: skip
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        assert p.poll() is None and time.monotonic() < deadline, "the run did not reach step 2"
        time.sleep(0.2)
    return p


def _rp(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rolloutpipe", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_run_demo_config_writes_metrics(tmp_path: Path, model_cache: str) -> None:
    """The demo's own command line, shortened: real model, every role a process, embedded Redis."""
    out = tmp_path / "demo"
    p = _rp("run", "configs/demo.yaml", "--steps", "3", "--out", str(out), "--no-progress",
            f"model.cache_dir={model_cache}")  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r.keys() >= METRIC_FIELDS
        assert r["mode"] == "cgp-fgd"
        assert r["groups"] == 16 and r["samples"] == 256
        assert 0.0 <= r["trainer_wait_ratio"] <= 1.0 and 0.0 <= r["reward_mean"] <= 1.0
        assert 0.0 < r["first_group_s"] <= r["rollout_to_train_end_s"]
    assert (out / "report.json").exists() and (out / "report.png").stat().st_size > 1000
    page = (out / "report.html").read_text()  # the demo records its timeline: both pictures embedded
    assert page.count("data:image/png;base64,") == 2 and (out / "report-timeline.png").exists()
    assert "| step |" in p.stdout  # the summary table


@pytest.mark.slow
def test_make_demo_command_line_scores_held_out(tmp_path: Path, model_cache: str) -> None:
    """``make demo``'s command line (``configs/digits.yaml``), shortened: multi-token answers, the
    warm-started base model, and held-out scores in metrics.jsonl, report.json and the table."""
    out = tmp_path / "digits"
    p = _rp("run", "configs/digits.yaml", "--steps", "4", "--out", str(out), "--no-progress",
            f"model.cache_dir={model_cache}", "eval.every=2", "eval.num_prompts=32")  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r["eval_reward"] is not None for r in rows] == [False, True, False, True]
    assert all(r["groups"] == 16 and r["samples"] == 256 for r in rows)
    rep = json.loads((out / "report.json").read_text())
    assert [s for s, _ in rep["eval_reward"]] == [1, 3]
    assert [v for _, v in rep["eval_reward"]] == [rows[1]["eval_reward"], rows[3]["eval_reward"]]
    assert "| step | reward_mean | eval_reward |" in p.stdout
    assert (out / "report.png").stat().st_size > 1000


def test_bench_compares_the_modes_and_the_control(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    p = _rp("bench", "--out", str(out), "--steps", "3", "--no-progress", *EMULATED_FAST)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((out / "results.json").read_text())
    (setting,) = res["settings"]
    modes = ("sync", "cgp", "cgp-late", "cgp-fgd")
    assert tuple(setting["modes"]) == modes
    assert setting["steps"] == [1, 2]  # step 0 is the warm-up
    assert 0 < setting["bound_s"] < setting["modes"]["sync"]["rollout_to_train_end_s"]
    for m in setting["modes"].values():
        assert m["rollout_to_train_end_s"] > 0 and 0 <= m["trainer_wait_ratio"] <= 1
        assert m["bound_violations"] == 0
        mean, lo, hi = m["reduction_vs_sync"]
        assert lo <= mean <= hi
    for mode in modes:
        assert f"| {mode} |" in p.stdout
    assert "true bound" in p.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "configs/nope.yaml"], "does not exist"),
        (["run", "configs/demo.yaml", "controller.bogus=1"], "controller.bogus"),
        (["run", "configs/demo.yaml", "controller.minibatches=3"], "multiple of"),
        (["run", "configs/demo.yaml", "controller.mode=async"], "controller.mode"),
    ],
)
def test_bad_config_is_a_clear_error(args: list[str], message: str) -> None:
    p = _rp(*args, timeout=60)
    assert p.returncode == 2
    assert message in p.stderr
    assert "Traceback" not in p.stderr


def test_sigterm_stops_everything_run_started(tmp_path: Path) -> None:
    """``kill`` of ``rolloutpipe run`` (a CI timeout, a scheduler) unwinds like Ctrl-C: every role
    process and the private redis-server it started are stopped, none is left running."""
    import re
    import signal
    import socket

    out = tmp_path / "term"
    p = _run_past_step_2(out)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err[-2000:]
    roles = subprocess.run(["pgrep", "-f", str(out / "config.yaml")], capture_output=True, text=True)
    assert roles.stdout.strip() == "", f"role processes left running: {roles.stdout}"
    port = int(re.search(r"embedded redis-server on 127\.0\.0\.1:(\d+)", err).group(1))  # type: ignore[union-attr]
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "controller.steps (--steps) must be at least 1, not 0"),
        (["trainer.log_to=[wandb]"], "trainer.log_to has 'wandb' but wandb is not installed"),
        (["--redis-url", "redis://127.0.0.1:1/0"], "cannot reach Redis at redis://127.0.0.1:1/0"),
    ],
)
def test_what_would_fail_after_the_roles_start_is_refused_before(
    tmp_path: Path, args: list[str], message: str
) -> None:
    """``--steps 0`` started every role and named a metrics file never written; a missing logger
    failed only once every role was up; an unreachable Redis gave a minute of retries and a long
    traceback.  Each is now one line, and nothing is started or written."""
    import importlib.util

    if "wandb" in " ".join(args):
        assert importlib.util.find_spec("wandb") is None  # the core venv has no wandb
    out = tmp_path / "out"
    p = _rp("run", "configs/demo.yaml", "--out", str(out), "--no-progress", *args, *EMULATED_FAST, timeout=60)
    assert p.returncode == 2, p.stderr[-3000:]
    assert message in p.stderr and "Traceback" not in p.stderr
    assert not out.exists()


def test_a_wrong_password_is_refused_before_anything_starts(tmp_path: Path, redis_url: str) -> None:
    url = redis_url.replace("redis://", "redis://nobody:secret@")
    out = tmp_path / "out"
    p = _rp("run", "configs/demo.yaml", "--out", str(out), "--redis-url", url, "--no-progress",
            *EMULATED_FAST, timeout=60)  # fmt: skip
    assert p.returncode == 2, p.stderr[-3000:]
    assert "refused" in p.stderr and "secret" not in p.stderr and "***" in p.stderr
    assert "Traceback" not in p.stderr and not out.exists()


def test_a_group_of_one_is_warned_about(tmp_path: Path) -> None:
    p = _rp("run", "configs/demo.yaml", "--steps", "1", "--out", str(tmp_path / "g1"), "--no-progress",
            *EMULATED_FAST, "controller.group_size=1", timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert "controller.group_size=1: a group of one sample has a group-relative advantage of 0" in p.stderr


def test_ctrl_c_in_a_terminal_stops_the_run_without_restarting_redis(tmp_path: Path) -> None:
    """Ctrl-C reaches the terminal's whole foreground process group.  The private redis-server was
    in it, exited 0 at once, and the Supervisor logged an ERROR and restarted it while the run was
    unwinding.  It now has a session of its own; the run stops it."""
    import os
    import signal

    out = tmp_path / "ctrlc"
    p = _run_past_step_2(out, start_new_session=True)
    os.killpg(p.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err[-2000:]
    assert "restarting it from its AOF" not in err and "ERROR" not in err, err[-2000:]
    assert json.loads((out / "run.json").read_text())["status"] == "aborted"


def test_print_config_shows_the_resolved_config_and_starts_nothing(tmp_path: Path) -> None:
    import yaml

    out = tmp_path / "never"
    p = _rp("run", "configs/demo.yaml", "--print-config", "--steps", "7", "--out", str(out),
            "trainer.clip_ratio_high=0.28", timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    cfg = yaml.safe_load(p.stdout)
    assert cfg["controller"]["steps"] == 7 and cfg["trainer"]["clip_high"] == 0.28 and cfg["out"] == str(out)
    assert not out.exists()


def test_each_subcommands_help_describes_its_own_options() -> None:
    """``controller --help`` described ``--out`` as the trainer's, and ``run``'s options had none."""
    import argparse

    from rolloutpipe.cli import _parser

    subs = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    bare = [a.dest for a in subs["run"]._actions if not a.help and a.dest != "overrides"]
    assert bare == [], f"run options without help: {bare}"
    out_help = {role: next(a.help for a in subs[role]._actions if a.dest == "out") for role in ROLE_NAMES}
    assert "metrics.jsonl" in str(out_help.pop("trainer"))
    assert all("not used by this role" in str(h) for h in out_help.values()), out_help


ROLE_NAMES = ("controller", "rollout", "aggregator", "trainer")
