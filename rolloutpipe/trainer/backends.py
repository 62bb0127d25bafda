"""Training backends: plain torch (CPU / one GPU), an emulated trainer for benchmarks, and
DeepSpeed ZeRO data parallel (``ds_backend``).

All implement the same calls: ``begin_step`` (freeze version k), ``accumulate(group)``
(forward + backward of one group) and ``optimizer_step`` (at a mini-batch boundary).  The torch
and emulated backends also implement ``checkpoint.Checkpointable`` (state saved at every step
commit, loaded on resume).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rolloutpipe.broker.events import Group, PolicyVersion
from rolloutpipe.config import Config
from rolloutpipe.trainer.checkpoint import optimizer_from_safetensors, optimizer_to_safetensors
from rolloutpipe.trainer.grpo import aggregate_sum, clipped_token_loss
from rolloutpipe.trainer.weights import publish_weights

if TYPE_CHECKING:
    import torch


class Backend(Protocol):
    def begin_step(self, version: int) -> None: ...
    def accumulate(self, group: Group) -> None: ...
    def optimizer_step(self) -> dict[str, float]: ...
    def publish(self, root: Path, run: str, version: int) -> PolicyVersion: ...


class TorchBackend:
    """Per-group gradient accumulation; one AdamW step per mini-batch."""

    def __init__(self, cfg: Config, model: Any | None = None) -> None:
        import torch

        from rolloutpipe.policy import ensure_model, load_model

        self.cfg = cfg
        tc = cfg.trainer
        torch.manual_seed(tc.seed)
        self.model: torch.nn.Module = model if model is not None else load_model(ensure_model(cfg.model), 1)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=tc.lr, weight_decay=tc.weight_decay)
        self.frozen: torch.nn.Module | None = None
        self.norm = 0.0
        self.loss_sum = 0.0
        self.clipfrac_num = 0.0

    def begin_step(self, version: int) -> None:
        """Freeze a version-k copy when old logprobs are recomputed rather than taken from the engine."""
        if self.cfg.trainer.old_logprobs == "frozen":
            self.frozen = copy.deepcopy(self.model).eval()

    def _old_logprobs(self, group: Group, logp: torch.Tensor) -> torch.Tensor:
        import torch

        from rolloutpipe.policy import response_logprobs

        if self.cfg.trainer.old_logprobs == "frozen":
            assert self.frozen is not None, "begin_step() must run before accumulate()"
            with torch.no_grad():
                old, _ = response_logprobs(
                    self.frozen,
                    [s.prompt_ids for s in group.samples],
                    [s.response_ids for s in group.samples],
                    group.samples[0].temperature,
                )
            return old
        old = torch.zeros_like(logp)
        for i, s in enumerate(group.samples):
            old[i, : len(s.logprobs)] = torch.from_numpy(s.logprobs.astype("float32"))
        return old

    def accumulate(self, group: Group) -> None:
        import torch

        from rolloutpipe.policy import response_logprobs

        tc = self.cfg.trainer
        logp, mask = response_logprobs(
            self.model,
            [s.prompt_ids for s in group.samples],
            [s.response_ids for s in group.samples],
            group.samples[0].temperature,  # the engine's: the request carried it
        )
        old = self._old_logprobs(group, logp.detach())
        adv = torch.from_numpy(group.advantages.astype("float32"))
        losses, clipped = clipped_token_loss(logp, old, adv, tc.clip_eps)
        num, den = aggregate_sum(losses, mask, tc.loss_agg)
        num.backward()  # type: ignore[no-untyped-call]
        self.norm += den
        self.loss_sum += float(num.item())
        self.clipfrac_num += float((clipped.float() * mask).sum().item())

    def optimizer_step(self) -> dict[str, float]:
        import torch

        norm = max(self.norm, 1.0)
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.div_(norm)
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        stats = {
            "loss": self.loss_sum / norm,
            "grad_norm": float(gnorm),
            "clipfrac": self.clipfrac_num / norm,
        }
        self.norm = self.loss_sum = self.clipfrac_num = 0.0
        return stats

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


class EmulatedBackend:
    """Sleeps through the training time of the tokens it is given (benchmarks)."""

    def __init__(self, cfg: Config) -> None:
        self.ec = cfg.trainer.emulated

    def _sleep_for_tokens(self, tokens: int, passes: float) -> None:
        time.sleep(tokens * passes / self.ec.tokens_per_s * self.ec.time_scale)

    def begin_step(self, version: int) -> None:
        pass

    def accumulate(self, group: Group) -> None:
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in group.samples)
        self._sleep_for_tokens(tokens, 1.0 + self.ec.logprob_pass_factor)

    def optimizer_step(self) -> dict[str, float]:
        return {"loss": 0.0, "grad_norm": 0.0, "clipfrac": 0.0}

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
        from rolloutpipe.trainer.ds_backend import DeepSpeedBackend

        return DeepSpeedBackend(cfg)
    return TorchBackend(cfg)
