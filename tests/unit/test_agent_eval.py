"""The held-out score of an agent task (``configs/agent.yaml``): the evaluator runs each eval prompt
as an episode, tools and all, and its reward, tool-use rate and interval are what a scripted policy
earns, worked out here from the prompts alone; the long_add task and its warm start; the run's
held-out line."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rolloutpipe.broker.events import StepMetrics
from rolloutpipe.launch.cluster import held_out_line, summary_table
from rolloutpipe.model.tokenizer import EOS, VOCAB
from rolloutpipe.roles.trainer.evaluate import EvalScore, Evaluator, score_of
from rolloutpipe.tasks.datasets import long_add, long_add_is_eval, long_add_warm
from tests.support.config import make_config
from tests.support.events import step_metrics

EQ, SPACE = VOCAB.index("="), VOCAB.index(" ")


class Scripted(torch.nn.Module):
    """A policy that calls the calculator on prompts whose first digit is even (``" a+b="``, then
    EOS after the result) and answers ``0`` directly on the others: its logits put all the mass on
    that next token."""

    def __init__(self) -> None:
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        B, T = input_ids.shape
        logits = torch.full((B, T, len(VOCAB)), -1e4)
        for b in range(B):
            seq = input_ids[b, : int(attention_mask[b].sum())].tolist()
            cut = seq.index(EQ) + 1  # the prompt ends at its "="
            prompt, resp = seq[1:cut], seq[cut:]  # after BOS
            if int(VOCAB[prompt[0]]) % 2 == 0:
                want = [SPACE, *prompt]
                nxt = want[len(resp)] if len(resp) < len(want) else EOS
            else:
                nxt = VOCAB.index("0") if not resp else EOS
            logits[b, len(seq) - 1, nxt] = 0.0
        return SimpleNamespace(logits=logits)


def _cfg(tmp_path: Any, **over: str) -> Any:
    args = [
        "task.dataset=rolloutpipe.tasks.datasets:long_add",
        "task.verifier=rolloutpipe.tasks.verifiers:last_number_match",
        'task.tools=["rolloutpipe.agents.tools:calculator"]',
        "task.tool_format=arith",
        "task.max_turns=2",
        "rollout.max_new_tokens=18",
        "eval.every=1",
        "eval.num_prompts=40",
        "eval.samples_per_prompt=2",
        *(f"{k}={v}" for k, v in over.items()),
    ]
    return make_config(tmp_path, "agent-eval", *args)


def test_the_evaluator_runs_episodes_and_scores_what_the_scripted_policy_earns(tmp_path: Any) -> None:
    cfg = _cfg(tmp_path)
    ev = Evaluator(cfg)
    got = ev.score(Scripted())
    prompts = [p for p, _ in ev.items]
    calls = [1.0 if int(p.text[0]) % 2 == 0 else 0.0 for p in prompts]  # a call is right; "0" is not
    assert 0 < sum(calls) < len(calls)  # both kinds of prompt, or the test shows little
    assert got.tool_rate == pytest.approx(sum(calls) / len(calls))
    assert got.reward == pytest.approx(sum(calls) / len(calls))
    per_prompt = calls[::2]  # two samples a prompt, the same each (the policy is deterministic)
    n, mean = len(per_prompt), sum(per_prompt) / len(per_prompt)
    half = 1.96 * math.sqrt(sum((x - mean) ** 2 for x in per_prompt) / (n - 1) / n)
    assert (got.lo, got.hi) == (pytest.approx(mean - half), pytest.approx(mean + half))


def test_without_tools_the_scripted_policy_never_calls(tmp_path: Any) -> None:
    """The same policy on the single-turn path: a call ends the response at "=", nothing answers it."""
    got = Evaluator(_cfg(tmp_path, **{"task.tools": "[]"})).score(Scripted())
    assert got.tool_rate is None and got.reward == 0.0


def test_score_of_intervals_are_over_prompts() -> None:
    s = score_of([1, 1, 0, 0], [0, 0, 1, 1])  # two prompts: 1 and 0; sd of the means 0.707
    assert s.reward == 0.5 and s.hi - s.lo == pytest.approx(2 * 1.96 * math.sqrt(0.5) / math.sqrt(2))
    assert score_of([1, 0, 1, 0], [0, 0, 1, 1]).lo == 0.5  # the same means: no spread between prompts
    assert score_of([1.0], [0], [0]).tool_rate == 0.0


def test_long_add_splits_are_disjoint_and_answers_right() -> None:
    train, held = long_add(400, 0), long_add(200, 0, split="eval")
    assert not {p.text for p in train} & {p.text for p in held}
    assert all(long_add_is_eval(p.text) for p in held) and not any(long_add_is_eval(p.text) for p in train)
    for p in train + held:
        a, b = p.text.rstrip("=").split("+")
        assert int(p.answer) == int(a) + int(b) and 2 <= len(a) <= 4 and 2 <= len(b) <= 4
    warm = long_add_warm(2000, 0)
    called = [p for p in warm if p.answer.startswith(" ")]
    assert 0.45 < len(called) / len(warm) < 0.55
    assert all(p.answer == f" {p.text}{int(eval(p.text[:-1]))}" for p in called)


def _m(step: int, **kw: Any) -> StepMetrics:
    return step_metrics("r", step).model_copy(update={"samples": 4, **kw})


def test_the_held_out_line_compares_the_last_version_with_the_base() -> None:
    ms = [
        _m(0, tool_calls=2),
        _m(1, tool_calls=4, eval_reward=0.9, eval_lo=0.85, eval_hi=0.95, eval_tool_rate=1.0),
    ]
    line = held_out_line(EvalScore(0.35, 0.31, 0.39, 0.43), ms)
    assert "base 0.350 [0.310, 0.390], tool use 0.43 -> version 2 0.900 [0.850, 0.950], tool use 1.00" in line
    assert line.endswith("above the base's interval")
    assert held_out_line(EvalScore(0.88, 0.8, 0.9), ms).endswith("the intervals overlap")
    assert held_out_line(None, ms) == ""
    table = summary_table(ms)
    assert "tool_calls/sample" in table and "| 0.500 | - | 0.500 | - |" in table  # step 0: 2 calls, 4 samples
    assert "| 0.500 | 0.900 | 1.000 | 1.000 |" in table


def test_long_add_refuses_bad_arguments() -> None:
    from rolloutpipe.errors import ConfigError

    with pytest.raises(ConfigError, match="split"):
        long_add(1, 0, split="test")
    with pytest.raises(ConfigError, match="min_digits"):
        long_add(1, 0, min_digits=3, max_digits=2)
