"""Scoring (``rolloutpipe/tasks/reward.py``, ``verifiers.math_verify``): math-verify on a table of
known-equal and known-different pairs, a verifier that hangs, raises or kills its process, and the
three kinds of reward function (ours, verl's, slime's) inline and in the process pool.

The table's expected values are written by hand from the mathematics, not computed by any verifier.
Every call of the table goes through the real process pool, as a rollout worker makes it.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from rolloutpipe.errors import ConfigError
from rolloutpipe.tasks.reward import Score, ScoreInput, Scorer, classify, load_function
from rolloutpipe.tasks.verifiers import exact_match, math_verify
from tests.support.byo_rewards import TOWER

MATH = "rolloutpipe.tasks.verifiers:math_verify"


def task(verifier: str, pool: str = "process", timeout_s: float = 10.0, **reward_args: Any) -> Any:
    return SimpleNamespace(verifier=verifier, verifier_pool=pool, verifier_processes=2,
                           verifier_timeout_s=timeout_s, reward_args=reward_args)  # fmt: skip


# (response, ground truth, equal?)
EQUAL = [
    ("The answer is \\boxed{72}.", "72", True),
    ("so $x = 72$", "72", True),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{0.5}", "\\frac{1}{2}", True),
    ("\\boxed{\\frac12}", "\\frac{1}{2}", True),
    ("\\boxed{\\dfrac{3}{4}}", "0.75", True),
    ("\\boxed{1,000}", "1000", True),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", True),
    ("\\boxed{2\\pi}", "2\\pi", True),
    ("\\boxed{\\pi \\cdot 2}", "2\\pi", True),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", True),
    ("\\boxed{-3}", "-3", True),
    ("first 5, then \\boxed{8}", "8", True),
    ("\\boxed{\\{1, 2\\}}", "\\{2, 1\\}", True),
    ("\\boxed{(1, 2)}", "(1,2)", True),
    ("\\boxed{10\\%}", "10\\%", True),
    ("\\boxed{3 \\text{ cm}}", "3", True),
    ("\\boxed{\\frac{6}{4}}", "\\frac{3}{2}", True),
    ("\\boxed{1.5}", "\\frac{3}{2}", True),
    ("\\boxed{2^{10}}", "1024", True),
]
DIFFERENT = [
    ("\\boxed{71}", "72", False),
    ("\\boxed{\\frac{1}{3}}", "0.33", False),
    ("\\boxed{-3}", "3", False),
    ("\\boxed{x^2+1}", "(x+1)^2", False),
    ("\\boxed{(2, 1)}", "(1,2)", False),
    ("\\boxed{\\sqrt{3}}", "\\sqrt{2}", False),
    ("\\boxed{2\\pi}", "\\pi", False),
    ("\\boxed{1001}", "1000", False),
    ("The answer is 7, not \\boxed{6}", "7", False),
    ("\\boxed{2^{11}}", "1024", False),
]
# Output a policy really produces early in training, and output written to break a parser.
PATHOLOGICAL = [
    ("", "1", False),
    ("   ", "1", False),
    ("\\boxed{}", "1", False),
    ("\\boxed{", "1", False),
    ("\\frac{1}{", "1", False),
    ("}}}}{{{{", "1", False),
    # nested deep, still parsed: the parse's time grows steeply with the depth (on 2 cores at load 6,
    # 20 levels took 5.5 s, 50 took 37 s)
    ("\\boxed{" + "(" * 20 + "1" + ")" * 20 + "}", "1", True),
    # deeper than the parser goes (between 50 and 100 levels): scored 0, not a crash of the worker
    ("\\boxed{" + "(" * 300 + "1" + ")" * 300 + "}", "1", False),
    ("1" * 5000, "1", False),
    ("\\boxed{1}" * 500, "1", True),
    ("💥 \x00 \\u0000 ∞", "1", False),
    ("$$$$", "1", False),
    ("\\boxed{\\infty}", "1", False),
    ("\\boxed{0/0}", "1", False),
]
TABLE = EQUAL + DIFFERENT + PATHOLOGICAL


@pytest.fixture(scope="module")
def math_pool() -> Iterator[Scorer]:
    # every entry must finish (a timeout scores 0 with outcome "timeout", never the table's verdict);
    # the deepest take 3 s on an idle machine and 14 s at load 8 on 2 cores: 60 s leaves a margin
    with Scorer(task(MATH, timeout_s=60.0)) as s:
        assert s.mode == "process"
        yield s


def test_the_table_is_large_and_mixed() -> None:
    assert len(TABLE) >= 30 and len(EQUAL) >= 15 and len(DIFFERENT) >= 10 and len(PATHOLOGICAL) >= 10


@pytest.mark.parametrize(("response", "answer", "equal"), TABLE, ids=[f"{i}" for i in range(len(TABLE))])
def test_math_verify_table(math_pool: Scorer, response: str, answer: str, equal: bool) -> None:
    score = math_pool.score_sync(ScoreInput(response, answer))
    assert score == Score(1.0 if equal else 0.0), (response, answer, score)


def test_the_table_is_not_what_the_cheap_check_says() -> None:
    """The table needs math-verify: the cheap exact check gets a third of it wrong."""
    wrong = sum(exact_match(r, a) != (1.0 if eq else 0.0) for r, a, eq in TABLE)
    assert wrong >= len(TABLE) // 3


def test_a_response_that_hangs_math_verify_times_out_scores_0_and_the_pool_goes_on() -> None:
    with Scorer(task(MATH, timeout_s=2.0)) as s:
        t = time.monotonic()
        hung = s.score_sync(ScoreInput(TOWER, "1"))
        took = time.monotonic() - t
        assert hung.outcome == "timeout" and hung.reward == 0.0, hung
        assert took < 2.0 + 8.0, took  # the timeout (+ the process's start), not sympy's hours
        # the killed process was replaced: the pool still scores, with both its processes
        assert [s.score_sync(ScoreInput(f"\\boxed{{{i}}}", "3")).reward for i in range(4)] == [0, 0, 0, 1]
        assert s.pool is not None and len(s.pool.all) == 2


def test_concurrent_hangs_do_not_block_the_event_loop() -> None:
    """Two hung calls on two processes; the loop keeps ticking, and a later call is scored."""

    async def main() -> tuple[list[Score], int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        ticker = asyncio.create_task(tick())
        with Scorer(task(MATH, timeout_s=2.0)) as s:
            scores = await asyncio.gather(s.score(ScoreInput(TOWER, "1")), s.score(ScoreInput(TOWER, "2")))
            scores.append(await s.score(ScoreInput("\\boxed{2}", "2")))
        ticker.cancel()
        return scores, ticks

    scores, ticks = asyncio.run(main())
    assert [x.outcome for x in scores] == ["timeout", "timeout", "ok"] and scores[2].reward == 1.0
    assert ticks >= 20  # ~2 s of hangs at 20 ticks a second: the loop was never blocked


# --------------------------------------------------------------------- failures of a user's function


def raises(response: str, answer: str) -> float:
    raise ZeroDivisionError("user bug")


def kills_its_process(response: str, answer: str) -> float:
    os._exit(3)


def nan(response: str, answer: str) -> float:
    return math.nan


def a_string(response: str, answer: str) -> Any:
    return "1.0 points"


def sleeps(response: str, answer: str) -> float:
    time.sleep(3600)
    return 1.0


def a_dict_without_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any) -> Any:
    return {"acc": 1.0}


@pytest.mark.parametrize("pool", ["inline", "process"])
@pytest.mark.parametrize(
    ("fn", "detail"),
    [
        ("raises", "ZeroDivisionError: user bug"),
        ("nan", "it returned nan"),
        ("a_string", "it returned str, not a number"),
        ("a_dict_without_score", "it returned a dict without 'score' (keys: ['acc'])"),
    ],
)
def test_a_failing_reward_function_scores_0_with_its_reason(pool: str, fn: str, detail: str) -> None:
    with Scorer(task(f"tests.unit.test_reward:{fn}", pool)) as s:
        score = s.score_sync(ScoreInput("1", "1"))
        assert score == Score(0.0, "error", detail)
        assert asyncio.run(s.score(ScoreInput("1", "1"))) == score


def test_a_process_that_dies_scores_0_and_is_replaced() -> None:
    with Scorer(task("tests.unit.test_reward:kills_its_process")) as s:
        score = s.score_sync(ScoreInput("1", "1"))
        assert score.outcome == "error" and score.reward == 0.0
        assert "the verifier process died (exit code 3)" in score.detail
        assert s.score_sync(ScoreInput("1", "1")).outcome == "error"  # a fresh process, dying again
        assert s.pool is not None and len(s.pool.all) == 2


def test_a_plain_sleep_is_stopped_too() -> None:
    with Scorer(task("tests.unit.test_reward:sleeps", timeout_s=1.0)) as s:
        assert s.score_sync(ScoreInput("1", "1")) == Score(0.0, "timeout", "no result within 1 s")


async def slow_slime(args: Any, sample: Any) -> float:
    await asyncio.sleep(3600)
    return 1.0


def test_an_async_reward_function_inline_is_bounded_by_the_timeout() -> None:
    with Scorer(task("tests.unit.test_reward:slow_slime", "inline", timeout_s=0.5)) as s:
        assert asyncio.run(s.score(ScoreInput("1", "1"))).outcome == "timeout"


# --------------------------------------------------------------------- the three kinds, as written


def verl_with_kwargs(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, *, bonus: float = 0.0
) -> Any:
    return {"score": float(solution_str == ground_truth) + bonus, "source": data_source, **(extra_info or {})}


async def slime_rm(args: Any, sample: Any) -> Any:
    assert sample.prompt == "2+2=" and sample.metadata == {"k": 1}
    return {args.reward_key: args.scale * float(sample.response == sample.label)}


@pytest.mark.parametrize("pool", ["inline", "process"])
@pytest.mark.parametrize(
    ("spec", "args", "kind", "want"),
    [
        # verl's dict result, its own data_source check
        ("tests.support.byo_rewards:compute_score", {}, "verl", 1.0),
        ("tests/support/byo_rewards.py:compute_score", {}, "verl", 1.0),  # verl's custom_reward_function.path
        ("tests.unit.test_reward:verl_with_kwargs", {"bonus": 0.25}, "verl", 1.25),  # verl's reward_kwargs
        ("tests.unit.test_reward:slime_rm", {"reward_key": "acc", "scale": 2.0}, "slime", 2.0),
        ("tests.support.byo_rewards:custom_rm", {"correct_reward": 3.0}, "slime", 3.0),
        ("rolloutpipe.tasks.verifiers.first_char_match", {}, "ours", 1.0),
    ],
)
def test_each_kind_of_reward_function_as_written(
    pool: str, spec: str, args: dict[str, Any], kind: str, want: float
) -> None:
    x = ScoreInput("4", "4", "2+2=", "mod10", {"k": 1, "split": "train", "tag": "m"})
    if kind == "slime" and spec.endswith("slime_rm"):
        x = ScoreInput("4", "4", "2+2=", "mod10", {"k": 1})
    with Scorer(task(spec, pool, **args)) as s:
        assert s.call.kind == kind and s.mode == pool
        assert s.score_sync(x) == Score(want)
        assert asyncio.run(s.score(x)) == Score(want)
        assert s.score_sync(ScoreInput("5", "4", "2+2=", x.data_source, x.extra_info)).reward == (
            0.25 if "bonus" in args else 0.0
        )


def test_auto_runs_cheap_checks_inline_and_everything_else_in_the_pool(tmp_path: Path) -> None:
    with Scorer(task("rolloutpipe.tasks.verifiers:exact_match", "auto")) as s:
        assert s.mode == "inline" and s.pool is None
    with Scorer(task(MATH, "auto")) as s:
        assert s.mode == "process"
    with Scorer(task("tests.support.byo_rewards:compute_score", "auto")) as s:
        assert s.mode == "process"  # a user's function may be slow or hang: not trusted to be cheap


def test_math_verify_is_the_same_inline() -> None:
    """The pool adds a timeout, not a different answer."""
    for r, a, eq in EQUAL[:5] + DIFFERENT[:5]:
        assert math_verify(r, a) == (1.0 if eq else 0.0)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tests.no_such_module:f", "cannot import task.verifier 'tests.no_such_module:f': No module named"),
        ("tests.support.byo_rewards:nope", "cannot import task.verifier 'tests.support.byo_rewards:nope'"),
        ("tests/no_such_file.py:f", "cannot import task.verifier 'tests/no_such_file.py:f': no file"),
        (
            "tests.support.byo_rewards:TOWER",
            "task.verifier 'tests.support.byo_rewards:TOWER' is not a function",
        ),
        ("os.path:join", "a reward function is f(response, answer)"),
        ("tests.unit.test_reward:task", "a reward function is f(response, answer)"),
    ],
)
def test_a_reward_function_that_cannot_be_used_is_a_clear_config_error(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        Scorer(task(spec))


def test_classify_reads_parameters_not_names_of_functions() -> None:
    assert classify(load_function("tests.unit.test_reward:nan"), "x") == "ours"
    assert classify(load_function("tests.unit.test_reward:verl_with_kwargs"), "x") == "verl"
    assert classify(load_function("tests.unit.test_reward:slow_slime"), "x") == "slime"


@pytest.mark.parametrize("pool", ["inline", "process"])
def test_a_dotted_path_resolves_from_the_working_directory(
    pool: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ``rolloutpipe`` console script does not put the working directory on ``sys.path`` (``python
    -m`` does): a user's ``my_scores:f`` must import either way, in the pool's processes too."""
    (tmp_path / "my_scores_cwd.py").write_text("def f(response, answer):\n    return 0.5\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    with Scorer(task("my_scores_cwd:f", pool)) as s:
        assert s.score_sync(ScoreInput("1", "1")) == Score(0.5)


def test_the_first_call_is_not_charged_the_set_up() -> None:
    """Importing sympy and building math-verify's parser takes about a second in a fresh process;
    it happens before the process takes calls (``warm_up``), so a short timeout still scores."""
    with Scorer(task(MATH, timeout_s=0.5)) as s:
        assert [s.score_sync(ScoreInput("\\boxed{2}", "2")) for _ in range(3)] == [Score(1.0)] * 3
