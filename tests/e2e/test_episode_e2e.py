"""Multi-turn episodes through real role processes: the tiny model, the calculator, the trainer;
and a rollout worker SIGKILLed while its episodes are in flight.

The untrained tiny model writes ``=`` about one token in eighteen, so with ``tool_format: arith``
its responses call the calculator often.  Read back from ``groups.msgpack`` (what the trainer
trained), independently of the worker's code: every tool run follows a ``=`` and holds the value
of the expression before it (or nothing, where the calculator refused it), with mask 0 and
logprob 0; every sample is from its step's weights; each group is trained once; and the step's
``tool_calls`` is the sum of its samples'; and the trainer's version-k logprobs match the
engine's on every model turn.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import redis

from rolloutpipe.agents.tools import evaluate
from rolloutpipe.broker.codec import DEFAULT_CODEC, iter_events
from rolloutpipe.broker.events import Group, RolloutRequest
from rolloutpipe.broker.keys import DATA, Keys
from rolloutpipe.launch.cluster import run_cluster
from rolloutpipe.model.tokenizer import CharTokenizer
from tests.support.cluster import Driver, assert_exactly_once, start_cluster, stop_cluster
from tests.support.config import make_config

pytestmark = pytest.mark.slow
STEPS = 2


def _expected(turn: str) -> str:
    """What the calculator answers to a model turn ending in ``=``, by the arith format's rule:
    the expression of digits and ``+-*`` before it, after the last space; "" where it refuses."""
    m = re.search(r"([0-9+\-*]+)=$", turn.rsplit(" ", 1)[-1])
    if not m:
        return ""
    try:
        v = evaluate(m.group(1))
    except Exception:
        return ""
    return v if v.lstrip("-").isdigit() else ""


def test_episodes_train_on_the_models_tokens_only(
    tmp_path: Path, run_name: str, redis_url: str, model_cache: str
) -> None:
    cfg = make_config(
        tmp_path, run_name, f"model.cache_dir={model_cache}", f"controller.steps={STEPS}",
        "controller.prompts_per_step=8", "controller.group_size=8", "controller.minibatches=2",
        "rollout.max_new_tokens=12", 'task.tools=["rolloutpipe.agents.tools:calculator"]',
        "task.tool_format=arith", "task.max_turns=3", "trainer.record_groups=true",
        "trainer.old_logprobs=recompute",
    )  # fmt: skip
    ms = run_cluster(cfg, redis_url, Path(cfg.out), progress=False, timeout_s=240)
    assert [m.step for m in ms] == list(range(STEPS))
    trained = [
        g for g in iter_events((Path(cfg.out) / "groups.msgpack").read_bytes()) if isinstance(g, Group)
    ]
    assert max(Counter((g.step, g.group_id) for g in trained).values()) == 1  # exactly once
    tok = CharTokenizer()
    eq = int(tok.encode_text("=")[0])
    calls = 0
    for g in trained:
        for s in g.samples:
            assert s.policy_version == g.step == s.step  # every turn: the step's weights
            r = [int(t) for t in s.response_ids]
            m = [1] * len(r) if not len(s.loss_mask) else [int(x) for x in s.loss_mask]
            assert len(m) == len(r) <= 12
            i = turn = 0
            while i < len(r):
                if m[i] == 0:  # a tool run: after the model's "=", the value, then the model again
                    j = i
                    while j < len(r) and m[j] == 0:
                        j += 1
                    assert r[i - 1] == eq, s.sample_id
                    text = tok.decode(np.asarray(r[turn:i]))
                    assert tok.decode(np.asarray(r[i:j])) == _expected(text)[: j - i], (s.sample_id, text)
                    assert all(s.logprobs[k] == 0.0 for k in range(i, j))
                    i = turn = j
                else:
                    i += 1
            calls += s.tool_calls
            assert s.tool_calls <= 2  # max_turns 3
            assert s.turns[0] == 0 if s.turns else True
    assert sum(m.tool_calls for m in ms) == calls > 0
    assert all(m.fence_rejections == 0 for m in ms)
    rows = [json.loads(x) for x in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert [r["tool_calls"] for r in rows] == [m.tool_calls for m in ms]
    # every model turn's logprobs are version k's: the trainer's frozen version-k copy gives the same
    # on the model's tokens (a tool token's 0 would be off by its whole logprob, were it not masked)
    assert all(r["train"]["logprob_mismatch"] < 1e-4 for r in rows), [r["train"] for r in rows]


def test_a_worker_killed_mid_episode_loses_nothing_and_repeats_nothing(
    tmp_path: Path,
    run_name: str,
    redis_url: str,
    model_cache: str,
    sr: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each call takes 1 s and marks a file while it runs; the worker is killed inside a call
    of step 1 or later, so mid-episode.  Its pending requests are redone by the survivor, each
    trained once, every step complete."""
    cfg = make_config(
        tmp_path, run_name, f"model.cache_dir={model_cache}", "controller.steps=4",
        "controller.prompts_per_step=8", "controller.group_size=8", "controller.minibatches=2",
        "rollout.max_new_tokens=12", 'task.tools=["tests.support.slow_tools:slow_calculator"]',
        "task.tool_format=arith", "task.max_turns=3", "redis.trim=false",
    )  # fmt: skip
    keys = Keys(run_name)
    victim, survivor = f"{run_name}-w0", f"{run_name}-w1"
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("SLOW_TOOL_MARKS", str(marks))
    cluster = start_cluster(cfg, redis_url)
    try:
        d = Driver(cluster, sr)
        proc = next(rp for rp in cluster.procs if rp.name == "rollout-0")

        def victim_in_a_call() -> bool:
            return sr.exists(keys.plan(1)) > 0 and any(marks.glob(f"{proc.proc.pid}-*"))

        d.until(victim_in_a_call, 90, f"{victim} inside a tool call in step 1 or later")
        d.kill(proc)
        assert any(marks.glob(f"{proc.proc.pid}-*"))  # killed before the call returned
        stranded = {
            DEFAULT_CODEC.decode_as(sr.xrange(keys.requests, p["message_id"], p["message_id"])[0][1][DATA],
                                    RolloutRequest).request_id
            for p in sr.xpending_range(keys.requests, "rollout", min="-", max="+", count=10_000,
                                       consumername=victim)
        }  # fmt: skip
        assert stranded, "the killed worker had nothing in flight"
        d.finish(120)
        groups = assert_exactly_once(sr, cfg, d.metrics)
        by_id = Counter(s.sample_id for g in groups for s in g.samples)
        workers = {s.sample_id: s.worker for g in groups for s in g.samples}
        for rid in stranded:
            assert by_id[rid] == 1 and workers[rid] == survivor, rid
        assert sum(m.tool_calls for m in d.metrics) > 0  # the run did call its tools
        for g in groups:
            for s in g.samples:
                assert s.policy_version == g.step
                assert not len(s.loss_mask) or len(s.loss_mask) == len(s.response_ids)
    finally:
        stop_cluster(cluster, sr)
