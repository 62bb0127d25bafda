"""Training backends: plain torch (CPU / one GPU), an emulated trainer for benchmarks, and
DeepSpeed ZeRO data parallel (``ds_backend``).

All implement the same calls: ``begin_step`` (freeze version k), ``accumulate(group)``
(forward + backward of one group) and ``optimizer_step`` (at a mini-batch boundary), or
``drop_gradient`` there instead (a mini-batch with no gradient, ``trainer.flat_minibatch: skip``).  The torch
and emulated backends also implement ``checkpoint.Checkpointable`` (state saved at every step
commit, loaded on resume).
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rolloutpipe.broker.events import Group, PolicyVersion
from rolloutpipe.config import Config
from rolloutpipe.model.weights import publish_weights
from rolloutpipe.rl.grpo import group_loss, norm_len, recomputes, step_stats
from rolloutpipe.roles.trainer.checkpoint import optimizer_from_safetensors, optimizer_to_safetensors

if TYPE_CHECKING:
    import torch


class Backend(Protocol):
    def begin_step(self, version: int) -> None: ...
    def accumulate(self, group: Group) -> None: ...
    def optimizer_step(self) -> dict[str, float]: ...
    def drop_gradient(self) -> None: ...  # end a mini-batch with no optimizer step
    def publish(self, root: Path, run: str, version: int) -> PolicyVersion: ...


class TorchBackend:
    """Per-group gradient accumulation; one AdamW step per mini-batch.

    Per group: the policy's forward (with entropy), the recomputed old logprobs from the frozen
    version-k copy (``old_logprobs=recompute``), the reference model's forward (``kl_coef > 0``),
    the loss of ``grpo.group_loss`` and its backward.  At the step the summed gradients are divided
    by the summed normaliser (the exactness argument in ``grpo``).
    """

    def __init__(self, cfg: Config, model: Any | None = None) -> None:
        import torch

        from rolloutpipe.model.lm import ensure_model, load_model

        self.cfg = cfg
        tc = cfg.trainer
        torch.manual_seed(tc.seed)
        self.model: torch.nn.Module = model if model is not None else load_model(ensure_model(cfg.model), 1)
        self.model.train()
        if tc.activation_checkpointing:
            checkpoint_activations(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
        self.frozen: torch.nn.Module | None = None
        # The KL reference: the initial weights (copied before any step or resume) or ref_path.
        self.ref: torch.nn.Module | None = None
        if tc.kl_coef > 0:
            ref = load_model(Path(tc.ref_path).expanduser(), 1) if tc.ref_path else copy.deepcopy(self.model)
            self.ref = ref.eval().requires_grad_(False)
        self.norm_len = norm_len(cfg)
        self.norm = 0.0
        self.sums: dict[str, float] = defaultdict(float)

    def begin_step(self, version: int) -> None:
        """Freeze a version-k copy when old logprobs are recomputed rather than taken from the engine."""
        if recomputes(self.cfg.trainer):
            self.frozen = copy.deepcopy(self.model).eval()

    def _forward_no_grad(self, model: torch.nn.Module, group: Group) -> torch.Tensor:
        import torch

        from rolloutpipe.model.lm import response_logprobs

        with torch.no_grad():
            out, _ = response_logprobs(
                model,
                [s.prompt_ids for s in group.samples],
                [s.response_ids for s in group.samples],
                group.samples[0].temperature,
            )
        return out

    def accumulate(self, group: Group) -> None:
        import torch

        from rolloutpipe.model.lm import engine_logprobs, model_token_mask, response_logprobs_entropy

        tc = self.cfg.trainer
        logp, _, ent = response_logprobs_entropy(
            self.model,
            [s.prompt_ids for s in group.samples],
            [s.response_ids for s in group.samples],
            group.samples[0].temperature,  # the engine's: the request carried it
            entropy_grad=tc.entropy_coef != 0,
        )
        mask = model_token_mask(group.samples, logp)  # an episode's tool tokens carry no loss
        engine = engine_logprobs(group.samples, logp)
        if recomputes(tc):
            assert self.frozen is not None, "begin_step() must run before accumulate()"
            old = self._forward_no_grad(self.frozen, group)
        else:
            old = engine
        ref = self._forward_no_grad(self.ref, group) if self.ref is not None else None
        adv = torch.from_numpy(group.advantages.astype("float32"))
        num, den, sums = group_loss(tc, logp, mask, adv, engine, old, ref, ent, self.norm_len)
        if num.requires_grad:  # else every response is empty: nothing to back up
            num.backward()  # type: ignore[no-untyped-call]
        self.norm += den
        for k, v in sums.items():
            self.sums[k] += v

    def optimizer_step(self) -> dict[str, float]:
        import torch

        norm = max(self.norm, 1.0)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(norm)
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        stats = {**step_stats(self.sums, norm), "grad_norm": float(gnorm)}
        self.norm = 0.0
        self.sums = defaultdict(float)
        return stats

    def drop_gradient(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.norm = 0.0
        self.sums = defaultdict(float)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def checkpoint_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        """Model weights and AdamW state (tensors to safetensors, scalars to JSON; no pickle)."""
        opt_tensors, opt_meta = optimizer_to_safetensors(self.opt)
        return {"model": self.state_dict(), "optimizer": opt_tensors}, {"optimizer": opt_meta}

    def load_checkpoint_state(
        self, tensors: dict[str, dict[str, torch.Tensor]], meta: dict[str, Any]
    ) -> None:
        self.model.load_state_dict(tensors["model"])
        optimizer_from_safetensors(self.opt, tensors["optimizer"], meta["optimizer"])
        self.opt.zero_grad(set_to_none=True)

    def publish(self, root: Path, run: str, version: int) -> PolicyVersion:
        return publish_weights(
            self.model.state_dict(), root, run, version, keep=self.cfg.trainer.keep_versions
        )


def checkpoint_activations(model: Any) -> None:
    """HF's gradient checkpointing, non-reentrant (it needs no input that requires grad)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def emulated_passes(cfg: Config) -> float:
    """What the emulated trainer charges a token, in forward+backward passes.

    The cost model: one forward+backward of the policy (1), plus ``forward_pass_cost`` (~1/3: a
    forward-only pass, the backward costing about twice the forward) for each extra forward the
    trainer makes: the reference model when ``kl_coef > 0``, the version-k copy when old logprobs
    are recomputed, and the policy's forward again in the backward with
    ``activation_checkpointing``; nothing for the other options (clipping, entropy, aggregation
    and TIS reuse tensors the policy's forward already made).  Nothing is charged for a pass the
    configured trainer does not make.  With all three: 2.0 passes, against 1.85 measured on an
    H200 (configs/bench/measured/h200-hf-2026-12-04.txt: recompute + forward / plain fwd+bwd).
    """
    tc = cfg.trainer
    forwards = int(tc.kl_coef > 0) + int(recomputes(tc)) + int(tc.activation_checkpointing)
    return 1.0 + tc.emulated.forward_pass_cost * forwards


def emulated_group_s(cfg: Config, tokens: int) -> float:
    """Emulated seconds the emulated trainer charges one group of ``tokens`` (prompt + response)."""
    ec = cfg.trainer.emulated
    return ec.call_overhead_s + tokens * emulated_passes(cfg) / ec.tokens_per_s


class EmulatedBackend:
    """Sleeps through the training time the configured real trainer would spend (benchmarks):
    ``emulated_group_s`` a group, ``optimizer_step_s`` a mini-batch (``EmulatedTrainerConfig``)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.ec = cfg.trainer.emulated

    def begin_step(self, version: int) -> None:
        pass

    def accumulate(self, group: Group) -> None:
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in group.samples)
        time.sleep(emulated_group_s(self.cfg, tokens) * self.ec.time_scale)

    def optimizer_step(self) -> dict[str, float]:
        time.sleep(self.ec.optimizer_step_s * self.ec.time_scale)
        return {"loss": 0.0, "grad_norm": 0.0, "clipfrac": 0.0}

    def drop_gradient(self) -> None:
        pass  # no optimizer step, so none of its time

    def checkpoint_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        return {}, {}  # nothing beyond the step, which the checkpoint records itself

    def load_checkpoint_state(
        self, tensors: dict[str, dict[str, torch.Tensor]], meta: dict[str, Any]
    ) -> None:
        pass

    def publish(self, root: Path, run: str, version: int) -> PolicyVersion:
        return PolicyVersion(
            run=run, step=version, policy_version=version, path="", sha256={}, published_at=time.time()
        )


def make_backend(cfg: Config) -> Backend:
    if cfg.trainer.backend == "emulated":
        return EmulatedBackend(cfg)
    if cfg.trainer.backend == "deepspeed":  # rank 0; the other ranks run ds_backend.follow
        from rolloutpipe.roles.trainer.ds_backend import DeepSpeedBackend

        return DeepSpeedBackend(cfg)
    return TorchBackend(cfg)
