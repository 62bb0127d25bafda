"""Verifiers: ``f(response_text, answer) -> reward in [0, 1]``.  Plug-ins are dotted paths.

The exact checks are marked ``cheap``: ``task.verifier_pool: auto`` calls them inline in the worker.
:func:`math_verify` is symbolic (sympy) and can hang on adversarial output, so it runs in the
verifier process pool, under ``task.verifier_timeout_s`` (``rolloutpipe/tasks/reward.py``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def cheap(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a verifier as a quick exact check: scored inline, without the process pool."""
    fn.cheap = True  # type: ignore[attr-defined]
    return fn


@cheap
def exact_match(response: str, answer: str) -> float:
    return 1.0 if response.strip() == answer.strip() else 0.0


@cheap
def first_char_match(response: str, answer: str) -> float:
    """The first character of the response is the answer (single-digit tasks)."""
    r = response.strip()
    return 1.0 if r[:1] == answer.strip()[:1] and r != "" else 0.0


def _number(s: str) -> float | None:
    try:
        return float(s.replace(",", "").strip())
    except ValueError:
        return None


@cheap
def last_number_match(response: str, answer: str) -> float:
    """GSM8K-style: the answer in ``\\boxed{…}`` if there is one, else the last number, equals ``answer``."""
    boxed = _BOXED.findall(response)
    found = boxed[-1] if boxed else (_NUMBER.findall(response) or [""])[-1]
    got, want = _number(found), _number(answer)
    if got is None or want is None:
        return 1.0 if found.strip() and found.strip() == answer.strip() else 0.0
    return 1.0 if abs(got - want) <= 1e-6 * max(1.0, abs(want)) else 0.0


def math_verify(response: str, answer: str) -> float:
    """``math-verify`` (Hugging Face's math answer checker): the response's final answer — the last
    ``\\boxed{…}``, else a LaTeX or plain expression — is equal to ``answer`` as mathematics
    (``\\frac{1}{2}`` = ``0.5``, ``1,000`` = ``1000``, ``\\sqrt{2}/2`` = ``\\frac{\\sqrt{2}}{2}``).

    ``answer`` is a dataset's ground truth without delimiters (verl's ``ground_truth``, ``"72"``,
    ``"\\frac{1}{2}"``); it is read as if boxed.  The library's own timeouts use ``SIGALRM``, which
    works only in a main thread and is not a bound we rely on: the verifier pool's is.
    """
    from math_verify import parse, verify

    for name in ("math_verify.parser", "math_verify.grader"):  # "timeout disabled" on every call
        logging.getLogger(name).setLevel(logging.ERROR)
    gold = parse("\\boxed{" + answer.strip() + "}", parsing_timeout=None)
    if not gold:
        return 0.0
    pred = parse(response, parsing_timeout=None)
    return 1.0 if pred and verify(gold, pred, timeout_seconds=None) else 0.0


def _warm_up_math_verify() -> None:
    """sympy's import and math-verify's parser set-up take about a second: done once per pool process."""
    math_verify("\\boxed{\\frac{1}{2}}", "0.5")


math_verify.warm_up = _warm_up_math_verify  # type: ignore[attr-defined]
