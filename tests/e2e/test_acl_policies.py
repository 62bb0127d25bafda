"""Every allocation policy runs under ``rolloutpipe run``'s per-role Redis users (``broker/acl.py``).

The other policy tests connect as the admin, so a key a role touches but its ACL user may not
(``prompt_cursor``, ``step_rollouts``) fails only here: the role exits with ``NoPermissionError``.
``--max-restarts 0`` makes that exit end the run with an error instead of a restart loop.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.config import EMULATED_FAST, ROOT

pytestmark = pytest.mark.slow


def run_under_role_users(out: Path, *overrides: str) -> list[dict[str, object]]:
    """``rolloutpipe run`` of 3 steps, each role as its ACL user, no restarts: its metrics rows."""
    p = subprocess.run(
        [sys.executable, "-m", "rolloutpipe", "run", "configs/demo.yaml", "--steps", "3", "--out", str(out),
         "--no-progress", "--max-restarts", "0", "controller.prompts_per_step=8", "controller.group_size=8",
         "controller.minibatches=2", *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    logs = "\n".join(f.read_text()[-1500:] for f in sorted((out / "logs").glob("*.log")))
    assert p.returncode == 0, p.stderr[-2000:] + logs
    assert "NoPermissionError" not in logs
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    return rows


@pytest.mark.parametrize("policy", ["dynamic-sampling", "pilot-commit", "vigor"])
def test_a_policy_that_draws_from_the_dataset_stream_runs_under_the_role_users(
    tmp_path: Path, policy: str
) -> None:
    run_under_role_users(tmp_path / policy, *EMULATED_FAST, f"controller.policy={policy}",
                         "controller.max_rollouts=100000")  # fmt: skip


def test_episodes_record_their_tool_calls_under_the_role_users(tmp_path: Path) -> None:
    """A worker records each call of an episode in ``toolcalls:{k}`` as the ``rollout`` user; the
    controller trims those keys with the other per-step keys."""
    tools = 'task.tools=["rolloutpipe.agents.tools:calculator"]'
    rows = run_under_role_users(tmp_path / "episodes", "rollout.max_new_tokens=12", "task.tool_format=arith",
                                tools, "redis.keep_steps=1")  # fmt: skip
    assert sum(int(str(r["tool_calls"])) for r in rows) > 0
