"""Tools an episode may call: plug-ins by dotted path, like verifiers.

A tool is an async callable taking its arguments as keywords and returning text, with a ``spec``:
the function-calling description that Qwen3's chat template and verl's tool config take
(``{"type": "function", "function": {"name", "description", "parameters": <JSON schema>}}``).
:func:`tool` makes one from an ``async def``.  Each tool also says its ``timeout_s`` and whether it
is ``idempotent`` (a non-idempotent tool is never called twice for one call in an episode: a
resumed episode reads the results it already has from its prefix).

:func:`call` is the one place a tool runs.  Whatever the tool does, the model gets text back and
the worker goes on:

* a raise, a hang past ``timeout_s``, or arguments that do not fit the spec: an error message
  (``"error: ..."``), counted as ``tool_errors`` / ``tool_timeouts``;
* output that is not text: ``str()`` of it; bytes that are not UTF-8: decoded with replacement
  characters, counted as ``tool_bad_output``;
* output longer than ``max_chars``: cut there, with a note saying so, counted as
  ``tool_truncated``.

The shipped tools execute no user code: :func:`calculator` evaluates arithmetic by walking its
syntax tree (numbers and + - * / // % ** and unary minus only, with bounds on exponents and on the
size of every intermediate number), and :func:`corpus_lookup` searches a local text corpus.  A tool
that runs code must do it in a subprocess with resource limits and a timeout (docs/agents.md says
what that does and does not protect).
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rolloutpipe.errors import ConfigError


class Tool(Protocol):
    spec: dict[str, Any]
    timeout_s: float
    idempotent: bool

    def __call__(self, **kwargs: Any) -> Awaitable[Any]: ...


@dataclass
class FunctionTool:
    """An ``async def`` with its function-calling spec (see :func:`tool`)."""

    fn: Callable[..., Awaitable[Any]]
    spec: dict[str, Any]
    timeout_s: float = 5.0
    idempotent: bool = True

    def __call__(self, **kwargs: Any) -> Awaitable[Any]:
        return self.fn(**kwargs)

    @property
    def name(self) -> str:
        return str(self.spec["function"]["name"])


def tool(
    description: str,
    parameters: dict[str, Any],
    *,
    name: str = "",
    timeout_s: float = 5.0,
    idempotent: bool = True,
) -> Callable[[Callable[..., Awaitable[Any]]], FunctionTool]:
    """Decorate an ``async def`` as a tool; ``parameters`` is the JSON schema of its arguments."""

    def wrap(fn: Callable[..., Awaitable[Any]]) -> FunctionTool:
        function = {"name": name or fn.__name__, "description": description, "parameters": parameters}
        spec = {"type": "function", "function": function}
        return FunctionTool(fn, spec, timeout_s, idempotent)

    return wrap


def tool_name(t: Tool) -> str:
    return str(t.spec["function"]["name"])


@dataclass
class ToolResult:
    text: str
    outcome: str = "ok"  # ok | error | timeout | unknown
    truncated: bool = False
    bad_output: bool = False  # not text, or bytes that are not UTF-8


@dataclass
class Toolbox:
    """The tools of a task, by name, and how much of a result the model is shown."""

    tools: dict[str, Tool] = field(default_factory=dict)
    max_chars: int = 512

    @property
    def specs(self) -> list[dict[str, Any]]:
        return [t.spec for t in self.tools.values()]

    async def call(self, name: str, args: dict[str, Any]) -> ToolResult:
        t = self.tools.get(name)
        if t is None:
            return ToolResult(f"error: no tool named {name!r} (tools: {', '.join(self.tools) or 'none'})",
                              "unknown")  # fmt: skip
        return await call(t, args, self.max_chars)


def _check_args(t: Tool, args: Any) -> str:
    """Why ``args`` do not fit ``t``'s schema (its required names, its declared names), or ''."""
    if not isinstance(args, dict):
        return f"arguments must be an object, not {type(args).__name__}"
    params = t.spec["function"].get("parameters") or {}
    missing = [k for k in params.get("required", []) if k not in args]
    if missing:
        return f"missing argument(s): {', '.join(missing)}"
    known = params.get("properties")
    extra = [k for k in args if known is not None and k not in known]
    if extra and params.get("additionalProperties", True) is False:
        return f"unknown argument(s): {', '.join(extra)}"
    return ""


def _as_text(out: Any) -> tuple[str, bool]:
    if isinstance(out, str):
        return out, False
    if isinstance(out, (bytes, bytearray)):
        try:
            return bytes(out).decode("utf-8"), False
        except UnicodeDecodeError:
            return bytes(out).decode("utf-8", errors="replace"), True
    if isinstance(out, (dict, list)):
        try:
            return json.dumps(out, ensure_ascii=False), False
        except (TypeError, ValueError):
            pass
    return str(out), True


async def call(t: Tool, args: Any, max_chars: int = 512) -> ToolResult:
    """Run ``t(**args)`` within its timeout; never raises (see the module docstring)."""
    why = _check_args(t, args)
    if why:
        return ToolResult(f"error: {tool_name(t)}: {why}", "error")
    try:
        out = await asyncio.wait_for(t(**args), timeout=t.timeout_s)
    except TimeoutError:
        return ToolResult(f"error: {tool_name(t)} timed out after {t.timeout_s:g} s", "timeout")
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the tool's own failure: the model reads it, the worker goes on
        return ToolResult(f"error: {tool_name(t)}: {type(e).__name__}: {e}"[:max_chars], "error")
    text, bad = _as_text(out)
    if len(text) > max_chars:
        note = f" ... [cut: {len(text)} chars]"
        return ToolResult(text[: max(0, max_chars - len(note))] + note, "ok", truncated=True, bad_output=bad)
    return ToolResult(text, "ok", bad_output=bad)


def load_toolbox(paths: list[str], max_chars: int = 512) -> Toolbox:
    """The tools at ``paths`` (dotted, ``pkg.mod:attr``); a name used twice is an error."""
    from rolloutpipe.plugins import import_string

    tools: dict[str, Tool] = {}
    for p in paths:
        t = import_string(p)
        if not hasattr(t, "spec") or not callable(t):
            raise ConfigError(f"task.tools: {p!r} is not a tool (an async callable with a spec; see @tool)")
        n = tool_name(t)
        if n in tools:
            raise ConfigError(f"task.tools: two tools are named {n!r}")
        tools[n] = t
    return Toolbox(tools, max_chars)


# ------------------------------------------------------------------------------- the shipped tools

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}  # fmt: skip
MAX_DIGITS = 400  # no intermediate number longer than this: 10**10**9 is refused before it is built
MAX_EXPONENT = 1000


def _bound(x: Any) -> Any:
    if isinstance(x, int) and x.bit_length() > MAX_DIGITS * 3.33:
        raise ValueError(f"a number past {MAX_DIGITS} digits")
    return x


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bound(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(b) > MAX_EXPONENT:
                raise ValueError(f"an exponent past {MAX_EXPONENT}")
            if isinstance(a, int) and isinstance(b, int) and b > 0 and a.bit_length() * b > MAX_DIGITS * 3.33:
                raise ValueError(f"a number past {MAX_DIGITS} digits")
        return _bound(_BINARY[type(node.op)](a, b))
    raise ValueError("only numbers and + - * / // % ** ( ) are allowed")


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression, exactly for integers (``"123*456"`` -> ``"56088"``)."""
    if len(expression) > 200:
        raise ValueError("an expression past 200 characters")
    v = _eval(ast.parse(expression.strip(), mode="eval"))
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        v = int(v)
    return str(v)


@tool("Evaluate an arithmetic expression exactly (integers of any length up to 400 digits).",
      {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. 123*456"}},
       "required": ["expression"], "additionalProperties": False})  # fmt: skip
async def calculator(expression: str) -> str:
    return evaluate(expression)


DEFAULT_CORPUS = Path(__file__).with_name("corpus.jsonl")


def search_corpus(query: str, path: Path = DEFAULT_CORPUS, k: int = 1) -> str:
    """The ``k`` passages of a JSONL corpus (``{"title", "text"}`` a line) sharing the most words
    with ``query``, ties to the earlier line; "no match" when none shares a word."""
    words = set(query.lower().split())
    scored = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        if not line.strip():
            continue
        doc = json.loads(line)
        text = f"{doc.get('title', '')}: {doc['text']}"
        n = len(words & set(text.lower().replace(":", " ").replace(".", " ").replace(",", " ").split()))
        if n:
            scored.append((-n, i, text))
    return "\n".join(t for _, _, t in sorted(scored)[:k]) or "no match"


@tool("Look a query up in the local corpus; returns the best-matching passage.",
      {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"],
       "additionalProperties": False})  # fmt: skip
async def corpus_lookup(query: str) -> str:
    return await asyncio.to_thread(search_corpus, query)
