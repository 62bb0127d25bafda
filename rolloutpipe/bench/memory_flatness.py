"""Bounded memory over a long run: Redis ``used_memory`` and every role's RSS, sampled by step.

    python -m rolloutpipe.bench.memory_flatness --steps 200 --every 10 --out runs/memory

Runs the emulated engine and trainer (the fast settings of ``tests/support/config.py``) for ``--steps``
steps against a private redis-server, every role its own process (``rolloutpipe.launch.cluster``), samples
``INFO memory`` and ``/proc/PID/status`` VmRSS of each role each time the policy version passes a
multiple of ``--every``, prints a table and the growth from the ``--from-step`` point to the end (%
and bytes a step), and writes ``memory.json`` and ``memory.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from rolloutpipe.bench.harness import CONFIGS, EMULATED_FAST
from rolloutpipe.broker.codec import DEFAULT_CODEC
from rolloutpipe.broker.embedded import EmbeddedRedis
from rolloutpipe.broker.events import PolicyVersion
from rolloutpipe.broker.keys import Keys
from rolloutpipe.config import Config, load_config
from rolloutpipe.launch.cluster import run_cluster


@dataclass
class Sample:
    step: int
    used_memory: int  # INFO memory used_memory
    dataset: int  # used_memory_dataset: the keys alone, without client buffers and overhead
    keys: int
    rss: dict[str, int] = field(default_factory=dict)  # role -> VmRSS bytes


def role_pids() -> dict[str, int]:
    """The role processes started by this process: name (``rollout-0``…) -> pid, from /proc."""
    me = os.getpid()
    out: dict[str, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != me:
                continue
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        if "rolloutpipe" not in args:
            continue
        role = args[args.index("rolloutpipe") + 1]
        if "--worker-id" in args:
            role = f"rollout-{args[args.index('--worker-id') + 1].rsplit('-w', 1)[-1]}"
        out[role] = int(d.name)
    return out


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _version(r: redis.Redis, keys: Keys) -> int:
    raw: Any = r.get(keys.version)
    return -1 if raw is None else DEFAULT_CODEC.decode_as(raw, PolicyVersion).policy_version


def measure(cfg: Config, every: int = 10, timeout_s: float = 1200.0) -> list[Sample]:
    """Run ``cfg`` against a fresh private Redis; a sample each time ``every`` more steps are trained."""
    samples: list[Sample] = []
    with EmbeddedRedis(appendonly=cfg.redis.appendonly, appendfsync=cfg.redis.appendfsync) as er:
        done = threading.Event()
        err: list[BaseException] = []

        def go() -> None:
            try:
                run_cluster(cfg, er.url, Path(cfg.out), progress=False, timeout_s=timeout_s)
            except BaseException as e:  # re-raised below, in the caller's thread
                err.append(e)
            finally:
                done.set()

        t = threading.Thread(target=go, name="run")
        t.start()
        r = redis.Redis(port=er.port)
        keys = Keys(cfg.run)
        nxt = every
        try:
            while not done.is_set():
                v = _version(r, keys)  # version v published: steps 0..v-1 trained
                if v >= nxt:
                    info: Any = r.info("memory")
                    pids = role_pids()
                    sz: dict[str, int] = {}
                    for name, pid in sorted(pids.items()):
                        try:
                            sz[name] = rss(pid)
                        except OSError:  # exited between listing and reading
                            continue
                    samples.append(
                        Sample(v, int(info["used_memory"]), int(info["used_memory_dataset"]), r.dbsize(), sz)
                    )
                    nxt = (v // every + 1) * every
                time.sleep(0.02)
        finally:
            t.join()
            r.close()
        if err:
            raise err[0]
    return samples


def at(samples: list[Sample], step: int) -> Sample:
    """The first sample taken at or after ``step``."""
    return next((s for s in samples if s.step >= step), samples[-1])


def growth(samples: list[Sample], start: int) -> dict[str, dict[str, float]]:
    """Per series: bytes at ``start`` and at the end, growth in % and in bytes a step."""
    a, b = at(samples, start), samples[-1]
    steps = max(1, b.step - a.step)
    series = {"redis used_memory": (a.used_memory, b.used_memory), "redis dataset": (a.dataset, b.dataset)}
    for name in b.rss:
        if name in a.rss:
            series[f"rss {name}"] = (a.rss[name], b.rss[name])
    return {
        k: {
            "from": float(x),
            "to": float(y),
            "pct": 100.0 * (y - x) / max(1, x),
            "bytes_per_step": (y - x) / steps,
            "from_step": float(a.step),
            "to_step": float(b.step),
        }
        for k, (x, y) in series.items()
    }


def table(samples: list[Sample]) -> str:
    roles = sorted({n for s in samples for n in s.rss})
    head = ["step", "redis used_memory", "redis dataset", "keys", *(f"RSS {n}" for n in roles)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in samples:
        cells = [str(s.step), _mib(s.used_memory), _mib(s.dataset), str(s.keys)]
        cells += [_mib(s.rss[n]) if n in s.rss else "-" for n in roles]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mib(b: int) -> str:
    return f"{b / 2**20:.2f} MiB"


def plot(samples: list[Sample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 3.8))
    xs = [s.step for s in samples]
    ax[0].plot(xs, [s.used_memory / 2**20 for s in samples], marker=".", label="used_memory")
    ax[0].plot(xs, [s.dataset / 2**20 for s in samples], marker=".", label="used_memory_dataset")
    ax[0].set(title="Redis memory", xlabel="step", ylabel="MiB", ylim=(0, None))
    ax[0].legend()
    for name in sorted({n for s in samples for n in s.rss}):
        ax[1].plot(xs, [s.rss.get(name, 0) / 2**20 for s in samples], marker=".", label=name)
    ax[1].set(title="RSS per role process", xlabel="step", ylabel="MiB", ylim=(0, None))
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--from-step", type=int, default=50, help="growth is measured from here to the end")
    ap.add_argument("--out", default="runs/memory")
    ap.add_argument("overrides", nargs="*", help="more dotted.key=value config overrides")
    a = ap.parse_args(argv)
    out = Path(a.out)
    cfg = load_config(
        CONFIGS / "demo.yaml",
        ["run=memory", f"out={out}", *EMULATED_FAST, f"controller.steps={a.steps}", *a.overrides],
        environ={},
    )
    t0 = time.monotonic()
    samples = measure(cfg, a.every)
    wall = time.monotonic() - t0
    print(table(samples))
    g = growth(samples, a.from_step)
    print(
        f"\ngrowth from step {at(samples, a.from_step).step} to step {samples[-1].step} ({wall:.0f} s wall):"
    )
    for k, v in g.items():
        print(f"  {k:24s} {v['from'] / 2**20:8.2f} -> {v['to'] / 2**20:8.2f} MiB  {v['pct']:+6.2f}%  "
              f"{v['bytes_per_step']:+9.0f} B/step")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(
        json.dumps({"wall_s": wall, "samples": [s.__dict__ for s in samples], "growth": g}, indent=2)
    )
    plot(samples, out / "memory.png")
    print(f"\n{out / 'memory.json'}  {out / 'memory.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
