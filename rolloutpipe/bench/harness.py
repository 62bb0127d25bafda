"""What every benchmark suite shares, and the registry that ``rolloutpipe bench`` looks suites up in.

Every suite used to repeat the same frame: start an embedded Redis unless ``--redis-url`` names one,
draw a progress bar on stderr, stop both in a ``finally``, and write ``results.json`` and
``results.md`` next to a line saying where they are.  :func:`session` and :func:`write_results`
are that frame, written once.  :func:`register` records a suite; :func:`lookup` finds the suite
that ``--suite NAME`` selects; :func:`run_suite` (the ``bench`` command) checks the CLI flags it
was given against the suite's ``refuses``, then runs it.

Adding a suite is one file, ``rolloutpipe/bench/<name>.py``::

    from rolloutpipe.bench.harness import Suite, register, session, where, write_results

    def run_mine(out: Path, *, url: str = "", progress: bool = True) -> tuple[str, str]:
        with session(url, progress=progress, total=3, desc="mine") as s:
            for i in range(3):
                s.label(f"row {i}")
                ...  # real runs on ``s.url``
                s.advance()
        text = "| row | ... |"  # the suite's table
        write_results(out, {"suite": "mine", "wall_s": s.wall_s}, text)
        return text, where(out, s.wall_s)

    register(Suite(
        name="mine",
        run=lambda a: run_mine(a.out, url=a.url, progress=a.progress),
        config=CONFIGS / "bench" / "mine.yaml",
        refuses=frozenset({"config", "steps", "scale", "overrides", "quick"}),
        refusal="--suite mine takes its settings from configs/bench/mine.yaml",
    ))

:func:`lookup` imports every module of this package, suites or not (``bound``, the broker suite's
``broker_ceiling`` and ``broker_report``, the paper suite's ``paper_report``, and the tools run as
``python -m rolloutpipe.bench.NAME``: ``admission_oracle``, ``gpu_calibrate``, ``memory_flatness``),
so a module here keeps its heavy imports (vLLM, torch) inside its functions. It then asks the
suites, lowest ``order`` first, whether ``--suite NAME`` is theirs (``selects``; by default: NAME is
the suite's name). The suite that takes every name (``paper``, ``order`` last) runs ``rolloutpipe
bench`` without ``--suite``. A suite that refuses no flag ignores those it does not read
(``allocation``: the positional config and ``--scale``), as the CLI always did. The help of ``bench
--suite`` and ``--quick`` in ``cli.py`` names the suites in words: a new suite adds its name there.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolloutpipe.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# the CLI flags a suite may refuse: the positional config, dotted overrides, --steps, --scale, --quick
FLAGS = ("config", "overrides", "steps", "scale", "quick")

# A fast emulated run (two workers, 8 prompts x 4 a step, two mini-batches, time 100x faster): the
# overrides the tests and ``memory_flatness`` run ``configs/demo.yaml`` with.
EMULATED_FAST = (
    "rollout.engine=emulated",
    "trainer.backend=emulated",
    "rollout.workers=2",
    "rollout.emulated.max_num_seqs=16",
    "rollout.emulated.length_median=200",
    "rollout.emulated.length_sigma=0.8",
    "rollout.emulated.max_response_tokens=2000",
    "rollout.emulated.time_scale=0.01",
    "trainer.emulated.time_scale=0.01",
    "trainer.emulated.tokens_per_s=20000",
    "controller.prompts_per_step=8",
    "controller.group_size=4",
    "controller.minibatches=2",
    "rollout.claim_idle_s=2.0",
    "rollout.heartbeat_s=0.3",
)


def flatten(d: dict[str, Any], prefix: str = "") -> list[str]:
    """``{"a": {"b": 1}}`` -> ``["a.b=1"]`` (config overrides)."""
    out: list[str] = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out += flatten(v, key + ".")
        else:
            out.append(f"{key}={json.dumps(v) if not isinstance(v, str) else v}")
    return out


def spec_path(name: str) -> Path:
    """A suite's spec: ``NAME.yaml`` as given, else ``configs/bench/NAME.yaml``."""
    return Path(name) if name.endswith(".yaml") else CONFIGS / "bench" / f"{name}.yaml"


# ------------------------------------------------------------------------------------ the frame


class Session:
    """One suite's Redis and progress bar: ``url`` to run on, ``label``/``advance`` the bar."""

    def __init__(self, url: str, redis_pid: int | None, bar: Any, t0: float) -> None:
        self.url = url
        self.redis_pid = redis_pid  # the embedded server's pid; None with --redis-url
        self.bar = bar  # tqdm, or None without progress
        self.t0 = t0  # time.monotonic() before the Redis started

    def label(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    update = advance  # a Session stands in for the bar where a helper takes one

    @property
    def wall_s(self) -> float:
        return time.monotonic() - self.t0


@contextmanager
def session(url: str, *, progress: bool, total: int, desc: str) -> Iterator[Session]:
    """A progress bar of ``total`` runs on stderr (unless not ``progress``) and a Redis: ``url``, or
    an embedded redis-server started here; both are stopped on the way out, whatever happens."""
    from rolloutpipe.broker.embedded import EmbeddedRedis

    bar: Any = None
    er: EmbeddedRedis | None = None
    try:
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=desc, unit="run", file=sys.stderr)
        t0 = time.monotonic()
        if not url:
            er = EmbeddedRedis().start()
        pid = er.proc.pid if er is not None and er.proc is not None else None
        yield Session(url or (er.url if er else ""), pid, bar, t0)
    finally:
        if er is not None:
            er.stop()
        if bar is not None:
            bar.close()


def write_results(out: Path, doc: dict[str, Any], text: str, default: Any = None) -> None:
    """``results.json`` (``doc``) and ``results.md`` (``text``) under ``out``."""
    (out / "results.json").write_text(json.dumps(doc, indent=2, default=default))
    (out / "results.md").write_text(text + "\n")


def where(out: Path, wall_s: float, *extra: Path) -> str:
    """The line saying where a suite's results are (``extra``: its pictures), and how long it ran."""
    more = "".join(f", {p}" for p in extra)
    return f"results: {out / 'results.json'}, {out / 'results.md'}{more} ({wall_s:.0f} s)"


# ------------------------------------------------------------------------------------ the registry


@dataclass(frozen=True)
class BenchArgs:
    """What ``rolloutpipe bench`` was given, as a suite receives it."""

    suite: str
    out: Path
    config: str = ""
    overrides: list[str] = field(default_factory=list)
    steps: int | None = None
    scale: float | None = None
    url: str = ""
    progress: bool = True
    quick: bool = False
    only: str = ""  # paper-style suites: comma-separated globs of setting names
    modes: str = ""  # paper-style suites: comma-separated modes to run instead of the suite's

    def given(self) -> set[str]:
        """The refusable flags (``FLAGS``) that were given."""
        on = {"config": bool(self.config), "overrides": bool(self.overrides), "steps": self.steps is not None,
              "scale": self.scale is not None, "quick": self.quick}  # fmt: skip
        return {k for k, v in on.items() if v}


@dataclass(frozen=True)
class Suite:
    """A registered suite: ``run`` it with the CLI's arguments; it returns its table and where."""

    name: str
    run: Callable[[BenchArgs], tuple[str, str]]
    config: Path  # its default spec (or config), under configs/
    refuses: frozenset[str] = frozenset()  # of FLAGS: given any, the suite stops with ``refusal``
    refusal: str = ""
    selects: Callable[[str], bool] | None = None  # is ``--suite NAME`` this suite? default: NAME == name
    order: int = 50  # asked in this order; the catch-all asks last

    def __post_init__(self) -> None:
        bad = self.refuses - set(FLAGS)
        if bad:
            raise ValueError(f"suite {self.name!r} refuses unknown flags {sorted(bad)} (known: {FLAGS})")

    def is_selected_by(self, name: str) -> bool:
        return self.selects(name) if self.selects is not None else name == self.name

    def check(self, args: BenchArgs) -> None:
        if self.refuses & args.given():
            raise ConfigError(self.refusal)


_SUITES: dict[str, Suite] = {}


def register(suite: Suite) -> Suite:
    """Record ``suite`` (a module of this package calls it at import); a name registers once."""
    if suite.name in _SUITES and _SUITES[suite.name] != suite:
        raise ValueError(f"benchmark suite {suite.name!r} is registered twice")
    _SUITES[suite.name] = suite
    return suite


def suites() -> list[Suite]:
    """Every suite of this package, in the order they are asked."""
    pkg = importlib.import_module("rolloutpipe.bench")
    for m in pkgutil.iter_modules(pkg.__path__):
        if not m.name.startswith("_"):
            importlib.import_module(f"rolloutpipe.bench.{m.name}")
    return sorted(_SUITES.values(), key=lambda s: (s.order, s.name))


def lookup(name: str) -> Suite:
    """The suite that ``--suite NAME`` selects ("" for none: the catch-all)."""
    for s in suites():
        if s.is_selected_by(name):
            return s
    raise ConfigError(f"benchmark suite {name!r} not found (looked for {spec_path(name)})")


def run_suite(args: BenchArgs) -> tuple[str, str]:
    """``rolloutpipe bench``: the suite's flag checks, then the suite."""
    suite = lookup(args.suite)
    suite.check(args)
    return suite.run(args)
