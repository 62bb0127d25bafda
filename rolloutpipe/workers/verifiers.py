"""Verifiers: ``f(response_text, answer) -> reward in [0, 1]``.  Plug-ins are dotted paths."""

from __future__ import annotations


def exact_match(response: str, answer: str) -> float:
    return 1.0 if response.strip() == answer.strip() else 0.0


def first_char_match(response: str, answer: str) -> float:
    """The first character of the response is the answer (single-digit tasks)."""
    r = response.strip()
    return 1.0 if r[:1] == answer.strip()[:1] and r != "" else 0.0
