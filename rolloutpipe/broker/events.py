"""The wire schema: one pydantic model per event kind.

Every event carries ``kind``, ``schema_version``, ``run``, ``step`` and
``policy_version``.  Token ids and logprobs are numpy arrays on the Python
side and packed little-endian bytes on the wire (never lists of ints).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, model_validator

SCHEMA_VERSION = 4  # 4: episodes (Sample.loss_mask, turns, tool_calls; RolloutRequest.prefix_mask)
# 3: a request may resume a migrated one (prefix_ids, prefix_logprobs, segment, origin)
# 2: per-group sample counts (GroupPlan, Allocation, StepSeal, GroupStats); no mode


def _packer(dtype: str) -> tuple[BeforeValidator, PlainSerializer]:
    np_dtype = np.dtype(dtype)

    def validate(v: Any) -> np.ndarray:
        if isinstance(v, np.ndarray):
            return np.ascontiguousarray(v, dtype=np_dtype)
        if isinstance(v, bytes | bytearray | memoryview):
            n = memoryview(v).nbytes
            if n % np_dtype.itemsize:
                raise ValueError(f"packed {dtype} array has {n} bytes, not a multiple of {np_dtype.itemsize}")
            return np.frombuffer(v, dtype=np_dtype).copy()  # one copy: the array owns its memory
        if isinstance(v, list | tuple):
            try:
                arr = np.asarray(v, dtype=np_dtype)
            except (TypeError, OverflowError) as e:  # pydantic only turns ValueError into a validation error
                raise ValueError(f"not a {dtype} array: {e}") from e
            if arr.ndim != 1:
                raise ValueError(f"expected a 1-d {dtype} array, got shape {arr.shape}")
            return arr
        raise ValueError(f"expected packed {dtype} bytes, got {type(v).__name__}")

    def serialize(v: np.ndarray) -> bytes:
        return np.ascontiguousarray(v, dtype=np_dtype).tobytes()

    return BeforeValidator(validate), PlainSerializer(serialize, return_type=bytes)


Int32Array = Annotated[np.ndarray, *_packer("<i4")]
Float32Array = Annotated[np.ndarray, *_packer("<f4")]
UInt8Array = Annotated[np.ndarray, *_packer("u1")]


def _mask_fits(mask: np.ndarray, n: int, what: str) -> None:
    """An episode's loss mask: empty (every token the model's) or one 0/1 a token."""
    if len(mask) and len(mask) != n:
        raise ValueError(f"{len(mask)} loss-mask entries for {n} {what} tokens")
    if len(mask) and int(mask.max()) > 1:
        raise ValueError("a loss mask holds 0 (a tool's or the environment's token) or 1 (the model's)")


class Event(BaseModel):
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    kind: str
    schema_version: int = SCHEMA_VERSION
    run: str
    step: int
    policy_version: int


class RolloutRequest(Event):
    """One sample to generate: request ``sample_index`` of group ``group_id``."""

    kind: Literal["request"] = "request"
    request_id: str
    group_id: str
    prompt_index: int
    sample_index: int
    prompt: str
    answer: str
    seed: int
    max_new_tokens: int
    temperature: float = 1.0
    minibatch_hint: int = 0
    # The step's request count when the policy releases the whole step at once (FIFO): an engine
    # may then queue its share of it.  0: admit only into free slots (the policy orders admission).
    queue_share_of: int = 0
    # The group's frontier rank (lower: needed sooner by the trainer).  An engine that queues
    # requests admits lower values first, and one that preempts (vLLM's ``priority`` scheduling)
    # preempts higher values first.  vLLM's convention: lower value, higher priority.
    priority: int = 0
    released_at: float
    # A dataset that gives the prompt as a conversation: its chat messages ({"role", "content"}),
    # which an engine with a chat template encodes; ``prompt`` is then their contents, joined.
    messages: list[dict[str, str]] = Field(default_factory=list)
    # What a verl ``compute_score`` or a slime reward function is also handed (``tasks/reward.py``):
    # the row's ``data_source`` and its metadata (verl's ``extra_info``, slime's ``metadata``).
    data_source: str = ""
    extra_info: dict[str, Any] = Field(default_factory=dict)
    # Long-tail migration (``docs/architecture.md``, of that name).  A request preempted while
    # decoding is put back as a *continuation*: the same request, with the response so far as
    # ``prefix_ids`` and the behaviour logprobs of those tokens as ``prefix_logprobs``.  An engine
    # resumes after prompt + prefix, on the same policy version and seed, and returns the whole
    # response (prefix included); ``max_new_tokens`` still bounds the whole response (an engine
    # handed a prefix that already fills it returns the prefix as a "length" response).  ``segment``
    # counts the preemptions so far, ``origin`` is the ``requests`` entry id of segment 0 (the key
    # under which the request's sample goes out once) and ``admitted_at`` when segment 0 started.
    prefix_ids: Int32Array = Field(default_factory=lambda: np.zeros(0, np.int32))
    prefix_logprobs: Float32Array = Field(default_factory=lambda: np.zeros(0, np.float32))
    # An episode's continuation: which prefix tokens are the model's (1) and which a tool's (0);
    # empty: all the model's.  Its completed turns' tool results are in the prefix, never re-called.
    prefix_mask: UInt8Array = Field(default_factory=lambda: np.zeros(0, np.uint8))
    # Token ids that end a turn besides EOS (an episode's tool-call end): the engine stops after
    # generating one, keeps it in the response, and says "stop".
    stop_token_ids: list[int] = Field(default_factory=list)
    segment: int = Field(default=0, ge=0)
    origin: str = ""
    admitted_at: float = 0.0

    @model_validator(mode="after")
    def _prefix_consistent(self) -> RolloutRequest:
        if len(self.prefix_logprobs) != len(self.prefix_ids):
            raise ValueError(f"{len(self.prefix_logprobs)} prefix logprobs for {len(self.prefix_ids)} tokens")
        _mask_fits(self.prefix_mask, len(self.prefix_ids), "prefix")
        if (self.segment == 0) != (not self.origin):
            raise ValueError(
                "a continuation (segment > 0) names its origin entry, and only a continuation does"
            )
        return self


class Sample(Event):
    """One generated response with its behaviour logprobs and reward."""

    kind: Literal["sample"] = "sample"
    sample_id: str
    request_id: str
    group_id: str
    prompt_index: int
    sample_index: int
    worker: str
    prompt_ids: Int32Array
    response_ids: Int32Array
    logprobs: Float32Array
    # finite and bounded: a NaN or huge reward would turn the group's advantages into NaN
    reward: float = Field(allow_inf_nan=False, ge=-1e6, le=1e6)
    finish_reason: str = "stop"
    temperature: float = 1.0  # the sampling temperature the logprobs are taken at (the trainer's too)
    released_at: float = 0.0  # when the controller released the request (admission latency)
    admitted_at: float
    finished_at: float
    # How many workers generated it: 1, or 1 + the times it was migrated (its response and
    # logprobs are still one trajectory's: each continuation resumed after the previous segments).
    segments: int = Field(default=1, ge=1)
    # when the engine preempted it for KV-cache memory (it re-queued it and recomputed its prefix)
    kv_preempted_at: list[float] = Field(default_factory=list)
    # A multi-turn episode (docs/agents.md): per response token, 1 if the model generated it and 0
    # if a tool or the environment wrote it (no loss; its logprob is 0); empty: a single turn, every
    # token the model's.  ``turns``: where each model turn starts in the response; ``tool_calls``:
    # the calls the episode made.
    loss_mask: UInt8Array = Field(default_factory=lambda: np.zeros(0, np.uint8))
    turns: list[int] = Field(default_factory=list)
    tool_calls: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _one_logprob_per_token(self) -> Sample:
        if len(self.logprobs) != len(self.response_ids):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.response_ids)} response tokens")
        _mask_fits(self.loss_mask, len(self.response_ids), "response")
        return self


class FrontierStatus(BaseModel):
    """Where a group falls in the step's training order."""

    model_config = ConfigDict(extra="forbid")

    minibatch: int
    position: int  # 0-based position in the step's FIFO order
    minibatch_size: int  # groups per mini-batch
    needed: int  # groups this mini-batch still needs after this one
    total_groups: int


AllocStatus = Literal["open", "final", "closed", "skipped"]


class AllocationRecord(BaseModel):
    """How a group came to its final count: planned, extended, closed early, and why."""

    model_config = ConfigDict(extra="forbid")

    initial: int  # samples planned for the group at plan time
    counts: list[int] = Field(default_factory=list)  # the count after each decision, in order
    status: AllocStatus = "final"
    reason: str = ""


class Group(Event):
    """A complete group: the samples of one prompt its allocation kept, with group-relative advantages."""

    kind: Literal["group"] = "group"
    group_id: str
    prompt_index: int
    samples: list[Sample]
    advantages: Float32Array
    frontier: FrontierStatus
    allocation: AllocationRecord
    completed_at: float

    @model_validator(mode="after")
    def _complete(self) -> Group:
        if not self.samples:
            raise ValueError("a group has at least one sample")
        if len(self.advantages) != len(self.samples):
            raise ValueError(f"{len(self.advantages)} advantages for {len(self.samples)} samples")
        if not np.isfinite(self.advantages).all():
            raise ValueError("advantages must be finite")
        return self


class GroupPlan(BaseModel):
    """One group of a step: its prompt and the samples allocated to it when the step was planned."""

    model_config = ConfigDict(extra="forbid")

    group_id: str
    prompt_index: int
    n: int = Field(ge=1)
    # True: the count will not change (the aggregator emits the group at ``n`` samples).  False:
    # the policy may extend, close or skip it, and an ``Allocation`` will say when it is final.
    final: bool = True


class StepPlan(Event):
    """What step ``step`` rolls out (groups, their counts) and how it is cut into mini-batches."""

    kind: Literal["plan"] = "plan"
    policy: str  # the controller's policy (name or dotted path), for the record
    groups: list[GroupPlan]
    minibatches: int = Field(ge=1)
    groups_per_minibatch: int = Field(ge=1)
    # True: no group will be added or skipped, so the trainer expects exactly ``len(groups)``.
    # False: the trainer learns the step's group count from a ``StepSeal`` on ``groups``.
    sealed: bool = True
    # The dataset-stream position of the step's first prompt (``StepInfo.first_prompt``); -1: step x
    # prompts per step (a plan written before the stream was kept).
    first_prompt: int = -1
    created_at: float

    @property
    def n_groups(self) -> int:
        return len(self.groups)

    @property
    def n_requests(self) -> int:
        return sum(g.n for g in self.groups)


class Allocation(Event):
    """The controller's decision on one group after the plan: its count now, and whether it is final.

    Written to the ``alloc:k`` hash (the record) and to ``samples`` (the aggregator's news) in one
    MULTI.  ``revision`` orders the decisions on one group; older ones are ignored.
    """

    kind: Literal["allocation"] = "allocation"
    group_id: str
    prompt_index: int
    n: int = Field(ge=0)  # samples 0..n-1 belong to the group
    completed: int = Field(default=0, ge=0)  # samples 0..completed-1 were complete at the decision
    # their rewards and lengths: what the policy decided on, given back to a restarted controller
    rewards: Float32Array = Field(default_factory=lambda: np.zeros(0, np.float32))
    lengths: Int32Array = Field(default_factory=lambda: np.zeros(0, np.int32))
    final: bool
    status: AllocStatus
    reason: str = ""
    initial: int
    counts: list[int] = Field(default_factory=list)
    revision: int = Field(ge=1)
    minibatch_hint: int = 0
    created_at: float

    def record(self) -> AllocationRecord:
        return AllocationRecord(
            initial=self.initial, counts=self.counts, status=self.status, reason=self.reason
        )


class StepSeal(Event):
    """The number of groups the trainer gets in a step whose plan was not sealed (skips, refills)."""

    kind: Literal["seal"] = "seal"
    n_groups: int = Field(ge=0)
    skipped: list[str] = Field(default_factory=list)
    created_at: float


class GroupStats(Event):
    """Feedback, aggregator -> controller: samples 0..n-1 of a group are complete.

    ``emitted``: the group went to the trainer with these samples.  Otherwise the controller's
    policy decides (extend, close, skip, or finalize).
    """

    kind: Literal["group_stats"] = "group_stats"
    group_id: str
    prompt_index: int
    n: int
    rewards: Float32Array
    lengths: Int32Array
    truncated: int
    emitted: bool
    created_at: float


class PolicyVersion(Event):
    """Weights for ``policy_version`` are published at ``path``; ``sha256`` per file."""

    kind: Literal["policy_version"] = "policy_version"
    path: str
    sha256: dict[str, str]
    published_at: float


class StepMetrics(Event):
    """Observed per-step measurements, written by the trainer."""

    kind: Literal["metrics"] = "metrics"
    mode: str  # the preset's name (sync, cgp, cgp-fgd) or ``schedule/policy``
    rollout_to_train_end_s: float
    trainer_wait_ratio: float
    first_group_s: float
    reward_mean: float
    groups: int
    samples: int
    tokens: int
    fence_rejections: int
    dead_letters: int
    train_busy_s: float
    rollout_makespan_s: float
    last_minibatch_train_s: float
    last_group_train_s: float = 0.0  # the last group's forward/backward plus the final optimizer step
    dispatch_latency_p50_s: float
    dispatch_latency_p99_s: float
    admission_latency_p50_s: float = 0.0  # request released -> admitted into an engine
    # allocation: groups the policy skipped, and rollouts released for the step that were not
    # trained (a skipped group's, a closed group's beyond its count: aborted or discarded)
    groups_skipped: int = 0
    samples_wasted: int = 0
    # responses whose verifier raised or timed out, scored 0 (a reclaimed request may count twice)
    verifier_errors: int = 0
    verifier_timeouts: int = 0
    # episodes (task.tools): the calls the step's trained samples made, and the tool failures of the
    # step's episodes (a raise, a malformed or unknown call; a timeout; output cut or not text)
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_bad_output: int = 0
    minibatches: list[list[str]] = Field(default_factory=list)
    # indices into ``minibatches`` of those that took no optimizer step (``trainer.flat_minibatch``)
    flat_minibatches: list[int] = Field(default_factory=list)
    step_start: float = 0.0
    train_end: float = 0.0
    # held-out reward of the weights this step made (version k+1), when eval.every says so, and the
    # seconds it took (after train_end, before the version is published: not in the step's timings)
    eval_reward: float | None = None
    eval_s: float = 0.0
    # its 95% interval over the eval prompts, and (with task.tools) the share of eval episodes that
    # called a tool
    eval_lo: float | None = None
    eval_hi: float | None = None
    eval_tool_rate: float | None = None
    # the backend's optimizer-step stats (loss, grad_norm, clipfrac, kl, entropy, ...), averaged over
    # the step's mini-batches
    train: dict[str, float] = Field(default_factory=dict)


class DeadLetter(Event):
    """Anything that could not be used, with the reason.  Nothing is dropped silently."""

    kind: Literal["dead_letter"] = "dead_letter"
    source_stream: str
    entry_id: str
    role: str
    reason: str
    payload: bytes
    created_at: float


class Lease(Event):
    """A pool's decision: ``worker`` serves ``to_run`` from now on (``""``: no run).  On the pool's
    ``leases`` stream; ``run`` is the pool's namespace (``pool:NAME``), ``step`` and
    ``policy_version`` are -1."""

    kind: Literal["lease"] = "lease"
    worker: str
    from_run: str
    to_run: str
    policy: str
    shares: dict[str, int]  # workers per run after this decision
    created_at: float


AnyEvent = Annotated[
    RolloutRequest
    | Sample
    | Group
    | StepPlan
    | Allocation
    | StepSeal
    | GroupStats
    | PolicyVersion
    | StepMetrics
    | DeadLetter
    | Lease,
    Field(discriminator="kind"),
]
