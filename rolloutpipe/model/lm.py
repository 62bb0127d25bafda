"""The model: the tiny Qwen3 architecture built locally (no download), loaded, sampled and scored.

Shared by the ``transformers`` rollout engine and the torch trainer so that both compute
behaviour logprobs the same way.  torch and transformers are imported lazily: roles that
run on the emulated engine never import them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from rolloutpipe.config import Config, ModelConfig
from rolloutpipe.errors import ConfigError
from rolloutpipe.model.tokenizer import (
    BOS,
    EOS,
    PAD,
    VOCAB,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    build_tokenizer,
)

if TYPE_CHECKING:
    import torch

    from rolloutpipe.config.schema import WarmStartConfig

log = logging.getLogger("rolloutpipe.model")


class PickToken(Protocol):
    def __call__(self, i: int, t: int, last: torch.Tensor) -> tuple[int, float]: ...


TINY_CONTEXT = 128  # the built tiny model's max_position_embeddings


def context_length(cfg: ModelConfig) -> int | None:
    """The positions the model was built for (``max_position_embeddings``); None when not known."""
    if not cfg.path:
        return TINY_CONTEXT
    try:
        return int(
            json.loads((Path(cfg.path).expanduser() / "config.json").read_text())["max_position_embeddings"]
        )
    except (OSError, KeyError, TypeError, ValueError):
        return None


class PromptLength:
    """A prompt's tokens as the engines see them (the model's tokenizer, its chat template), and the
    most a prompt may have: ``task.max_prompt_length``, else the model's context."""

    def __init__(self, cfg: ModelConfig, max_prompt_length: int) -> None:
        self.tok = tokenizer_for(cfg)
        self.limit = max_prompt_length or context_length(cfg)
        self.what = "task.max_prompt_length" if max_prompt_length else "the model's context"

    def __call__(self, text: str, messages: Sequence[Any] = ()) -> int:
        return len(self.tok.encode_prompt(text, messages))


def prompt_measure(cfg: Config) -> PromptLength | None:
    """What ``task_prompts`` checks prompts with: None for engines that do not run the model
    (emulated, an ``engine_plugin``), whose prompts need not fit it."""
    if cfg.rollout.engine_plugin or cfg.rollout.engine == "emulated":
        return None
    return PromptLength(cfg.model, cfg.task.max_prompt_length)


def tokenizer_for(cfg: ModelConfig) -> Tokenizer:
    """The char tokenizer for the built tiny model; the checkpoint's own tokenizer for ``model.path``."""
    kind = cfg.tokenizer
    if kind == "auto":
        kind = "hf" if cfg.path else "char"
    if kind == "char":
        return CharTokenizer()
    return HFTokenizer(ensure_model(cfg), cfg.chat_template)


def _model_key(cfg: ModelConfig) -> str:
    d = cfg.model_dump()
    for k in ("path", "cache_dir", "tokenizer", "chat_template"):
        d.pop(k)
    if not cfg.warm_start.steps:  # the randomly initialised model keeps the key it always had
        d.pop("warm_start")
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def ensure_model(cfg: ModelConfig) -> Path:
    """Path of the tiny model; built with ``save_pretrained`` on first use and cached."""
    if cfg.path:
        return Path(cfg.path).expanduser()
    root = Path(cfg.cache_dir).expanduser()
    path = root / f"qwen3-tiny-{_model_key(cfg)}"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(cfg.seed)
    mcfg = Qwen3Config(
        vocab_size=len(VOCAB),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=TINY_CONTEXT,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(mcfg)
    if cfg.warm_start.steps:
        warm_start(model, cfg)
    tmp = root / f".tmp-{os.getpid()}-{path.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    build_tokenizer().save_pretrained(tmp)
    try:
        tmp.rename(path)  # atomic: a concurrent builder either wins or finds the finished dir
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("built tiny Qwen3 model at %s", path)
    return path


def warm_start(model: torch.nn.Module, cfg: ModelConfig) -> None:
    """Supervised steps on (prompt, answer + EOS) pairs of the warm-start dataset's train split,
    cross-entropy on the answer tokens only: the base model that RL starts from."""
    import torch

    from rolloutpipe.plugins import import_string

    ws = cfg.warm_start
    # the dataset function itself (``f(n, seed, split=...)``), not ``tasks``' loader: the model does
    # not import the tasks; a dataset without a train split is refused when the config is checked
    data = import_string(ws.dataset)(ws.steps * ws.batch_size, ws.seed, split="train")
    if not data:
        raise ConfigError(f"model.warm_start.dataset {ws.dataset!r} returned no prompts")
    codec = CharTokenizer()
    torch.manual_seed(ws.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr)
    model.train()
    threads = torch.get_num_threads()
    # one thread: the model is tiny, and on a loaded machine OpenMP's threads were 20x slower (2 s a
    # step instead of 0.1 s on 2 busy cores)
    torch.set_num_threads(1)
    try:
        _warm_steps(model, opt, ws, data, codec)
    finally:
        torch.set_num_threads(threads)
    model.eval()


def _warm_steps(
    model: torch.nn.Module, opt: Any, ws: WarmStartConfig, data: list[Any], codec: CharTokenizer
) -> None:
    loss: Any = None
    for i in range(ws.steps):
        rows = data[i * ws.batch_size : (i + 1) * ws.batch_size]
        prompts = [codec.encode_prompt(p.text) for p in rows]
        answers = [np.append(codec.encode_prompt(p.answer)[1:], EOS).astype(np.int32) for p in rows]
        logp, mask = response_logprobs(model, prompts, answers)
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    log.info("warm-started the tiny model: %d steps on %s (loss %.3f)", ws.steps, ws.dataset, loss.item())


def decode_batch(
    model: torch.nn.Module,
    prompts: list[np.ndarray],
    max_new: list[int],
    eos: int,
    pick: PickToken,
    should_stop: Callable[[int, bool], bool] | None = None,
    stop_ids: Sequence[Collection[int]] = (),
) -> tuple[list[list[int]], list[list[float]]]:
    """Autoregressive decoding of a batch, without a KV cache (the model is tiny): ``pick(i, t, logits)``
    chooses request i's token number t (0-based, in this call) from its last logits and returns it
    with its logprob.  A request stops at EOS, at one of ``stop_ids[i]`` (kept, like EOS), or after
    ``max_new[i]`` tokens.  ``should_stop(i, last)``
    (``last``: the token just picked would end the request) is asked, possibly from another thread's
    flag, before each picked token is kept: True drops that token and stops request i with the tokens
    it had (a preemption); the rest of the batch goes on.  Returns the token ids and their logprobs."""
    import torch

    resp: list[list[int]] = [[] for _ in prompts]
    lps: list[list[float]] = [[] for _ in prompts]
    active = [i for i in range(len(prompts)) if max_new[i] > 0]
    with torch.no_grad():
        while active:
            seqs = [np.concatenate([prompts[i], np.asarray(resp[i], np.int32)]) for i in active]
            ids, mask = pad_right(seqs)
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
            still = []
            for row, i in enumerate(active):
                tok, lp = pick(i, len(resp[i]), logits[row, len(seqs[row]) - 1])
                last = tok == eos or len(resp[i]) + 1 >= max_new[i] or (bool(stop_ids) and tok in stop_ids[i])
                if should_stop is not None and should_stop(i, last):
                    continue
                resp[i].append(tok)
                lps[i].append(lp)
                if not last:
                    still.append(i)
            active = still
    return resp, lps


def _draw_seed(seed: int, t: int) -> int:
    """A 64-bit seed for (request seed, response position): splitmix64 of the pair."""
    z = (seed * 0x9E3779B97F4A7C15 + t + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def sampler(temperatures: list[float], seeds: list[int], offsets: Sequence[int] = ()) -> PickToken:
    """Sampling at each request's temperature, reproducibly: the draw for response position
    ``offsets[i] + t`` (``offsets``: tokens already in the response, e.g. a migrated prefix; 0 by
    default) is a pure function of (seed, position, logits) -- a generator seeded from the pair at
    each position -- so a continuation draws what the unmigrated request would have.  Temperature
    <= 0 is greedy: the argmax, with its logprob under the untempered (T=1) log-softmax."""
    import torch

    gen = torch.Generator()
    offs = list(offsets) or [0] * len(seeds)

    def pick(i: int, t: int, last: torch.Tensor) -> tuple[int, float]:
        temp = temperatures[i]
        if temp <= 0:
            logp = torch.log_softmax(last, dim=-1)
            tok = int(torch.argmax(logp).item())
            return tok, float(logp[tok])
        logp = torch.log_softmax(last / temp, dim=-1)
        gen.manual_seed(_draw_seed(seeds[i], offs[i] + t))
        tok = int(torch.multinomial(logp.exp(), 1, generator=gen).item())
        return tok, float(logp[tok])

    return pick


def load_model(path: Path, threads: int = 1) -> torch.nn.Module:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


def pad_right(seqs: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask.  Right padding keeps positions of real tokens exact."""
    import torch

    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), PAD, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.from_numpy(s.astype(np.int64))
        mask[i, : len(s)] = 1
    return ids, mask


def engine_logprobs(samples: list[Any], like: torch.Tensor) -> torch.Tensor:
    """The engine's behaviour logprobs of each response, right-padded like ``like`` ([B, T])."""
    import torch

    out = torch.zeros_like(like)
    for i, s in enumerate(samples):
        lp: np.ndarray = s.logprobs
        out[i, : len(lp)] = torch.from_numpy(lp.astype("float32"))
    return out


def model_tokens(sample: Any) -> int:
    """How many of a sample's response tokens the model generated (an episode's tool tokens not)."""
    m: np.ndarray = sample.loss_mask
    return int(m.sum()) if len(m) else len(sample.response_ids)


def model_token_mask(samples: list[Any], like: torch.Tensor) -> torch.Tensor:
    """1 on each response token the model generated, 0 on an episode's tool and environment tokens
    (``Sample.loss_mask``) and on padding, right-padded like ``like`` ([B, T])."""
    import torch

    out = torch.zeros_like(like)
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        m: np.ndarray = s.loss_mask
        out[i, :n] = torch.from_numpy(m.astype("float32")) if len(m) else 1.0
    return out


def response_logprobs(
    model: torch.nn.Module,
    prompts: list[np.ndarray],
    responses: list[np.ndarray],
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs of each response under ``model`` ([B, Tmax]) and the response mask."""
    logp, mask, _ = response_logprobs_entropy(model, prompts, responses, temperature, entropy=False)
    return logp, mask


def response_logprobs_entropy(
    model: torch.nn.Module,
    prompts: list[np.ndarray],
    responses: list[np.ndarray],
    temperature: float = 1.0,
    entropy: bool = True,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``response_logprobs`` and, with ``entropy``, each response position's entropy ([B, Tmax])
    of the temperature-scaled distribution (verl's ``entropy_from_logits``); without
    ``entropy_grad`` it is computed outside autograd (a metric only)."""
    import torch

    from rolloutpipe.rl.grpo import token_entropy

    seqs = [np.concatenate([p, r]) for p, r in zip(prompts, responses, strict=True)]
    ids, mask = pad_right(seqs)
    logits = model(input_ids=ids, attention_mask=mask).logits
    # at least fp32 (a bf16 model's logits are upcast); an fp64 model stays fp64 (tests/e2e/test_same_maths)
    logits = (logits if logits.dtype == torch.float64 else logits.float()) / temperature
    logp_all = torch.log_softmax(logits[:, :-1], dim=-1)
    tok_logp = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, L-1]
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ent_all = token_entropy(logp_all) if entropy else None
    tmax = max(len(r) for r in responses)
    out = torch.zeros((len(seqs), tmax), dtype=tok_logp.dtype)
    ent = torch.zeros((len(seqs), tmax), dtype=tok_logp.dtype) if entropy else None
    rmask = torch.zeros((len(seqs), tmax), dtype=tok_logp.dtype)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        if len(r):
            out[i, : len(r)] = tok_logp[i, len(p) - 1 : len(p) - 1 + len(r)]
            rmask[i, : len(r)] = 1.0
            if ent is not None and ent_all is not None:
                ent[i, : len(r)] = ent_all[i, len(p) - 1 : len(p) - 1 + len(r)]
    return out, rmask, ent
