"""``engines/episode.py``: a multi-turn episode over a scripted engine, Redis-free.

The engine here plays a fixed transcript: each model turn's tokens, greedy and deterministic, and
it honours ``stop_token_ids`` and a preemption after a given number of tokens, as the real engines
do.  The expected responses, masks and turn starts are written out by hand.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from rolloutpipe.agents.formats import arith, hermes
from rolloutpipe.agents.tools import Toolbox, ToolResult, calculator
from rolloutpipe.broker.events import RolloutRequest
from rolloutpipe.engines.base import Generation
from rolloutpipe.engines.episode import Agent, run_episode
from rolloutpipe.errors import ConfigError
from rolloutpipe.model.tokenizer import EOS, CharTokenizer
from tests.support.events import make_request

TOK = CharTokenizer()


def ids(text: str) -> list[int]:
    return [int(i) for i in TOK.encode_text(text)]


class Scripted:
    """Plays ``model`` (the model's whole part of the response, EOS included) token by token: a
    turn stops after a stop token, at EOS, at the budget, or (once) after ``preempt_at`` tokens."""

    def __init__(self, model: str, preempt_at: int | None = None) -> None:
        self.model = [*ids(model), EOS]
        self.preempt_at = preempt_at
        self.calls: list[RolloutRequest] = []

    async def generate(self, req: RolloutRequest) -> Generation:
        self.calls.append(req)
        prefix = [int(i) for i in req.prefix_ids]
        done = sum(1 for m in (req.prefix_mask if len(req.prefix_mask) else [1] * len(prefix)) if m)
        out, lps, reason = list(prefix), list(req.prefix_logprobs), "length"
        for tok in self.model[done:]:
            if self.preempt_at is not None and done >= self.preempt_at:
                self.preempt_at = None
                reason = "preempted"
                break
            out.append(tok)
            lps.append(-0.5)
            done += 1
            if tok == EOS or tok in req.stop_token_ids:
                reason = "stop"
                break
            if len(out) >= req.max_new_tokens:
                break
        arr = np.asarray(out, np.int32)
        return Generation(np.zeros(1, np.int32), arr, np.asarray(lps, np.float32), TOK.decode(arr), reason)


def _req(max_new: int = 40) -> RolloutRequest:
    return make_request().model_copy(update={"max_new_tokens": max_new, "prompt": "1", "answer": "1"})


def _agent(max_turns: int = 4, **tools: Any) -> Agent:
    return Agent(Toolbox(tools or {"calculator": calculator}), arith, TOK, max_turns)


def run(engine: Scripted, req: RolloutRequest, agent: Agent) -> Any:
    return asyncio.run(run_episode(engine, req, agent))  # type: ignore[arg-type]


def test_an_episode_masks_the_tools_tokens() -> None:
    ep = run(Scripted("12*34= 408"), _req(), _agent())
    want = "12*34=408 408"  # the model's "12*34=", the calculator's "408", the model's " 408" and EOS
    assert TOK.decode(ep.gen.response_ids) == want and ep.gen.response_ids[-1] == EOS
    assert ep.loss_mask.tolist() == [1] * 6 + [0] * 3 + [1] * 5
    assert ep.gen.logprobs.tolist() == [-0.5] * 6 + [0.0] * 3 + [-0.5] * 5  # a tool token's is 0
    assert ep.turns == [0, 9] and ep.tool_calls == 1 and ep.gen.finish_reason == "stop"
    assert [r.text for r in ep.results] == ["408"]


def test_every_turn_is_asked_to_stop_at_the_call_end() -> None:
    eng = Scripted("1+1= 2+2= 4")
    ep = run(eng, _req(), _agent())
    assert TOK.decode(ep.gen.response_ids) == "1+1=2 2+2=4 4" and ep.tool_calls == 2
    assert all(r.stop_token_ids == ids("=") for r in eng.calls) and len(eng.calls) == 3
    assert [len(r.prefix_ids) for r in eng.calls] == [0, 5, 11]  # each turn resumes the whole prefix


def test_max_turns_leaves_the_last_call_unanswered() -> None:
    ep = run(Scripted("1+1= 2+2= 4"), _req(), _agent(max_turns=2))
    assert TOK.decode(ep.gen.response_ids) == "1+1=2 2+2=" and ep.tool_calls == 1
    assert ep.gen.finish_reason == "stop" and ep.loss_mask.tolist() == [1] * 4 + [0] + [1] * 5


def test_the_budget_counts_the_tools_tokens() -> None:
    ep = run(Scripted("99*99= 9801"), _req(max_new=8), _agent())
    assert TOK.decode(ep.gen.response_ids) == "99*99=98" and ep.gen.finish_reason == "length"
    assert ep.loss_mask.tolist() == [1] * 6 + [0] * 2


class Counting:
    """A calculator (non-idempotent, as far as the episode knows) that counts its calls."""

    spec = calculator.spec
    timeout_s = 5.0
    idempotent = False

    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, expression: str) -> str:
        self.calls += 1
        return await calculator(expression=expression)


def test_a_preempted_episode_resumes_token_for_token_without_calling_again() -> None:
    counting = Counting()

    whole = run(Scripted("12*34= 408"), _req(), _agent(calculator=counting))
    assert counting.calls == 1
    first = run(Scripted("12*34= 408", preempt_at=8), _req(), _agent(calculator=counting))
    assert first.gen.finish_reason == "preempted" and counting.calls == 2  # the call was made, then preempted
    g = first.gen
    cont = _req().model_copy(
        update={
            "prefix_ids": g.response_ids,
            "prefix_logprobs": g.logprobs,
            "prefix_mask": first.loss_mask,
            "segment": 1,
            "origin": "0-1",
        }
    )
    rest = run(Scripted("12*34= 408"), cont, _agent(calculator=counting))
    assert counting.calls == 2  # its result was in the prefix: not called again
    assert rest.gen.response_ids.tolist() == whole.gen.response_ids.tolist()
    assert rest.loss_mask.tolist() == whole.loss_mask.tolist() and rest.turns == whole.turns
    assert rest.gen.logprobs.tolist() == whole.gen.logprobs.tolist()


def test_a_tool_error_goes_back_as_text() -> None:
    ep = run(Scripted("1/0= 5"), _req(), _agent())  # "/" is not in the vocabulary: "10=" is asked
    assert ep.tool_calls == 1
    ep = run(Scripted("9**9999= 1"), _req(), _agent())
    assert ep.results[0].outcome == "error" and "exponent" in ep.results[0].text
    # arith cannot spell an error: nothing is appended, the model goes on
    assert TOK.decode(ep.gen.response_ids) == "9**9999= 1"


def test_hermes_parses_calls_and_says_what_is_wrong() -> None:
    got = hermes.parse('x <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>')
    assert (
        not isinstance(got, str) and got[0].name == "calculator" and got[0].arguments == {"expression": "1+1"}
    )
    got = hermes.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert not isinstance(got, str) and got[0].arguments == {"a": 1}
    assert hermes.parse("<tool_call>{oops</tool_call>").startswith("error: the tool call is not JSON")
    assert hermes.parse('<tool_call>["calculator"]</tool_call>').startswith("error: a tool call is")
    assert hermes.parse("no call here") == []


def test_a_call_end_of_several_tokens_is_refused() -> None:
    with pytest.raises(ConfigError, match="must be one"):
        Agent(Toolbox({}), hermes, TOK, 4)  # "</tool_call>" is no token of the character vocabulary


class DictLog:
    """A call log in a dict, as ``toolcalls:{k}`` holds it for one request."""

    def __init__(self) -> None:
        self.rows: dict[int, list[ToolResult]] = {}

    async def get(self, offset: int) -> list[ToolResult] | None:
        return self.rows.get(offset)

    async def put(self, offset: int, results: list[ToolResult]) -> None:
        self.rows[offset] = results


def test_a_redone_episode_replays_its_recorded_calls() -> None:
    """A worker dies after the first call; the episode, redone from the start elsewhere, reads
    that call's result from the log instead of calling the tool again, and comes out the same."""
    counting = Counting()

    log = DictLog()
    asyncio.run(run_episode(Scripted("1+1= 2+2= 4", preempt_at=7), _req(), _agent(calculator=counting), log))
    assert counting.calls == 1 and sorted(log.rows) == [4]  # the first call ended at offset 4 ("1+1=")
    redo = asyncio.run(run_episode(Scripted("1+1= 2+2= 4"), _req(), _agent(calculator=counting), log))
    assert counting.calls == 2  # only the second call, which the dead worker never made
    assert sorted(log.rows) == [4, 10]
    whole = run(Scripted("1+1= 2+2= 4"), _req(), _agent())
    assert redo.gen.response_ids.tolist() == whole.gen.response_ids.tolist()
    assert redo.loss_mask.tolist() == whole.loss_mask.tolist() and redo.tool_calls == 2
