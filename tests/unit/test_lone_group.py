"""``trainer.lone_group``: a step's last mini-batch of one group joins the one before (``merge``,
the default) or takes its own optimizer step (``own``), in both schedules, whether the step's count
is known from the plan or only from a seal after its last group.

The backend here records the order of its calls, so each test reads which groups each optimizer
step summed; the expected splits are written out by hand.
"""

from __future__ import annotations

import asyncio

import pytest

from rolloutpipe.broker.events import Group
from rolloutpipe.config import TrainerConfig
from rolloutpipe.roles.trainer.step import Barrier, Pipelined, StepClock
from tests.support.events import make_group


class Recorder:
    """A backend that trains nothing and logs its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def accumulate(self, group: Group) -> None:
        self.calls.append(group.group_id)

    def optimizer_step(self) -> dict[str, float]:
        self.calls.append("step")
        return {}

    def drop_gradient(self) -> None:
        self.calls.append("drop")

    def steps(self) -> list[list[str]]:
        """The groups summed into each optimizer step, in order."""
        out: list[list[str]] = []
        cur: list[str] = []
        for c in self.calls:
            if c == "step":
                out.append(cur)
                cur = []
            else:
                cur.append(c)
        assert not cur, f"groups accumulated after the last step: {cur}"
        return out


def _run(schedule: type, merge: bool, n: int, gpm: int, known: bool) -> tuple[Recorder, list[list[str]]]:
    be = Recorder()
    sched = schedule(be, StepClock(), gpm, merge_lone=merge)
    groups = [make_group().model_copy(update={"group_id": f"0:{i}"}) for i in range(n)]

    async def run() -> None:
        for i, g in enumerate(groups):
            await sched.add(g, left=n - 1 - i if known else None)
        await sched.finish()  # the seal (after the last group when the count was not known)

    asyncio.run(run())
    return be, sched.minibatches


def _ids(*ranges: range) -> list[list[str]]:
    return [[f"0:{i}" for i in r] for r in ranges]


@pytest.mark.parametrize("known", [True, False], ids=["sealed-plan", "seal-after"])
@pytest.mark.parametrize("schedule", [Pipelined, Barrier])
def test_a_lone_last_group_joins_the_minibatch_before(schedule: type, known: bool) -> None:
    be, mbs = _run(schedule, True, 9, 4, known)
    assert mbs == _ids(range(4), range(4, 9))
    assert be.steps() == mbs  # two optimizer steps, the second over 5 groups


@pytest.mark.parametrize("known", [True, False], ids=["sealed-plan", "seal-after"])
@pytest.mark.parametrize("schedule", [Pipelined, Barrier])
def test_own_gives_the_lone_group_its_optimizer_step(schedule: type, known: bool) -> None:
    be, mbs = _run(schedule, False, 9, 4, known)
    assert mbs == _ids(range(4), range(4, 8), range(8, 9))
    assert be.steps() == mbs


@pytest.mark.parametrize("n", [8, 10, 11, 12], ids=lambda n: f"{n}-groups")
@pytest.mark.parametrize("known", [True, False], ids=["sealed-plan", "seal-after"])
def test_no_lone_group_no_change(n: int, known: bool) -> None:
    """Counts that leave no lone group split as they always did; a shorter last mini-batch of 2 or
    3 groups keeps its own step."""
    want = [list(range(i, min(i + 4, n))) for i in range(0, n, 4)]
    for schedule in (Pipelined, Barrier):
        be, mbs = _run(schedule, True, n, 4, known)
        assert mbs == [[f"0:{i}" for i in r] for r in want]
        assert be.steps() == mbs


def test_pipelined_steps_each_minibatch_before_the_next_group_when_the_count_is_known() -> None:
    """Pipelining is kept: with the plan's count, each full mini-batch steps as its last group is
    in (before the next group's compute), except the one a lone group is known to follow."""
    be, _ = _run(Pipelined, True, 9, 4, True)
    assert be.calls == [*[f"0:{i}" for i in range(4)], "step", *[f"0:{i}" for i in range(4, 9)], "step"]
    be, _ = _run(Pipelined, True, 10, 4, True)
    assert be.calls[:5] == [*[f"0:{i}" for i in range(4)], "step"]
    assert be.calls[5:10] == [*[f"0:{i}" for i in range(4, 8)], "step"]


def test_pipelined_without_a_count_holds_one_group() -> None:
    """Before the seal, a full mini-batch's step waits for the group after it, and that group's
    compute for the one after it: when they come, the step is taken first, then both computed."""
    be, mbs = _run(Pipelined, True, 10, 4, False)
    assert mbs == _ids(range(4), range(4, 8), range(8, 10))
    assert be.calls == [*[f"0:{i}" for i in range(4)], "step", *[f"0:{i}" for i in range(4, 8)], "step",
                        "0:8", "0:9", "step"]  # fmt: skip


def test_one_group_minibatches_are_never_merged() -> None:
    for schedule in (Pipelined, Barrier):
        _, mbs = _run(schedule, True, 3, 1, False)
        assert mbs == _ids(range(0, 1), range(1, 2), range(2, 3))


def test_the_default_is_merge() -> None:
    assert TrainerConfig().lone_group == "merge"
    assert TrainerConfig(lone_group="own").lone_group == "own"
