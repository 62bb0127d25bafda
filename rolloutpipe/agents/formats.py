"""How a tool call looks in the model's text, and how its result is written back (``task.tool_format``).

A format has ``call_end``, the text (one token of the model's tokenizer) that ends a model turn
with a call; ``parse(turn)``, the calls in a turn's text, or an error message for the model when
the turn tried to call and got it wrong; and ``render(results)``, the text appended after the turn
(its tokens are the tool's: loss mask 0).

* :data:`hermes` -- Qwen3's chat template and verl's tool agent loop: ``<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>``, answered by ``<tool_response>...</tool_response>`` in a user
  turn of the chat template.
* :data:`arith` -- the tiny model's character vocabulary (digits, ``+-* =``): a turn ending in
  ``=`` calls the calculator on the expression before it (after the last space), and the result is
  the value's digits.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

from rolloutpipe.agents.tools import ToolResult


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


class ToolFormat(Protocol):
    call_end: str

    def parse(self, turn: str) -> list[ToolCall] | str: ...

    def render(self, results: list[ToolResult]) -> str: ...


class Hermes:
    """Qwen3's (and Hermes') tool calls; the result goes back in a user turn of ChatML."""

    call_end = "</tool_call>"
    CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def parse(self, turn: str) -> list[ToolCall] | str:
        calls = []
        for body in self.CALL.findall(turn):
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as e:
                return f"error: the tool call is not JSON: {e}"
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return 'error: a tool call is {"name": ..., "arguments": {...}}'
            args = obj.get("arguments", {})
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return "error: the arguments are not a JSON object"
            calls.append(ToolCall(obj["name"], args))
        return calls

    def render(self, results: list[ToolResult]) -> str:
        body = "".join(f"<tool_response>\n{r.text}\n</tool_response>\n" for r in results)
        return f"<|im_end|>\n<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


class Arith:
    """The character vocabulary's calculator call: ``... 123*456=`` -> ``56088``."""

    call_end = "="
    EXPR = re.compile(r"([0-9+\-*]+)=$")

    def parse(self, turn: str) -> list[ToolCall] | str:
        m = self.EXPR.search(turn.rsplit(" ", 1)[-1])
        if not m:
            return []
        return [ToolCall("calculator", {"expression": m.group(1)})]

    def render(self, results: list[ToolResult]) -> str:
        # an error cannot be spelled in digits: nothing is appended, and the model goes on unhelped
        return "".join(r.text for r in results if r.outcome == "ok" and re.fullmatch(r"-?[0-9]+", r.text))


hermes = Hermes()
arith = Arith()
