"""The scheduler seam: what a policy sees, what it may decide, and the default answers.

A policy is pure: no Redis, no asyncio, no clock.  The controller (``controller.py``) does the
I/O.  It feeds the policy three kinds of event and applies the decisions it returns:

* ``plan(info)``: the groups of a step, with each group's initial sample count, and whether that
  count is final.
* ``admit(view, free)``: which requests to release now, given ``free`` engine slots.  It is
  called whenever capacity frees, a group completes, or a decision changes the step.
* ``on_stats(view, group)``: samples ``0..n-1`` of ``group`` are complete and their rewards are
  known.  For a group that is not final yet, the policy may extend it, finalize it, close it
  (keep the completed samples, abort the rest) or skip it.  It may also add groups to the step.

Membership follows allocation, never arrival order.  A group keeps samples ``0..n-1`` of its final
count ``n``, and a decision about ``n`` is made only from rewards of *completed* rounds.  Closing a
group keeps a count of samples already complete, so the finishing order of responses, and so their
length, never decides which samples are trained.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from rolloutpipe.config import ControllerConfig
from rolloutpipe.errors import ConfigError


@dataclass(frozen=True, slots=True)
class PromptRecord:
    """One finished group of a prompt in an earlier step (the per-prompt history)."""

    step: int
    n: int
    reward_mean: float
    reward_std: float
    pass_rate: float  # share of rewards > 0
    mean_length: float
    truncated_frac: float
    trained: bool = True  # False: the group was skipped (a pilot, a flat group): seen, not trained


@dataclass(frozen=True)
class PrevStep:
    """Observed timings of the previous step (the trainer's ``StepMetrics``)."""

    step: int
    train_busy_s: float
    rollout_makespan_s: float
    first_group_s: float = 0.0


@dataclass(frozen=True)
class StepInfo:
    """What a policy knows when it plans step ``step``."""

    step: int
    prompts: Sequence[int]  # the dataset's next prompts for this step, in order (prompts_per_step)
    group_size: int  # the configured G
    minibatches: int
    n_prompts: int  # prompts in the dataset
    prev: PrevStep | None
    history: Mapping[int, Sequence[PromptRecord]]
    # The dataset is a stream of prompts (position p is prompt p mod n_prompts); this step starts
    # at ``first_prompt``.  A policy with ``stream`` set may draw beyond the step's B; the next step
    # starts where it stopped (``Policy.next_prompt``).  Otherwise every step starts at step x B.
    first_prompt: int = -1

    def __post_init__(self) -> None:
        if self.first_prompt < 0:
            object.__setattr__(self, "first_prompt", self.step * len(self.prompts))


@dataclass(frozen=True)
class GroupSpec:
    """One planned group: its prompt, its initial count, and whether that count is final."""

    prompt_index: int
    n: int
    final: bool = True


GroupStatus = Literal["open", "final", "closed", "skipped"]


@dataclass
class GroupView:
    """The controller's picture of one group, updated from releases, completions and decisions."""

    group_id: str
    prompt_index: int
    order: int  # position in the plan (added groups come after)
    minibatch: int  # the mini-batch the plan meant it for
    initial: int
    target: int  # samples allocated now: 0..target-1
    final: bool
    status: GroupStatus = "open"
    released: int = 0
    completed: int = 0  # samples 0..completed-1 are complete (the last GroupStats)
    emitted: bool = False
    added: bool = False  # added to the step by the policy (AddGroup), not planned
    counts: list[int] = field(default_factory=list)  # the initial count, then after each extend or close
    revision: int = 0  # decisions taken on the group
    rewards: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    truncated: int = 0
    # Frontier rank stamped on the group's requests (``RolloutRequest.priority``; lower: sooner).  The
    # plan's mini-batch unless a policy ranks groups otherwise (it may set it before a release).
    priority: int = -1

    def __post_init__(self) -> None:
        if self.priority < 0:
            self.priority = self.minibatch

    @property
    def unreleased(self) -> int:
        return max(0, self.target - self.released) if self.status in ("open", "final") else 0

    @property
    def started(self) -> bool:
        return self.released > 0

    @property
    def waiting(self) -> bool:
        """All allocated samples are complete but the count is not final: a decision is due."""
        return self.status == "open" and not self.final and self.completed >= self.target


@dataclass
class StepView:
    """The step as the policy sees it."""

    step: int
    minibatches: int
    groups_per_minibatch: int
    groups: dict[str, GroupView]
    capacity: int = 0  # engine slots of the live workers
    kv_tokens: int = 0  # the live workers' KV cache in tokens; 0 if any reports none (unlimited or unknown)
    inflight: int = 0  # requests released and not yet finished
    emitted: int = 0  # groups sent to the trainer so far
    history: Mapping[int, Sequence[PromptRecord]] = field(default_factory=dict)
    first_prompt: int = 0  # the stream position the step started at (``StepInfo.first_prompt``)


@dataclass(frozen=True)
class Release:
    """Release ``n`` more requests of a group to the engines."""

    group_id: str
    n: int


@dataclass(frozen=True)
class Extend:
    """Allocate ``n`` more samples to a group; ``final``: no more after these."""

    group_id: str
    n: int
    final: bool = True
    reason: str = ""


@dataclass(frozen=True)
class Finalize:
    """The group's current count is final: send it to the trainer once complete."""

    group_id: str
    reason: str = ""


@dataclass(frozen=True)
class Close:
    """Final at ``keep`` samples (at most the completed ones); in-flight requests are aborted."""

    group_id: str
    keep: int
    reason: str


@dataclass(frozen=True)
class Skip:
    """Do not train the group; its in-flight requests are aborted, its samples discarded."""

    group_id: str
    reason: str


@dataclass(frozen=True)
class AddGroup:
    """Add a group to the step (a refill): ``prompt_index`` or, if None, the dataset's next prompt."""

    n: int
    final: bool = True
    prompt_index: int | None = None
    reason: str = ""


Decision = Extend | Finalize | Close | Skip | AddGroup


class Policy(Protocol):
    """What the controller needs of a policy (``BasePolicy`` gives every default)."""

    # True when requests are released for the whole step at once (FIFO): engines may queue their
    # share.  False: the policy orders admission itself, so engines admit only into free slots.
    engine_queue: bool
    # True when the policy may skip or add groups: the trainer then waits for the step's seal.
    changes_groups: bool
    # Records kept per prompt for the policy to read (``StepInfo.history``): 0 keeps none.  The
    # history is bounded by the dataset (prompts x this), in the controller and in Redis.
    history: int
    # True when the policy draws prompts from the dataset's stream beyond the step's own (candidate
    # pools, refills): the next step then starts at ``next_prompt(view)``, not at (step + 1) x B.
    stream: bool

    def plan(self, info: StepInfo) -> list[GroupSpec]: ...

    def admit(self, view: StepView, free: int) -> list[Release]: ...

    def on_stats(self, view: StepView, group: GroupView) -> list[Decision]: ...

    def next_prompt(self, view: StepView) -> int: ...


class BasePolicy:
    """GRPO's fixed allocation, released in plan order: G samples per prompt, all at once."""

    engine_queue = True
    changes_groups = False
    history = 0
    stream = False

    def __init__(self, cfg: ControllerConfig, **args: Any) -> None:
        if args:
            raise ConfigError(f"{type(self).__name__} takes no policy_args, got {sorted(args)}")
        self.cfg = cfg

    def plan(self, info: StepInfo) -> list[GroupSpec]:
        return [GroupSpec(p, info.group_size) for p in info.prompts]

    def admit(self, view: StepView, free: int) -> list[Release]:
        return [Release(g.group_id, g.unreleased) for g in in_order(view) if g.unreleased]

    def on_stats(self, view: StepView, group: GroupView) -> list[Decision]:
        return [Finalize(group.group_id)] if group.waiting else []

    def next_prompt(self, view: StepView) -> int:
        """The stream position after the step (read only when ``stream``): one past its last group,
        every group drawn in order (``AddGroup`` without a prompt takes the next position)."""
        return view.first_prompt + len(view.groups)


def in_order(view: StepView) -> list[GroupView]:
    return sorted(view.groups.values(), key=lambda g: g.order)
