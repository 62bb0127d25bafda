"""Reward functions written the way verl and slime users write them, for
``tests/e2e/test_datasets_e2e.py``.

Nothing here knows RolloutPipe: the run loads them by ``task.verifier`` as they are.  Each refuses
inputs that did not come through from the dataset row (a wrong data_source, no metadata), so that a
run where those fields were lost scores no sample correct.
"""

from __future__ import annotations

from typing import Any


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> Any:
    """verl's ``custom_reward_function`` shape: a dict with ``score`` (and anything else to log)."""
    if data_source != "mod10" or not extra_info or extra_info.get("split") not in ("train", "test"):
        raise ValueError(f"the row's data_source/extra_info did not arrive: {data_source!r} {extra_info!r}")
    correct = solution_str.strip()[:1] == ground_truth
    return {"score": 1.0 if correct else 0.0, "acc": correct}


async def custom_rm(args: Any, sample: Any) -> float:
    """slime's ``--custom-rm-path`` shape: ``args`` (the run's arguments) and one ``Sample``."""
    if sample.metadata.get("tag") != "m":
        raise ValueError(f"the row's metadata did not arrive: {sample.metadata!r}")
    return float(args.correct_reward) if sample.response.strip()[:1] == str(sample.label) else 0.0


# A response crafted to make math-verify hang: sympy evaluates the power tower for hours.
TOWER = "\\boxed{9^{9^{9^{9^{9}}}}}"


def tower_when_seven(response: str, answer: str) -> float:
    """``verifiers.math_verify``, but a response to a prompt whose answer is 7 is replaced by
    :data:`TOWER` (a tiny model cannot write one itself): those calls hang until the pool's timeout."""
    from rolloutpipe.tasks.verifiers import math_verify

    return math_verify(TOWER if answer == "7" else response.strip()[:1], answer)


def _warm_up() -> None:
    from rolloutpipe.tasks.verifiers import math_verify

    math_verify.warm_up()  # type: ignore[attr-defined]


tower_when_seven.warm_up = _warm_up  # type: ignore[attr-defined]  # as math_verify's: before any call


def broken(response: str, answer: str) -> float:
    """A reward function with a bug: it raises on every call."""
    raise KeyError("label")
