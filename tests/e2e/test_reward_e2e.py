"""A run whose verifier hangs on some responses: each hung call is stopped by the timeout, scored 0,
counted in ``verifier_timeouts``, and the run trains every step.

The hang is math-verify's own (``tests/support/byo_rewards.py:tower_when_seven`` hands it a power tower for
the prompts whose answer is 7); the run's Redis is the test session's, so the counters can be read
after the run.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from rolloutpipe.broker.codec import iter_events
from rolloutpipe.broker.events import Group
from rolloutpipe.broker.keys import Keys
from rolloutpipe.model.tokenizer import CharTokenizer
from tests.support.config import ROOT

pytestmark = pytest.mark.slow
STEPS = 3


def test_a_run_goes_on_when_the_verifier_hangs(
    tmp_path: Path, model_cache: str, redis_url: str, sr: redis.Redis, run_name: str
) -> None:
    out = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, "-m", "rolloutpipe", "run", "configs/demo.yaml", "--steps", str(STEPS),
         "--out", str(out), "--no-progress", "--redis-url", redis_url, f"run={run_name}",
         f"model.cache_dir={model_cache}", "trainer.record_groups=true",
         "controller.prompts_per_step=8", "controller.group_size=4", "controller.minibatches=2",
         "task.verifier=tests.support.byo_rewards:tower_when_seven", "task.verifier_timeout_s=2"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    groups = [g for g in iter_events((out / "groups.msgpack").read_bytes()) if isinstance(g, Group)]
    assert len(groups) == STEPS * 8  # every step trained
    codec, sevens, right = CharTokenizer(), 0, 0
    for g in groups:
        for s in g.samples:
            prompt = codec.decode(s.prompt_ids)
            a, b = int(prompt[0]), int(prompt[2])
            answer = str((a + b) % 10)
            if answer == "7":
                sevens += 1
                assert s.reward == 0.0, prompt  # the hung call's score, whatever the response
            else:
                want = 1.0 if codec.decode(s.response_ids)[:1] == answer else 0.0
                assert s.reward == want, (prompt, s.reward)
                right += s.reward > 0
    assert sevens > 0, "no prompt with answer 7 was drawn: the test tested nothing"
    assert right > 0, "math-verify scored nothing right: the other responses were not scored"
    timeouts = int(sr.hget(Keys(run_name).stats, "verifier_timeouts") or 0)
    # every response to a 7-prompt hung once (a reclaimed request may be scored again, never fewer)
    assert timeouts >= sevens, (timeouts, sevens)
    assert int(sr.hget(Keys(run_name).stats, "verifier_errors") or 0) == 0
    logs = "".join(f.read_text() for f in (out / "logs").glob("rollout-*.log"))
    assert "verifier timeout on request" in logs
    # fewer than half the samples, yet each held its step up to 2 s: said on the terminal, per step
    said = re.findall(r"step (\d+): the verifier timed out on (\d+) of (\d+) samples", p.stderr)
    assert said and sum(int(n) for _, n, _ in said) == timeouts, (said, timeouts)
    assert all(2 * int(n) < int(of) for _, n, of in said) and "each scored 0" not in p.stderr
