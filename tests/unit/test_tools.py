"""Tools (``agents/tools.py``): whatever a tool does, the model gets text and the worker goes on.

Every bad-output case of the issue: a raise, a hang, too long, not UTF-8, not text, arguments
that do not fit, an unknown tool; and the calculator's arithmetic against Python's own integers,
with what it must refuse.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest

from rolloutpipe.agents.tools import (
    Toolbox,
    calculator,
    call,
    corpus_lookup,
    evaluate,
    load_toolbox,
    search_corpus,
    tool,
)
from rolloutpipe.errors import ConfigError

ANY = {"type": "object", "properties": {"x": {"type": "string"}}}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@tool("raises", ANY)
async def raising(x: str = "") -> str:
    raise RuntimeError("disk on fire")


@tool("hangs", ANY, timeout_s=0.2)
async def hanging(x: str = "") -> str:
    await asyncio.sleep(3600)
    return "never"


@tool("long", ANY)
async def long_output(x: str = "") -> str:
    return "y" * 10_000


@tool("bytes", ANY)
async def bad_bytes(x: str = "") -> bytes:
    return b"ok \xff\xfe end"


@tool("object", ANY)
async def an_object(x: str = "") -> object:
    return object()


@tool("json", ANY)
async def structured(x: str = "") -> dict[str, Any]:
    return {"a": [1, 2]}


def test_a_raise_is_an_error_message() -> None:
    r = run(call(raising, {}))
    assert r.outcome == "error" and r.text == "error: raising: RuntimeError: disk on fire"


def test_a_hang_is_a_timeout_message_within_the_tools_timeout() -> None:
    t0 = time.monotonic()
    r = run(call(hanging, {}))
    assert r.outcome == "timeout" and "timed out after 0.2 s" in r.text
    assert time.monotonic() - t0 < 3600  # it did not wait for the tool


def test_long_output_is_cut_with_a_note() -> None:
    r = run(call(long_output, {}, max_chars=100))
    assert r.truncated and len(r.text) == 100 and r.text.startswith("yyy") and "[cut: 10000 chars]" in r.text


def test_bytes_that_are_not_utf8_are_replaced_and_counted() -> None:
    r = run(call(bad_bytes, {}))
    assert r.bad_output and r.outcome == "ok" and r.text == "ok \ufffd\ufffd end"


def test_output_that_is_not_text() -> None:
    r = run(call(an_object, {}))
    assert r.bad_output and r.text.startswith("<object object")
    r = run(call(structured, {}))
    assert not r.bad_output and json.loads(r.text) == {"a": [1, 2]}


def test_arguments_that_do_not_fit_the_spec() -> None:
    assert run(call(calculator, {})).text == "error: calculator: missing argument(s): expression"
    assert (
        run(call(calculator, {"expression": "1", "y": 2})).text == "error: calculator: unknown argument(s): y"
    )
    assert run(call(calculator, ["1+1"])).outcome == "error"


def test_an_unknown_tool() -> None:
    r = run(Toolbox({"calculator": calculator}).call("search", {}))
    assert r.outcome == "unknown" and "tools: calculator" in r.text


def test_the_calculator_is_exact_on_long_integers() -> None:
    rng = random.Random(0)
    for _ in range(200):
        a, b = rng.randrange(10**30), rng.randrange(1, 10**20)
        op = rng.choice(["+", "-", "*", "//", "%"])
        want = {"+": a + b, "-": a - b, "*": a * b, "//": a // b, "%": a % b}[op]
        assert evaluate(f"{a}{op}{b}") == str(want)
    assert evaluate("2**10 - -3") == "1027" and evaluate("(1+2)*3") == "9" and evaluate("7/2") == "3.5"
    assert run(call(calculator, {"expression": "12*12"})).text == "144"


@pytest.mark.parametrize(
    "expr",
    ["__import__('os').system('true')", "x+1", "9**9**9", "10**500", "2**5000", "'a'*3", "1" * 300, "f(1)"],
)
def test_the_calculator_refuses_what_is_not_bounded_arithmetic(expr: str) -> None:
    r = run(call(calculator, {"expression": expr}))
    assert r.outcome == "error" and r.text.startswith("error: calculator:"), r.text


def test_division_by_zero_is_a_message() -> None:
    assert "ZeroDivisionError" in run(call(calculator, {"expression": "1/0"})).text


def test_the_corpus_lookup(tmp_path: Path) -> None:
    assert "8849" in run(call(corpus_lookup, {"query": "how high is Mount Everest"})).text
    p = tmp_path / "c.jsonl"
    p.write_text('{"title": "a", "text": "red apple"}\n{"title": "b", "text": "green apple pie"}\n')
    assert search_corpus("green apple", p) == "b: green apple pie"
    assert search_corpus("apple", p) == "a: red apple"  # a tie: the earlier line
    assert search_corpus("banana", p) == "no match"


def test_load_toolbox() -> None:
    box = load_toolbox(["rolloutpipe.agents.tools:calculator", "rolloutpipe.agents.tools:corpus_lookup"])
    assert [s["function"]["name"] for s in box.specs] == ["calculator", "corpus_lookup"]
    assert box.specs[0]["function"]["parameters"]["required"] == ["expression"]
    with pytest.raises(ConfigError, match="two tools are named"):
        load_toolbox(["rolloutpipe.agents.tools:calculator"] * 2)
    with pytest.raises(ConfigError, match="is not a tool"):
        load_toolbox(["rolloutpipe.agents.tools:evaluate"])
