"""``rolloutpipe run`` as a user drives it: a reused ``--out`` is refused, resumed or overwritten,
never silently pruned or deleted; a role that dies is restarted and the run still trains every
step exactly once; an interrupted run is marked aborted (not done) and ``--resume`` finishes it
without losing the metrics of the steps it had."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.config import EMULATED_FAST, ROOT

STEPS = 6
# slower decoding than EMULATED_FAST, so a step lasts about a second and a kill lands mid-run
SLOW = (*EMULATED_FAST, "rollout.emulated.time_scale=0.05", "trainer.emulated.time_scale=0.05")
B, G = 8, 4  # EMULATED_FAST's prompts_per_step and group_size


def _cmd(out: Path, *extra: str, steps: int = STEPS) -> list[str]:
    return [sys.executable, "-m", "rolloutpipe", "run", "configs/demo.yaml", "--steps", str(steps),
            "--out", str(out), "--no-progress", *SLOW, *extra]  # fmt: skip


def _rp(out: Path, *extra: str, steps: int = STEPS, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _cmd(out, *extra, steps=steps), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def _rows(out: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _assert_every_step_once(out: Path, steps: int = STEPS) -> None:
    rows = _rows(out)
    assert [r["step"] for r in rows] == list(range(steps)), [r["step"] for r in rows]
    for r in rows:
        trained = sorted(g for mb in r["minibatches"] for g in mb)  # type: ignore[attr-defined]
        assert trained == sorted(f"{r['step']}:{i}" for i in range(B)), r["minibatches"]
        assert (r["groups"], r["samples"]) == (B, B * G)
        assert r["fence_rejections"] == 0 and r["dead_letters"] == 0, r
    assert json.loads((out / "run.json").read_text())["status"] == "finished"


def _wait_for_steps(p: subprocess.Popen[str], out: Path, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n") >= n):
        assert p.poll() is None, p.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"the run did not reach step {n}"
        time.sleep(0.1)


def _pid_of(out: Path, role: str) -> int:
    pattern = f"rolloutpipe {role} {out / 'config.yaml'}"
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    assert found, f"no process matches {pattern!r}"
    return int(found[0])


def test_a_reused_out_is_refused_then_resumed_or_overwritten_never_deleted(tmp_path: Path) -> None:
    """``make demo`` twice: the second run used to delete the first one's checkpoints and prune its
    own new weights, then hang.  Now the default refuses with a clear message and touches nothing,
    ``--resume`` of a finished run shows it again, and ``--overwrite`` trains afresh."""
    out = tmp_path / "demo"
    first = _rp(out, steps=3)
    assert first.returncode == 0, first.stderr[-3000:]
    before = (out / "metrics.jsonl").read_bytes()
    ckpts = sorted(p.name for p in (out / "checkpoints" / "demo").iterdir())

    again = _rp(out, steps=3, timeout=60)
    assert again.returncode == 2, again.stderr[-3000:]
    assert "already holds run 'demo' (finished, 3 of 3 steps" in again.stderr
    assert "--resume" in again.stderr and "--overwrite" in again.stderr and "Traceback" not in again.stderr
    assert "watch the run: rolloutpipe status --run demo --redis-url redis://observer:" in first.stderr
    assert (out / "metrics.jsonl").read_bytes() == before
    assert sorted(p.name for p in (out / "checkpoints" / "demo").iterdir()) == ckpts

    shown = _rp(out, "--resume", steps=3, timeout=60)
    assert shown.returncode == 0, shown.stderr[-3000:]
    assert "is finished; showing its results" in shown.stderr and "| step |" in shown.stdout
    assert (out / "metrics.jsonl").read_bytes() == before

    longer = _rp(out, "--resume", steps=5, timeout=60)
    assert longer.returncode == 2 and "not supported" in longer.stderr

    fresh = _rp(out, "--overwrite", steps=2)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert "--overwrite: deleted the earlier run 'demo'" in fresh.stderr
    _assert_every_step_once(out, steps=2)
    assert sorted(p.name for p in (out / "checkpoints" / "demo").iterdir())[-1] == "ckpt-000002"


@pytest.mark.parametrize("role", ["trainer", "aggregator", "rollout", "controller"])
def test_sigkill_of_any_one_role_is_survived(tmp_path: Path, role: str) -> None:
    """``rolloutpipe run`` used to end the whole run (and mark it done) when one role died."""
    out = tmp_path / "run"
    p = subprocess.Popen(_cmd(out), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_steps(p, out, 2)
        subprocess.run(["kill", "-9", str(_pid_of(out, role))], check=True)
        _, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            p.communicate(timeout=60)
    assert p.returncode == 0, err[-3000:]
    assert "exited with code -9" in err and "restarting it (1 of 3)" in err
    _assert_every_step_once(out)


def test_a_trainer_that_cannot_resume_ends_the_run_aborted_not_done(tmp_path: Path) -> None:
    """A dead DeepSpeed trainer is not restarted (it keeps no checkpoint, so it would redo the step
    from its initial weights): the run ends with its log's tail, marked aborted, never done."""
    # the core venv has no DeepSpeed (it has a venv of its own), so this trainer dies as it starts
    assert importlib.util.find_spec("deepspeed") is None
    out = tmp_path / "run"
    r = _rp(out, "--max-restarts", "1", "trainer.backend=deepspeed", timeout=180)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "restarting it" not in r.stderr
    assert (
        "role trainer exited with code 1; the DeepSpeed backend keeps no checkpoint, so it is not restarted"
        in r.stderr
    )
    assert json.loads((out / "run.json").read_text())["status"] == "aborted"


def test_an_interrupted_run_resumes_and_keeps_its_metrics(tmp_path: Path) -> None:
    out = tmp_path / "run"
    p = subprocess.Popen(_cmd(out), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_steps(p, out, 2)
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err[-3000:]
    state = json.loads((out / "run.json").read_text())
    assert state["status"] == "aborted" and state["version"] < STEPS
    kept = (out / "metrics.jsonl").read_bytes()
    assert kept.count(b"\n") >= 2

    resumed = _rp(out, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming the run 'demo' (aborted" in resumed.stderr
    _assert_every_step_once(out)
    assert (out / "metrics.jsonl").read_bytes().startswith(kept)  # the earlier steps' rows, unchanged


def test_an_acl_servers_aof_replays_transactions_and_still_refuses_strangers(tmp_path: Path) -> None:
    """``rolloutpipe run``'s private Redis (one user per role) restarted from its AOF: every MULTI
    of the run comes back (Redis 7.0 dropped them all with the default user off), and a client
    without a user and password is still refused."""
    import secrets

    import redis

    from rolloutpipe.broker import acl
    from rolloutpipe.broker.embedded import EmbeddedRedis

    pw = acl.random_passwords()
    args = acl.server_args(pw, admin_password=pw["admin"], sealed_default=secrets.token_hex(16))
    er = EmbeddedRedis(appendonly=True, dir=str(tmp_path), extra_args=args).start()
    try:
        admin = redis.Redis(port=er.port, username="admin", password=pw["admin"])
        tx = admin.pipeline(transaction=True)
        tx.set("rp:{t}:version", b"7").xadd("rp:{t}:control", {"d": b"x"})
        tx.execute()
        admin.close()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=er.port).ping()
        er.restart()
        admin = redis.Redis(port=er.port, username="admin", password=pw["admin"])
        assert admin.get("rp:{t}:version") == b"7" and admin.xlen("rp:{t}:control") == 1
        admin.close()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=er.port).ping()
    finally:
        er.stop()


def test_a_request_that_always_fails_is_dead_lettered_and_stops_the_run(
    tmp_path: Path, model_cache: str
) -> None:
    """A prompt with a character outside the tiny model's vocabulary failed every request with the
    same ValueError and was retried forever while the bar sat at 0.  Such a prompt is now refused
    when the prompts load, before any role starts.  An engine plug-in's prompts are not checked
    there, and a request that fails every time is dead-lettered after ``rollout.max_attempts``
    deliveries; ``run`` stops with the reason and the command to see them."""
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"W{i % 10}+1=", "label": (i + 1) % 10}) + "\n" for i in range(64))
    )
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "rolloutpipe", "run", "configs/demo.yaml", "--steps", "2", "--out", str(out),
           "--no-progress", f"model.cache_dir={model_cache}", "task.dataset=slime", f"task.path={data}",
           "rollout.claim_idle_s=0.5", "rollout.max_attempts=2"]  # fmt: skip
    refused = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "cannot be tokenized: character 'W' is not in the vocabulary" in refused.stderr
    assert not (out / "logs").exists()  # refused before any role started
    plugin = "rollout.engine_plugin=tests.support.plugin_engine:transformers"
    r = subprocess.run([*cmd, plugin], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "failed on all 2 attempts (rollout.max_attempts) and were dead-lettered" in r.stderr
    assert "ValueError: character 'W' is not in the vocabulary" in r.stderr
    assert "rolloutpipe dlq list --run demo --reason 'generation failed'" in r.stderr
    assert "Traceback" not in r.stderr.split("rolloutpipe: error:")[-1]
    assert json.loads((out / "run.json").read_text())["status"] == "aborted"


def test_a_verifier_that_always_fails_is_loud_and_can_stop_the_run(tmp_path: Path) -> None:
    """A reward function that raised trained on reward 0 and exited 0, with warnings only in
    ``logs/rollout-0.log``.  Failed scorings are now counted per step (metrics.jsonl, the table,
    report.json), warned about on the terminal, and ``task.verifier_failure_stop`` stops the run."""
    out = tmp_path / "run"
    r = _rp(out, "task.verifier=tests.support.byo_rewards:broken", steps=2, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (
        f"step 0: the verifier failed on {B * G} of {B * G} samples ({B * G} errors, 0 timeouts)" in r.stderr
    )
    assert all(row["verifier_errors"] == B * G for row in _rows(out))
    assert "| verifier_errors | verifier_timeouts |" in r.stdout
    assert f"verifier: {2 * B * G} errors and 0 timeouts over the run" in r.stdout
    assert json.loads((out / "report.json").read_text())["verifier_errors"] == 2 * B * G

    stopped = _rp(
        tmp_path / "stop", "task.verifier=tests.support.byo_rewards:broken", "task.verifier_failure_stop=0.9"
    )
    assert stopped.returncode == 2, stopped.stderr[-3000:]
    assert "each scored 0" in stopped.stderr and "stopping (task.verifier_failure_stop=0.9)" in stopped.stderr
    assert json.loads((tmp_path / "stop" / "run.json").read_text())["status"] == "aborted"
