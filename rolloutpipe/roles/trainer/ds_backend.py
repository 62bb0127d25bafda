"""DeepSpeed ZeRO data-parallel trainer: rank 0 is the trainer role, the other ranks follow it.

Launch: ``torchrun --nproc_per_node N -m -- rolloutpipe trainer CONFIG --redis-url … --run … --out
…`` with ``trainer.backend=deepspeed`` (the ``--`` keeps torchrun's argparse from taking ``--run``
for its own ``--run-path``), or the ``deepspeed`` launcher; started alone it is a world of one.
Rank 0 alone talks to Redis: it runs the unchanged ``Trainer`` (reader, version fence, dedupe of
consumed groups, acks after publish), so the fence and exactly-once hold exactly as for one
process.  Its backend, ``DeepSpeedBackend``, broadcasts every call (begin_step, accumulate,
optimizer_step, publish, stop) to the other ranks over a gloo group of its own (so it also works
when the main group is nccl): a msgpack message in a uint8 tensor, length first, then bytes; a
group travels as the codec's msgpack bytes, never pickle.  Ranks > 0 run ``follow``: receive a
command, make the same call.  While idle, rank 0 pings every ``PING_S``; a follower exits when its
leader's connection drops, or after ``LEADER_TIMEOUT_S`` of silence.

Every rank receives the whole group and computes on its share of the samples (``i % world ==
rank``); a rank with no sample backs up an exact zero through a one-token forward, because ZeRO's
reductions (and ZeRO-3's parameter gathers) need every rank.  The mini-batch normaliser N (token
or sequence count) is counted from the whole group on every rank: no communication.

Same maths as ``TorchBackend``: the update is AdamW on ``clip(sum of per-token losses over the
mini-batch / N)``, with N known only when ``optimizer_step`` is called.  DeepSpeed runs with
``managed_gradient_accumulation: false``: ``backward`` only accumulates (ZeRO-2/3 reduce-scatter
into their partitions as they go) and ``step()`` is the boundary whenever the caller says, so no
gradient-accumulation count is fixed.  Each rank backs up its *sum* with loss scale 1 (gas 1,
``scale_wrt_gas=False``) and DeepSpeed averages over ranks, so the partitions hold ``sum / world``.
Just before ``step()`` the ZeRO optimizer's loss scale is set to ``N / world``: ZeRO divides the
gradients by it (``unscale_and_clip_grads``) and clips the unscaled norm by
``max(1, (‖g‖ / scale + 1e-6) / grad_clip)``, ``clip_grad_norm_``'s rule applied to ``sum / N``;
then the scale goes back to 1.  AdamW is torch's (``torch_adam``: nothing is JIT-compiled) with
torch's defaults.  So the two differ only in float summation order: in fp32 the pre-clip
gradient norms agree to ~1e-7 relative, the weights to ≤ 1e-4 (AdamW magnifies rounding on
elements whose gradient is near zero; ``tests/deepspeed``).  bf16 works through the ZeRO
optimizers; a setup that makes DeepSpeed pick ``BF16_Optimizer`` instead (bf16 with an fp32
``grad_accum_dtype`` at stage 1), which ignores the loss scale, is refused.

Old logprobs: the engine's (group samples) or, with ``trainer.old_logprobs=recompute`` (the old
name ``frozen`` is accepted), a plain module on every rank that ``begin_step`` fills with the full
version-k weights (gathered under ZeRO-3).  The loss is ``grpo.group_loss``, as in
``TorchBackend``: every aggregation mode (the normaliser counted from the whole group with
``grpo.group_normaliser``), asymmetric and dual clipping, the log-ratio clamp and the entropy
term, truncated importance sampling.  ``kl_coef > 0`` is refused at config load
(``TrainerConfig``): this backend loads no reference model yet.  ``publish`` gathers the full
weights to rank 0 (layer by layer under ZeRO-3; in the engine's dtype), which writes safetensors +
sha256 manifest after releasing the followers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
import logging
import os
import socket
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.events import Group, PolicyVersion
from rolloutpipe.config import Config
from rolloutpipe.errors import ConfigError, RolloutPipeError
from rolloutpipe.model.weights import publish_weights
from rolloutpipe.rl.grpo import (
    TOKEN_STATS,
    group_loss,
    group_normaliser,
    norm_len,
    recomputes,
    step_stats,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger("rolloutpipe.trainer")

PING_S = 5.0  # rank 0 pings the followers this often while it waits for groups
LEADER_TIMEOUT_S = 120.0  # a follower gives up on a silent rank 0 after this long
STOP_GRACE_S = 10.0  # a signalled follower waits this long for rank 0's stop


def rank() -> int:
    """This process's global rank under torchrun / the deepspeed launcher (0 when launched alone)."""
    return int(os.environ.get("RANK", "0"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _deepspeed(sub: str = "") -> Any:
    """deepspeed (or one of its modules), imported only here: the core runs without it."""
    return importlib.import_module(f"deepspeed.{sub}" if sub else "deepspeed")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def ds_config(cfg: Config) -> dict[str, Any]:
    """The generated DeepSpeed config, with ``trainer.deepspeed.extra`` merged over it."""
    tc, dc = cfg.trainer, cfg.trainer.deepspeed
    base: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,  # optimizer_step() is the boundary (see above)
        "gradient_clipping": tc.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": tc.lr,
                "weight_decay": tc.weight_decay,
                "betas": [0.9, 0.999],  # torch.optim.AdamW's defaults, as TorchBackend uses
                "eps": 1e-8,
                "torch_adam": True,
            },
        },
        "zero_optimization": {"stage": dc.zero_stage},
        "bf16": {"enabled": dc.dtype == "bf16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    return _merge(base, dc.extra)


class _Replica:
    """One rank: a DeepSpeed engine and the GRPO loss on this rank's share of each group."""

    def __init__(self, cfg: Config) -> None:
        import torch
        import torch.distributed as dist

        from rolloutpipe.model.lm import ensure_model, load_model
        from rolloutpipe.roles.trainer.backends import checkpoint_activations

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # it logs its whole config at INFO
        # DeepSpeed calls the collectives torch renamed, once a step each: not ours to fix
        warnings.filterwarnings("ignore", r"`torch\.distributed\.\w+` is deprecated", FutureWarning)
        self.cfg = cfg
        tc, dc = cfg.trainer, cfg.trainer.deepspeed
        if "RANK" not in os.environ:  # launched alone: a world of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        cuda = torch.cuda.is_available()
        backend = dc.dist_backend if dc.dist_backend != "auto" else ("nccl" if cuda else "gloo")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cuda", local) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(self.device)
        deepspeed = _deepspeed()
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # Commands and stats travel on CPU tensors over gloo, whatever the main group is.
        self.cmd = dist.new_group(backend="gloo", timeout=timedelta(seconds=LEADER_TIMEOUT_S))
        torch.manual_seed(tc.seed)
        self.path = ensure_model(cfg.model)
        model = load_model(self.path, 1)
        model.train()
        if tc.activation_checkpointing:
            checkpoint_activations(model)
        self.engine, self.opt, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config(cfg)
        )
        if getattr(self.engine, "managed_gradient_accumulation", lambda: True)():
            raise ConfigError(
                f"deepspeed {deepspeed.__version__}: this backend needs managed_gradient_accumulation "
                "false (deepspeed >= 0.19.8), and trainer.deepspeed.extra must not turn it back on"
            )
        zero = (
            _deepspeed("runtime.zero.stage_1_and_2").DeepSpeedZeroOptimizer,
            _deepspeed("runtime.zero.stage3").DeepSpeedZeroOptimizer_Stage3,
        )
        if not isinstance(self.opt, zero):
            raise ConfigError(
                f"trainer.deepspeed: DeepSpeed chose {type(self.opt).__name__}, which ignores the loss "
                "scale this backend normalises with; use a ZeRO optimizer (no fp32 grad_accum_dtype "
                "with bf16 and zero_stage 1)"
            )
        self.opt.override_loss_scale(1.0)
        self.zero3 = dc.zero_stage == 3
        self.dtype = torch.bfloat16 if dc.dtype == "bf16" else torch.float32
        self.frozen: torch.nn.Module | None = None
        self.norm_len = norm_len(cfg)
        self.norm = 0.0
        self.sums: dict[str, float] = {}
        log.info("rank %d/%d: ZeRO-%d, %s, %s", self.rank, self.world, dc.zero_stage, dc.dtype, backend)

    # --- commands over the gloo group -------------------------------------------------------
    def send(self, msg: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        data = msgpack.packb(msg, use_bin_type=True)
        dist.broadcast(torch.tensor([len(data)], dtype=torch.int64), src=0, group=self.cmd)
        dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), src=0, group=self.cmd)

    def recv(self) -> dict[str, Any]:
        import torch
        import torch.distributed as dist

        n = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(n, src=0, group=self.cmd)
        buf = torch.empty(int(n.item()), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.cmd)
        msg = msgpack.unpackb(buf.numpy().tobytes(), raw=False, strict_map_key=True)
        if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
            raise RolloutPipeError(f"rank {self.rank}: malformed command from rank 0")
        return msg

    # --- the backend calls, run identically on every rank -----------------------------------
    def begin_step(self, version: int) -> None:
        """Fill the frozen version-k copy when old logprobs are recomputed rather than the engine's."""
        if not recomputes(self.cfg.trainer):
            return
        import torch

        from rolloutpipe.model.lm import load_model

        if self.frozen is None:
            self.frozen = load_model(self.path, 1).to(device=self.device, dtype=self.dtype).eval()
            self.frozen.requires_grad_(False)
        params = dict(self.engine.module.named_parameters())
        gathered = _deepspeed().zero.GatheredParameters(list(params.values()), modifier_rank=None)
        with gathered, torch.no_grad():
            for name, p in self.frozen.named_parameters():
                p.copy_(params[name].data)

    def _recomputed(self, samples: list[Any]) -> torch.Tensor:
        import torch

        from rolloutpipe.model.lm import response_logprobs

        assert self.frozen is not None, "begin_step() must run before accumulate()"
        with torch.no_grad():
            old, _ = response_logprobs(
                self.frozen,
                [s.prompt_ids for s in samples],
                [s.response_ids for s in samples],
                samples[0].temperature,
            )
        return old

    def accumulate(self, group: Group) -> None:
        import torch

        from rolloutpipe.model.lm import (
            engine_logprobs,
            model_token_mask,
            model_tokens,
            response_logprobs_entropy,
        )
        from rolloutpipe.model.tokenizer import BOS

        tc = self.cfg.trainer
        mine = group.samples[self.rank :: self.world]
        lengths = [model_tokens(s) for s in group.samples]  # an episode's tool tokens carry no loss
        self.norm += group_normaliser(lengths, tc.loss_agg, self.norm_len)  # the whole group's
        num: torch.Tensor | None = None
        with torch.device(self.device):  # policy.response_logprobs builds its tensors here
            if mine:
                logp, _, ent = response_logprobs_entropy(
                    self.engine,
                    [s.prompt_ids for s in mine],
                    [s.response_ids for s in mine],
                    mine[0].temperature,  # the engine's: the request carried it
                    entropy_grad=tc.entropy_coef != 0,
                )
                mask = model_token_mask(mine, logp)
                engine = engine_logprobs(mine, logp)
                old = self._recomputed(mine) if recomputes(tc) else engine
                adv = torch.from_numpy(group.advantages[self.rank :: self.world].astype("float32"))
                # kl_coef > 0 is refused for this backend at config load (no reference model)
                num, _, sums = group_loss(
                    tc, logp, mask, adv.to(self.device), engine, old, None, ent, self.norm_len,
                    group_tokens=float(sum(lengths)),  # a group mean over the whole group, every rank
                )  # fmt: skip
                for k, v in sums.items():
                    self.sums[k] = self.sums.get(k, 0.0) + v
            if num is None or not num.requires_grad:  # nothing here: back up an exact zero
                logits = self.engine(input_ids=torch.tensor([[BOS]])).logits
                num = logits.float().sum() * 0.0
        self.engine.backward(num, scale_wrt_gas=False)

    def optimizer_step(self) -> dict[str, float]:
        import torch
        import torch.distributed as dist

        norm = max(self.norm, 1.0)
        self.opt.override_loss_scale(norm / self.world)  # ZeRO divides by it: sum / world -> sum / N
        self.engine.step()
        self.opt.override_loss_scale(1.0)
        keys = ("loss", "tokens", *(k for k in TOKEN_STATS if k != "kl"))
        sums = torch.tensor([self.sums.get(k, 0.0) for k in keys], dtype=torch.float64)
        dist.all_reduce(sums, group=self.cmd)
        gnorm = self.engine.get_global_grad_norm()
        self.norm, self.sums = 0.0, {}
        got = {k: float(x) for k, x in zip(keys, sums, strict=True)}
        if self.cfg.trainer.tis_cap <= 0:
            got.pop("tis_weight")
        stats = step_stats(got, norm)
        return {**stats, "grad_norm": float(gnorm) if gnorm is not None else float("nan")}

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The full weights on rank 0 (None elsewhere); every rank must call it."""
        if self.zero3:
            state: dict[str, torch.Tensor] | None = self.engine._zero3_consolidated_16bit_state_dict()
            return state
        if self.rank != 0:
            return None
        return {k: v.detach().cpu() for k, v in self.engine.module.state_dict().items()}

    def close(self) -> None:
        import torch.distributed as dist

        self.engine.destroy()
        dist.destroy_process_group()


class DeepSpeedBackend:
    """Rank 0's backend: each call is broadcast to the followers, then made here too."""

    def __init__(self, cfg: Config) -> None:
        if rank() != 0:
            raise RolloutPipeError("DeepSpeedBackend runs on rank 0; the other ranks run follow()")
        self.cfg = cfg
        self.rep = _Replica(cfg)
        self.lock = threading.Lock()  # one command at a time, pings only between commands
        self.last_send = time.monotonic()
        self.closed = threading.Event()
        self.pinger: threading.Thread | None = None
        if self.rep.world > 1:
            self.pinger = threading.Thread(target=self._ping, name="ds-ping", daemon=True)
            self.pinger.start()

    def _send(self, op: str, **kw: Any) -> None:
        if self.rep.world > 1:
            self.rep.send({"op": op, **kw})
        self.last_send = time.monotonic()

    def _ping(self) -> None:
        while not self.closed.wait(PING_S / 2):
            with self.lock:
                if self.closed.is_set():
                    return
                if time.monotonic() - self.last_send >= PING_S:
                    try:
                        self._send("ping")
                    except RuntimeError:
                        log.exception("ping to the DeepSpeed followers failed")
                        return

    def begin_step(self, version: int) -> None:
        with self.lock:
            self._send("begin_step", version=version)
            self.rep.begin_step(version)

    def accumulate(self, group: Group) -> None:
        with self.lock:
            self._send("accumulate", group=DEFAULT_CODEC.encode(group))
            self.rep.accumulate(group)

    def optimizer_step(self) -> dict[str, float]:
        with self.lock:
            self._send("optimizer_step")
            return self.rep.optimizer_step()

    def drop_gradient(self) -> None:  # the config refuses flat_minibatch=skip with this backend
        raise NotImplementedError("the deepspeed backend always steps (trainer.flat_minibatch=step)")

    def publish(self, root: Path, run: str, version: int) -> PolicyVersion:
        with self.lock:
            self._send("publish")
            state = self.rep.full_state()
        assert state is not None, "rank 0 holds the gathered weights"
        return publish_weights(state, root, run, version, keep=self.cfg.trainer.keep_versions)

    def close(self) -> None:
        """Release the followers (they exit) and tear down the process groups."""
        if self.closed.is_set():
            return
        with self.lock:
            self.closed.set()
            try:
                self._send("stop")
            except RuntimeError as e:  # a follower already gone (a signal to the whole job)
                log.warning("could not tell the DeepSpeed followers to stop: %s", e)
        if self.pinger is not None:
            self.pinger.join()
        self.rep.close()


def follow(cfg: Config) -> int:
    """Ranks > 0: make each call rank 0 broadcasts until it says stop."""
    rep = _Replica(cfg)
    calls = 0
    while True:
        msg = rep.recv()
        op = msg["op"]
        if op == "ping":
            continue
        if op == "stop":
            break
        calls += 1
        if op == "begin_step":
            rep.begin_step(int(msg["version"]))
        elif op == "accumulate":
            rep.accumulate(DEFAULT_CODEC.decode_as(msg["group"], Group))
        elif op == "optimizer_step":
            rep.optimizer_step()
        elif op == "publish":
            rep.full_state()
        else:
            raise RolloutPipeError(f"rank {rep.rank}: unknown command {op!r} from rank 0")
    log.info("rank %d: rank 0 said stop after %d calls", rep.rank, calls)
    rep.close()
    return 0


async def run_follower(cfg: Config, stop: asyncio.Event) -> int:
    """``follow`` in a thread, so that a signal still ends the process."""
    fut: concurrent.futures.Future[int] = concurrent.futures.Future()

    def target() -> None:
        try:
            fut.set_result(follow(cfg))
        except BaseException as e:  # handed to the event loop below
            fut.set_exception(e)

    threading.Thread(target=target, name="ds-follower", daemon=True).start()
    done = asyncio.wrap_future(fut)
    stopped = asyncio.ensure_future(stop.wait())
    waiters: list[asyncio.Future[Any]] = [done, stopped]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not done.done():  # a signal: rank 0 most likely got one too, and will say stop
        await asyncio.wait([done], timeout=STOP_GRACE_S)
    if not done.done():
        log.warning("rank %d: stopped by a signal; rank 0 did not say stop", rank())
        return 0
    try:
        return done.result()
    except Exception:
        log.exception("rank %d: failed while following rank 0", rank())
        return 1
