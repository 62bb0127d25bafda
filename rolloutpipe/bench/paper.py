"""``rolloutpipe bench``: the same workload in ``sync``, ``cgp``, ``cgp-fgd`` and controls, side by side.

Each (setting, mode) is a separate run (own stream namespace) on one Redis, with real role
processes, the emulated engine and the emulated trainer.  Every figure comes from observed
timestamps: sample admission/completion stamped by the workers, group reads and busy intervals
stamped by the trainer.

* ``rolloutpipe bench`` runs one quick setting (``configs/bench-quick.yaml``);
* ``rolloutpipe bench --suite paper`` runs the 12 settings of ``configs/bench/paper.yaml``.
"""

from __future__ import annotations

import fnmatch
import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from rolloutpipe.bench.bound import Bound, EngineModel, TrainerModel, r2t_bound, wait_ratio_bound
from rolloutpipe.bench.harness import (
    CONFIGS,
    Suite,
    flatten,
    register,
    session,
    spec_path,
    where,
    write_results,
)
from rolloutpipe.bench.oracle import oracle, replay, sync_model
from rolloutpipe.bench.paper_report import mode_table, suite_table
from rolloutpipe.broker.events import StepMetrics
from rolloutpipe.config import Config, load_config
from rolloutpipe.errors import ConfigError
from rolloutpipe.launch.cluster import run_cluster

DEFAULT_CONFIG = CONFIGS / "bench-quick.yaml"
KEYS = ("rollout_to_train_end_s", "trainer_wait_ratio", "first_group_s", "dispatch_latency_p50_s",
        "dispatch_latency_p99_s", "admission_latency_p50_s", "rollout_makespan_s", "last_minibatch_train_s",
        "last_group_train_s", "train_busy_s")  # fmt: skip


# Each mode of the bench: its config overrides.  sync/cgp/cgp-fgd are the paper's presets; the rest
# are controls and ablations, so that each mechanism is measured on and off in the same run:
# cgp-late is FIFO with late assignment (load balancing without FGD's order), fgd-no-length and
# fgd-no-window are cgp-fgd without one of its two mechanisms, fgd-no-kvguard without the guard that
# keeps the plan's order where the length order's tail would overflow the KV cache, fgd-critical
# with the critical (long groups first) rule in front of shortest first (off by default).
MODE_SPECS: dict[str, list[str]] = {
    "sync": ["controller.mode=sync"],
    "cgp": ["controller.mode=cgp"],
    "cgp-late": ["trainer.schedule=pipelined", "controller.policy=fifo-late"],
    "cgp-fgd": ["controller.mode=cgp-fgd"],
    "fgd-no-length": ["controller.mode=cgp-fgd", "controller.fgd_length_aware=false"],
    "fgd-no-window": ["controller.mode=cgp-fgd", "controller.fgd_window=off"],
    "fgd-no-kvguard": ["controller.mode=cgp-fgd", "controller.fgd_kv_guard=false"],
    "fgd-critical": ["controller.mode=cgp-fgd", "controller.fgd_critical=true"],
}
DEFAULT_MODES = ("sync", "cgp", "cgp-late", "cgp-fgd")
# Student's t, 97.5th percentile, by degrees of freedom (1.96 only beyond 30)
T95 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
       11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
       20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048,
       29: 2.045, 30: 2.042}  # fmt: skip


def interval(xs: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t-interval of ``xs`` (paired per-step figures, so step-to-step workload
    differences cancel); a single value has no interval (infinitely wide: never "beyond" it)."""
    n = len(xs)
    m = statistics.fmean(xs)
    if n < 2:
        return m, -math.inf, math.inf
    h = T95.get(n - 1, 1.96) * statistics.stdev(xs) / n**0.5
    return m, m - h, m + h


def median_metrics(ms: list[StepMetrics], skip_first: bool = True) -> dict[str, float]:
    use = ms[1:] if skip_first and len(ms) > 1 else ms
    out: dict[str, float] = {k: statistics.median(getattr(m, k) for m in use) for k in KEYS}
    out["overhead_frac"] = (out["admission_latency_p50_s"] + out["dispatch_latency_p50_s"]) / out[
        "rollout_to_train_end_s"
    ]
    out["steps_measured"] = len(use)
    return out


def models(cfg: Config) -> tuple[EngineModel, TrainerModel]:
    """The emulated engine's and trainer's cost models, as the bound and the oracle read them."""
    from rolloutpipe.roles.trainer.backends import emulated_passes

    ec, tc = cfg.rollout.emulated, cfg.trainer.emulated
    eng = EngineModel(cfg.rollout.workers, ec.max_num_seqs, ec.decode_base_s, ec.decode_per_seq_s,
                      ec.prefill_per_token_s * ec.prompt_tokens, ec.time_scale, kv_tokens=ec.kv_cache_tokens,
                      kv_block_tokens=ec.kv_block_tokens, decode_per_kv_token_s=ec.decode_per_kv_token_s,
                      prefill_per_token_s=ec.prefill_per_token_s, preemption=ec.preemption)  # fmt: skip
    gpm = cfg.controller.prompts_per_step // cfg.controller.minibatches
    tr = TrainerModel(tc.tokens_per_s, emulated_passes(cfg), tc.call_overhead_s, tc.optimizer_step_s, gpm,
                      tc.time_scale)  # fmt: skip
    return eng, tr


def step_workloads(timeline: Path) -> dict[int, list[list[tuple[int, int]]]]:
    """Per recorded step, its groups' samples as (prompt tokens, response tokens)."""
    out = {}
    for line in timeline.read_text().splitlines():
        rec = json.loads(line)
        groups = [[(s[3], s[4]) for s in g["samples"]] for g in rec["groups"]]
        if groups:
            out[rec["step"]] = groups
    return out


def step_replays(timeline: Path, eng: EngineModel, tr: TrainerModel, barrier: bool) -> dict[int, float]:
    """Per recorded step, the run's own decisions played on the model (``oracle.replay``): each
    sample on the worker that ran it, in the order it was admitted there."""
    out = {}
    for line in timeline.read_text().splitlines():
        rec = json.loads(line)
        by: dict[str, list[tuple[float, int, int]]] = {}
        for gi, g in enumerate(rec["groups"]):
            for si, smp in enumerate(g["samples"]):
                by.setdefault(smp[0], []).append((smp[1], gi, si))
        if by:
            groups = [[(s[3], s[4]) for s in g["samples"]] for g in rec["groups"]]
            placed = [[(gi, si) for _, gi, si in sorted(by[w])] for w in sorted(by)]
            out[rec["step"]] = replay(groups, placed, eng, tr, barrier)
    return out


def step_bounds(cfg: Config, timeline: Path) -> dict[int, Bound]:
    """The r2t bound of every recorded step, from its samples' lengths (``bench/bound.py``)."""
    eng, tr = models(cfg)
    return {k: r2t_bound(groups, eng, tr) for k, groups in step_workloads(timeline).items()}


def pack_workload(groups: list[list[tuple[int, int]]]) -> dict[str, list[Any]]:
    """A step's workload for results.json: one prompt length a group (its samples share the prompt)."""
    return {"prompt": [g[0][0] for g in groups], "response": [[rt for _, rt in g] for g in groups]}


def unpack_workload(w: dict[str, list[Any]]) -> list[list[tuple[int, int]]]:
    return [[(int(p), int(r)) for r in rs] for p, rs in zip(w["prompt"], w["response"], strict=True)]


def kv_preemptions(timeline: Path) -> dict[int, int]:
    """Per recorded step, how many times a KV-limited engine preempted one of its samples."""
    out = {}
    for line in timeline.read_text().splitlines():
        rec = json.loads(line)
        if rec["groups"]:
            out[rec["step"]] = sum(len(smp[5]) for g in rec["groups"] for smp in g["samples"] if len(smp) > 5)
    return out


def worker_split(timeline: Path, workers: int) -> dict[int, float]:
    """Per recorded step, the largest share of its response tokens that one rollout worker ran, as a
    multiple of an even split (1.0: each of the ``workers`` ran 1/workers; ``workers``: one ran all).
    A sample counts where it finished (a migrated one's earlier segments count there too)."""
    out = {}
    for line in timeline.read_text().splitlines():
        rec = json.loads(line)
        by: dict[str, int] = {}
        for g in rec["groups"]:
            for smp in g["samples"]:
                by[smp[0]] = by.get(smp[0], 0) + int(smp[4])
        if by and sum(by.values()) > 0:
            out[rec["step"]] = max(by.values()) / sum(by.values()) * max(workers, len(by))
    return out


def derive(setting: dict[str, Any]) -> None:
    """Per mode, paired with sync step by step: reductions, share of the achievable cut, with
    intervals; and the bound's violations, which would mean the emulation or the bound is wrong."""
    steps = setting["steps"]
    sync = setting["per_step"]["sync"]
    bound = setting["bound_per_step"]
    # the modelled wait ratio: the step's r2t less the trainer's modelled work (the bound's
    # train_busy: the cost model's time for the step's groups, the same in every mode, since a
    # request's length is a function of its id), over its r2t.  The wall-clock ratio uses the
    # trainer's measured busy time, which the pipelined modes inflate (a group trained while the
    # broker and the other roles share the CPU takes longer than its model)
    modelled = {name: {k: wait_ratio_bound(bound[k]["terms"]["train_busy"], ms[k]["r2t"]) for k in steps}
                for name, ms in setting["per_step"].items()}  # fmt: skip
    for name, ms in setting["per_step"].items():
        m = setting["modes"][name]
        wm = modelled[name]
        m["trainer_wait_ratio_modelled"] = statistics.median(wm.values())
        m["wait_ratio_modelled_reduction_vs_sync"] = interval(
            [1 - wm[k] / modelled["sync"][k] for k in steps if modelled["sync"][k] > 0] or [0.0]
        )
        red = [1 - ms[k]["r2t"] / sync[k]["r2t"] for k in steps]
        wred = [1 - ms[k]["wait"] / sync[k]["wait"] for k in steps if sync[k]["wait"] > 0]
        share = [(sync[k]["r2t"] - ms[k]["r2t"]) / (sync[k]["r2t"] - bound[k]["r2t"]) for k in steps
                 if sync[k]["r2t"] > bound[k]["r2t"]]  # fmt: skip
        m["reduction_vs_sync"] = interval(red)
        m["wait_ratio_reduction_vs_sync"] = interval(wred or [0.0])
        m["share_of_cut"] = interval(share or [0.0])
        m["bound_violations"] = sum(1 for k in steps if ms[k]["r2t"] < bound[k]["r2t"] * (1 - 1e-3))
    ps = setting["per_step"]

    def gain(on: str, off: str) -> tuple[float, float, float]:  # what ``on`` saves over ``off``, paired
        return interval([(ps[off][k]["r2t"] - ps[on][k]["r2t"]) / sync[k]["r2t"] for k in steps])

    if "cgp" in ps and "cgp-fgd" in ps:
        setting["fgd_minus_cgp"] = gain("cgp-fgd", "cgp")
        if "fgd-no-kvguard" in ps:  # what the KV guard buys
            setting["kv_guard_gain"] = gain("cgp-fgd", "fgd-no-kvguard")
        # what the critical rule buys: fgd-critical against cgp-fgd (the rule off, the default), or,
        # in runs from when it was on by default, cgp-fgd against fgd-no-critical
        if "fgd-critical" in ps:
            setting["critical_gain"] = gain("fgd-critical", "cgp-fgd")
        elif "fgd-no-critical" in ps:
            setting["critical_gain"] = gain("cgp-fgd", "fgd-no-critical")
    setting["achievable_cut"] = interval([1 - bound[k]["r2t"] / sync[k]["r2t"] for k in steps])
    setting["wait_bound"] = statistics.fmean(bound[k]["wait"] for k in steps)
    setting["achievable_wait_cut"] = interval(
        [1 - bound[k]["wait"] / sync[k]["wait"] for k in steps if sync[k]["wait"] > 0] or [0.0]
    )
    setting["achievable_wait_cut_modelled"] = interval(
        [1 - bound[k]["wait"] / modelled["sync"][k] for k in steps if modelled["sync"][k] > 0] or [0.0]
    )
    if "workload_per_step" in setting and "models" in setting:
        derive_oracle(setting)


def derive_oracle(setting: dict[str, Any]) -> None:
    """The oracle (``bench/oracle.py``) per step, and each mode against it.

    Cuts are relative, each against its own sync: the oracle's and the bound's against sync on the
    model, a mode's measured r2t against the measured sync; a mode's share of the oracle's cut is
    the ratio of the two relative cuts (so the broker's overhead, which slows every mode alike, does
    not count as a loss of the oracle's cut).  The modelled wait ratios: the trainer's modelled work
    over each r2t, as in :func:`derive`.
    """
    steps = setting["steps"]
    eng, tr = EngineModel(**setting["models"]["engine"]), TrainerModel(**setting["models"]["trainer"])
    work = {int(k): unpack_workload(w) for k, w in setting["workload_per_step"].items()}
    if "oracle_per_step" not in setting:  # computed once; a re-derive keeps it
        setting["oracle_per_step"] = {}
        for k in steps:
            o = oracle(work[k], eng, tr)
            setting["oracle_per_step"][k] = {"r2t": o.r2t, "schedule": o.schedule, "fifo": o.fifo,
                                             "sync": sync_model(work[k], eng, tr),
                                             "preemptions": o.preemptions}  # fmt: skip
    orc = {int(k): v for k, v in setting["oracle_per_step"].items()}
    setting["oracle_per_step"] = orc
    bound, sync = setting["bound_per_step"], setting["per_step"]["sync"]
    busy = {k: bound[k]["terms"]["train_busy"] for k in steps}
    setting["oracle_s"] = statistics.median(orc[k]["r2t"] for k in steps)
    setting["sync_model_s"] = statistics.median(orc[k]["sync"] for k in steps)
    cut = {k: 1 - orc[k]["r2t"] / orc[k]["sync"] for k in steps}
    setting["oracle_cut"] = interval(list(cut.values()))
    setting["bound_cut_model"] = interval([1 - bound[k]["r2t"] / orc[k]["sync"] for k in steps])
    setting["oracle_schedules"] = sorted({orc[k]["schedule"] for k in steps})
    if eng.kv_tokens:
        setting["oracle_kv_preemptions"] = statistics.median(orc[k].get("preemptions", 0) for k in steps)
    wait = {k: wait_ratio_bound(busy[k], orc[k]["r2t"]) for k in steps}
    sync_wait = {k: wait_ratio_bound(busy[k], orc[k]["sync"]) for k in steps}
    setting["oracle_wait_cut_modelled"] = interval(
        [1 - wait[k] / sync_wait[k] for k in steps if sync_wait[k] > 0] or [0.0]
    )
    for name, ms in setting["per_step"].items():
        m = setting["modes"][name]
        shares = [(1 - ms[k]["r2t"] / sync[k]["r2t"]) / cut[k] for k in steps if cut[k] > 0]
        m["share_of_oracle_cut"] = interval(shares or [0.0])
        rp = setting.get("replay_per_step", {}).get(name)
        if rp:
            rp = {int(k): v for k, v in rp.items()}
            setting["replay_per_step"][name] = rp
            m["replay_r2t_s"] = statistics.median(rp[k] for k in steps)
            m["replay_gap"] = statistics.median(ms[k]["r2t"] / rp[k] - 1 for k in steps)


def window_steps(out: Path) -> int:
    """Steps in which cgp-fgd's window was on (from the controller's log)."""
    log = out / "logs" / "controller.log"
    if not log.exists():
        return 0
    return sum(1 for line in log.read_text().splitlines() if "-> window on" in line)


def run_setting(
    name: str, overrides: list[str], base: Path, url: str, out: Path, bar: Any = None,
    modes: tuple[str, ...] = DEFAULT_MODES, trainer: str = "",
) -> dict[str, Any]:  # fmt: skip
    per_step: dict[str, dict[int, dict[str, float]]] = {}
    results: dict[str, Any] = {}
    bounds: dict[int, Bound] = {}
    workloads: dict[int, list[list[tuple[int, int]]]] = {}
    replays: dict[str, dict[int, float]] = {}
    steps: list[int] = []
    wsteps = 0
    for mode in modes:
        cfg = load_config(
            base,
            [*overrides, *MODE_SPECS[mode], f"run={name}-{mode}", f"out={out / name / mode}",
             "trainer.record_timeline=true"],
            environ={},
        )  # fmt: skip
        ms = run_cluster(cfg, url, Path(cfg.out), progress=False, timeout_s=1800)
        results[mode] = median_metrics(ms)
        steps = [m.step for m in ms[1:]] if len(ms) > 1 else [m.step for m in ms]
        split = worker_split(Path(cfg.out) / "timeline.jsonl", cfg.rollout.workers)
        measured = [split[k] for k in steps if k in split]
        if measured:  # even work (issue 26): a worker may take more than its share of a step
            results[mode]["worker_imbalance"] = statistics.median(measured)
        timeline = Path(cfg.out) / "timeline.jsonl"
        eng, tr = models(cfg)
        kv = cfg.rollout.emulated.kv_cache_tokens
        if kv:  # the timelines mark each preemption; the median over the measured steps
            pre = kv_preemptions(timeline)
            results[mode]["kv_preemptions"] = statistics.median(pre.get(k, 0) for k in steps)
        else:  # a replay with a cache would need each request's engine priority, which is not recorded
            replays[mode] = step_replays(timeline, eng, tr, barrier=mode == "sync")
        if mode == "sync":  # a request's length is a function of its id: the same in every mode
            bounds = step_bounds(cfg, timeline)
            workloads = step_workloads(timeline)
        if mode == "cgp-fgd":
            wsteps = window_steps(Path(cfg.out))
        per_step[mode] = {m.step: {"r2t": m.rollout_to_train_end_s, "wait": m.trainer_wait_ratio} for m in ms}
        if bar is not None:
            bar.update(1)
    setting: dict[str, Any] = {
        "name": name,
        "time_scale": cfg.rollout.emulated.time_scale,
        "steps": steps,
        "modes": results,
        "per_step": per_step,
        "bound_per_step": {
            k: {"r2t": b.r2t, "wait": wait_ratio_bound(b.train_busy, b.r2t), "terms": asdict(b)}
            for k, b in bounds.items()
        },
        "window_steps": wsteps,
        "trainer": trainer,
        "workload": name.removesuffix(f"-{trainer}") if trainer else name,
        "kv_cache_tokens": kv,
        "workload_per_step": {k: pack_workload(workloads[k]) for k in steps if k in workloads},
        "replay_per_step": replays,
        "models": {"engine": asdict(eng), "trainer": asdict(tr)},
    }
    setting["bound_s"] = statistics.median(setting["bound_per_step"][k]["r2t"] for k in steps)
    derive(setting)
    try:
        from rolloutpipe.tools.timeline import plot_setting

        setting["timeline_png"] = str(plot_setting(out / name, name, modes))
    except ImportError:  # matplotlib is a dependency; a missing picture must not lose the numbers
        pass
    return setting


def load_suite(name: str) -> tuple[Path, list[tuple[str, list[str], str]], tuple[str, ...]]:
    """The suite's hardware file, its settings (name, overrides, trainer configuration) and modes.

    With a ``trainers`` map, every setting runs once under each trainer configuration (its name
    ends with the configuration's); without one, once under the hardware file's trainer.  A suite's
    ``overrides`` map applies to every setting, after the workload's and before the setting's own."""
    path = spec_path(name)
    if not path.exists():
        raise ConfigError(f"benchmark suite {name!r} not found (looked for {path})")
    spec = yaml.safe_load(path.read_text())
    base = path.parent / spec["hardware"]
    trainers = {k: flatten(v or {}) for k, v in (spec.get("trainers") or {"": {}}).items()}
    common = flatten(spec.get("overrides") or {})
    settings = []
    for wname, wfile in spec["workloads"].items():
        wover = flatten(yaml.safe_load((path.parent / wfile).read_text()) or {})
        for s in spec["settings"]:
            extra = {k: v for k, v in s.items() if k != "name"}
            for tname, tover in trainers.items():
                sname = f"{wname}-{s['name']}" + (f"-{tname}" if tname else "")
                settings.append((sname, [*wover, *common, *flatten(extra), *tover], tname))
    modes = tuple(spec.get("modes", DEFAULT_MODES))
    unknown = [m for m in modes if m not in MODE_SPECS]
    if unknown or "sync" not in modes:
        raise ConfigError(f"suite {name!r}: modes must include sync and be among {sorted(MODE_SPECS)}")
    return base, settings, modes


def select(settings: list[tuple[str, list[str], str]], only: str) -> list[tuple[str, list[str], str]]:
    """The settings whose name matches one of ``only``'s comma-separated globs (all, for "")."""
    globs = [g.strip() for g in only.split(",") if g.strip()]
    return [s for s in settings if not globs or any(fnmatch.fnmatchcase(s[0], g) for g in globs)]


def pick_modes(suite_modes: tuple[str, ...], modes: str) -> tuple[str, ...]:
    """``--modes``: those comma-separated modes, sync first, instead of the suite's (all, for "")."""
    if not modes:
        return suite_modes
    asked = [m.strip() for m in modes.split(",") if m.strip()]
    unknown = [m for m in asked if m not in MODE_SPECS]
    if unknown:
        raise ConfigError(f"--modes: unknown {unknown} (the modes: {', '.join(MODE_SPECS)})")
    return ("sync", *dict.fromkeys(m for m in asked if m != "sync"))


def run_bench(
    config: str | None,
    out: Path,
    overrides: list[str],
    *,
    steps: int | None = None,
    url: str = "",
    progress: bool = True,
    suite: str = "",
    scale: float | None = None,
    only: str = "",
    modes: str = "",
) -> tuple[str, str]:
    """Run the benchmark; returns the table and a line saying where the results are.  ``only``: globs
    (``fnmatch``, comma-separated); a suite's setting runs if its name matches one of them.
    ``modes``: comma-separated modes of :data:`MODE_SPECS` to run instead of the suite's (sync is
    always run, first: every figure is paired with it)."""
    extra = list(overrides)
    if steps is not None:
        extra.append(f"controller.steps={steps}")
    if scale is not None:
        extra += [f"rollout.emulated.time_scale={scale}", f"trainer.emulated.time_scale={scale}"]
    run_modes: tuple[str, ...] = DEFAULT_MODES
    if suite:
        base, settings, run_modes = load_suite(suite)
        chosen = select(settings, only)
        if not chosen:
            names = ", ".join(n for n, _, _ in settings)
            raise ConfigError(
                f"--only {only!r} matches no setting of suite {suite!r} (its settings: {names})"
            )
        settings = [(n, [*o, *extra], t) for n, o, t in chosen]
    elif only:
        raise ConfigError("--only selects settings of a suite (--suite paper|paper-kv)")
    else:
        base = Path(config) if config else DEFAULT_CONFIG
        settings = [("quick", extra, "")]
    run_modes = pick_modes(run_modes, modes)
    load_config(base, settings[0][1], environ={})  # fail fast on a bad config, before any process starts
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with session(url, progress=progress, total=len(settings) * len(run_modes), desc="bench") as s:
        for name, over, trainer in settings:
            s.label(name)
            results.append(run_setting(name, over, base, s.url, out, s, run_modes, trainer))
    wall_s = s.wall_s
    doc = {"suite": suite or "quick", "wall_s": wall_s, "settings": results}
    text = mode_table(results[0]) if len(results) == 1 else suite_table(results)
    write_results(out, doc, text)
    return text, where(out, wall_s)


def workload_name(s: dict[str, Any]) -> str:
    """A setting's name without its trainer configuration's suffix."""
    t = s.get("trainer", "")
    return str(s.get("workload") or (s["name"].removesuffix(f"-{t}") if t else s["name"]))


def adopt_workloads(doc: dict[str, Any], source: dict[str, Any], trainer: str, suite: str = "paper") -> None:
    """Give a results file that has no per-step workloads (one measured before they were kept) the
    workloads of another run of the same settings, so that the oracle can be derived for it.

    Sound because a request's response length is a function of its step, group, sample and prompt
    (``EmulatedEngine.response_length``), never of the mode, the trainer or the run's name; and
    checked: the bound of every step, recomputed from the adopted workload with this suite's models
    for ``trainer``, must equal the bound stored when the run was measured, or nothing is adopted.
    """
    base, specs, _ = load_suite(suite)
    over = {n: o for n, o, _ in specs}
    src = {workload_name(s): s for s in source["settings"]}
    adopted = []
    for s in doc["settings"]:
        name = s.get("workload", s["name"])
        if name not in src or f"{name}-{trainer}" not in over:
            raise ValueError(f"setting {name}: not in the source run or not a {trainer} setting of {suite}")
        eng, tr = models(load_config(base, over[f"{name}-{trainer}"], environ={}))
        work = {int(k): v for k, v in src[name]["workload_per_step"].items()}
        for k in s["steps"]:  # the measured steps (the warm-up's workload is not kept)
            b = s["bound_per_step"][k]
            if int(k) not in work:
                raise ValueError(f"setting {name}: step {k} is not in the source run")
            got = r2t_bound(unpack_workload(work[int(k)]), eng, tr).r2t
            if abs(got - b["r2t"]) > 1e-9 * b["r2t"]:
                raise ValueError(
                    f"setting {name}, step {k}: the adopted workload's bound is {got:.6f} s, the stored one "
                    f"{b['r2t']:.6f} s: not the same workload or not the same models; nothing adopted"
                )
        adopted.append((s, name, eng, tr, {k: work[int(k)] for k in s["steps"]}))
    for s, name, eng, tr, work in adopted:  # all checked: now change the document
        s.update(workload=name, trainer=trainer, models={"engine": asdict(eng), "trainer": asdict(tr)},
                 workload_per_step=work)  # fmt: skip
        s.pop("oracle_per_step", None)


def attach_models(doc: dict[str, Any]) -> None:
    """Give the settings of a results file that kept no cost models (a KV-limited run measured before
    the oracle modelled a cache) the models of their suite's configuration, with the cache size the
    run stored, so that the oracle can be derived for them.

    Checked as :func:`adopt_workloads` checks: the bound of every measured step, recomputed from the
    step's stored workload with these models, must equal the bound stored when the run was
    measured, or nothing is attached.  (The bound reads the decode, prefill and trainer constants,
    not the cache's; the cache's constants are the suite file's, which the check cannot see.)"""
    base, specs, _ = load_suite(doc["suite"])
    over = {n: o for n, o, _ in specs}
    found = []
    for s in doc["settings"]:
        if "models" in s:
            continue
        if s["name"] not in over:
            raise ValueError(f"setting {s['name']}: not a setting of suite {doc['suite']!r}")
        kv = [f"rollout.emulated.kv_cache_tokens={s['kv_cache_tokens']}"] if s.get("kv_cache_tokens") else []
        eng, tr = models(load_config(base, [*over[s["name"]], *kv], environ={}))
        work = {int(k): unpack_workload(w) for k, w in s["workload_per_step"].items()}
        for k in s["steps"]:
            got, want = r2t_bound(work[int(k)], eng, tr).r2t, s["bound_per_step"][k]["r2t"]
            if abs(got - want) > 1e-9 * want:
                raise ValueError(
                    f"setting {s['name']}, step {k}: the suite's models give a bound of {got:.6f} s, the "
                    f"stored one is {want:.6f} s: not the same models; nothing attached"
                )
        found.append((s, eng, tr))
    for s, eng, tr in found:
        s["models"] = {"engine": asdict(eng), "trainer": asdict(tr)}
        s.pop("oracle_per_step", None)


def rederive(
    path: Path, write: bool = False, workloads_from: Path | None = None, trainer: str = "lean",
    attach: bool = False,
) -> list[dict[str, Any]]:  # fmt: skip
    """The settings of a saved ``results.json``, derived again by this version of :func:`derive`:
    its per-step figures and bounds are kept, nothing is run again.  ``workloads_from``: adopt the
    per-step workloads of that run first, if this one has none (:func:`adopt_workloads`).
    ``attach``: give settings without cost models their suite's (:func:`attach_models`).
    ``write``: store the derived fields back into the file."""
    doc = json.loads(path.read_text())
    for s in doc["settings"]:
        s["per_step"] = {m: {int(k): v for k, v in ps.items()} for m, ps in s["per_step"].items()}
        s["bound_per_step"] = {int(k): v for k, v in s["bound_per_step"].items()}
    if workloads_from is not None and not all("workload_per_step" in s for s in doc["settings"]):
        adopt_workloads(doc, json.loads(workloads_from.read_text()), trainer)
    if attach:
        attach_models(doc)
    for s in doc["settings"]:
        derive(s)
    if write:
        path.write_text(json.dumps(doc, indent=2))  # as write_results writes it
    return list(doc["settings"])


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=rederive.__doc__)
    ap.add_argument("results", type=Path, nargs="+", help="paper suite results.json files: one table")
    ap.add_argument("--write", action="store_true", help="store the derived fields back into each")
    ap.add_argument("--workloads-from", type=Path, help="adopt that run's per-step workloads first")
    ap.add_argument("--trainer", default="lean", help="the trainer configuration the adopting file ran")
    ap.add_argument(
        "--attach-models",
        action="store_true",
        help="give settings without cost models their suite's (checked against stored bounds)",
    )
    a = ap.parse_args(argv)
    settings = [s for p in a.results
                for s in rederive(p, a.write, a.workloads_from, a.trainer, a.attach_models)]  # fmt: skip
    print(mode_table(settings[0]) if len(settings) == 1 else suite_table(settings))


register(
    Suite(
        name="paper",
        run=lambda a: run_bench(a.config or None, a.out, a.overrides, steps=a.steps, url=a.url,
                                progress=a.progress, suite=a.suite, scale=a.scale, only=a.only,
                                modes=a.modes),
        config=DEFAULT_CONFIG,
        refuses=frozenset({"quick"}),
        refusal="--quick is for the allocation and broker suites (--suite allocation|broker)",
        selects=lambda name: True,  # the paper suite, any other suite file, or none: the quick setting
        order=100,
    )
)  # fmt: skip

if __name__ == "__main__":
    main()
