"""Verifiers: ``f(response_text, answer) -> reward in [0, 1]``.  Plug-ins are dotted paths."""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def exact_match(response: str, answer: str) -> float:
    return 1.0 if response.strip() == answer.strip() else 0.0


def first_char_match(response: str, answer: str) -> float:
    """The first character of the response is the answer (single-digit tasks)."""
    r = response.strip()
    return 1.0 if r[:1] == answer.strip()[:1] and r != "" else 0.0


def _number(s: str) -> float | None:
    try:
        return float(s.replace(",", "").strip())
    except ValueError:
        return None


def last_number_match(response: str, answer: str) -> float:
    """GSM8K-style: the answer in ``\\boxed{…}`` if there is one, else the last number, equals ``answer``."""
    boxed = _BOXED.findall(response)
    found = boxed[-1] if boxed else (_NUMBER.findall(response) or [""])[-1]
    got, want = _number(found), _number(answer)
    if got is None or want is None:
        return 1.0 if found.strip() and found.strip() == answer.strip() else 0.0
    return 1.0 if abs(got - want) <= 1e-6 * max(1.0, abs(want)) else 0.0
