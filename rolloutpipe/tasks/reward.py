"""Scoring a response: the user's reward function as they wrote it, off the event loop, with a timeout.

A reward function is one of three kinds, told apart by its parameters (:func:`load_scorer`):

* ours, ``f(response, answer) -> float`` (``rolloutpipe/tasks/verifiers.py``);
* verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)``,
  returning a number or a dict with ``score``; ``task.reward_args`` are its extra keyword arguments;
* slime's ``async def rm(args, sample)``, where ``args`` is a namespace of ``task.reward_args`` and
  ``sample`` has ``prompt``, ``response``, ``label`` and ``metadata``.

A dict result gives its ``score`` (or the key ``reward_args["reward_key"]`` names, as in slime).

Why a process pool: a symbolic check such as ``math-verify``'s can run for hours on adversarial
output (``\\boxed{9^{9^{9^{9^{9}}}}}``), and neither a thread nor a coroutine can be stopped.  A
call that takes longer than ``task.verifier_timeout_s`` has its process killed and replaced, and
scores 0 with outcome ``timeout``; a call that raises, returns something that is not a finite
number, or kills its process scores 0 with outcome ``error``.  Either way the worker goes on and
counts it (``verifier_timeouts``, ``verifier_errors``).  Cheap exact checks (marked ``cheap``) run
inline, where a process round trip would cost more than the check.  The timeout counts from the
call: a pool process loads the function's module, and runs its ``warm_up()`` if it has one (math-verify
imports sympy and builds its parser there), before it takes any call.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

from rolloutpipe.errors import ConfigError
from rolloutpipe.plugins import import_plugin_module

Kind = Literal["ours", "verl", "slime"]
Outcome = Literal["ok", "timeout", "error"]
START_TIMEOUT_S = 300.0  # a pool process's import of the reward function's module (not the call's timeout)


@dataclass(frozen=True)
class ScoreInput:
    """What a reward function may read about one response."""

    response: str
    answer: str
    prompt: str = ""
    data_source: str = ""
    extra_info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Score:
    reward: float
    outcome: Outcome = "ok"
    detail: str = ""


@dataclass
class SlimeSample:
    """The fields of slime's ``Sample`` that a custom reward function reads."""

    prompt: str
    response: str
    label: str
    metadata: dict[str, Any]
    index: int | None = None
    status: str = "completed"


def load_function(spec: str) -> Callable[..., Any]:
    """``pkg.mod:fn``, ``pkg.mod.fn`` or ``path/to/file.py:fn`` (verl's ``custom_reward_function.path``)."""
    target, sep, attr = spec.rpartition(":")
    if not sep:
        target, _, attr = spec.rpartition(".")
    try:
        if target.endswith(".py"):
            path = Path(target).expanduser().resolve()
            if not path.is_file():
                raise ImportError(f"no file {path}")
            name = f"_rolloutpipe_reward_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
            module = sys.modules.get(name)
            if module is None:
                file_spec = importlib.util.spec_from_file_location(name, path)
                if file_spec is None or file_spec.loader is None:
                    raise ImportError(f"{path} is not a Python module")
                module = importlib.util.module_from_spec(file_spec)
                sys.modules[name] = module
                file_spec.loader.exec_module(module)
        else:
            module = import_plugin_module(target)
        fn = getattr(module, attr)
    except (ImportError, AttributeError, ValueError, SyntaxError) as e:
        raise ConfigError(f"cannot import task.verifier {spec!r}: {e}") from e
    if not callable(fn):
        raise ConfigError(f"task.verifier {spec!r} is not a function")
    return fn  # type: ignore[no-any-return]


def classify(fn: Callable[..., Any], spec: str) -> Kind:
    """Which kind of reward function ``fn`` is, from its parameters' names and count."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as e:
        raise ConfigError(f"task.verifier {spec!r}: cannot read its parameters: {e}") from e
    names = list(params)
    if {"solution_str", "ground_truth"} <= set(names):
        return "verl"
    if names[:2] == ["args", "sample"] or inspect.iscoroutinefunction(fn):
        if len(names) < 2:
            raise ConfigError(
                f"task.verifier {spec!r} is async but does not take (args, sample) as slime's does"
            )
        return "slime"
    positional = [
        p for p in params.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]  # fmt: skip
    if len(positional) == 2:
        return "ours"
    raise ConfigError(
        f"task.verifier {spec!r} takes ({', '.join(names)}): a reward function is f(response, answer), "
        "verl's compute_score(data_source, solution_str, ground_truth, extra_info) or slime's "
        "async rm(args, sample)"
    )


class BadReward(ValueError):
    """A reward function returned something that is not a finite number."""


def _reason(e: Exception) -> str:
    return (str(e) if isinstance(e, BadReward) else f"{type(e).__name__}: {e}")[:500]


def to_reward(result: Any, reward_key: str) -> float:
    """A reward function's result as a finite float (:class:`BadReward`: it is not one)."""
    if isinstance(result, Mapping):
        if reward_key not in result:
            raise BadReward(f"it returned a dict without {reward_key!r} (keys: {sorted(result)})")
        result = result[reward_key]
    if isinstance(result, bool):
        return float(result)
    if not isinstance(result, int | float):
        try:
            result = float(result)  # numpy and torch scalars
        except (TypeError, ValueError):
            raise BadReward(f"it returned {type(result).__name__}, not a number") from None
    value = float(result)
    if not math.isfinite(value):
        raise BadReward(f"it returned {value}")
    return value


class _Call:
    """One reward function with its adapter: ``ScoreInput`` -> the raw result (or a coroutine)."""

    def __init__(self, spec: str, reward_args: Mapping[str, Any]) -> None:
        self.fn = load_function(spec)
        self.kind = classify(self.fn, spec)
        self.kwargs = {k: v for k, v in reward_args.items() if k != "reward_key"}
        self.args = argparse.Namespace(**reward_args)
        self.reward_key = str(reward_args.get("reward_key", "score"))
        self.is_async = inspect.iscoroutinefunction(self.fn)

    def __call__(self, x: ScoreInput) -> Any:
        if self.kind == "verl":
            return self.fn(x.data_source, x.response, x.answer, dict(x.extra_info), **self.kwargs)
        if self.kind == "slime":
            sample = SlimeSample(x.prompt, x.response, x.answer, dict(x.extra_info))
            return self.fn(self.args, sample)
        return self.fn(x.response, x.answer)

    def run_sync(self, x: ScoreInput) -> float:
        out = self(x)
        if inspect.isawaitable(out):
            out = asyncio.run(_awaited(out))
        return to_reward(out, self.reward_key)


async def _awaited(aw: Any) -> Any:
    return await aw


def _child_main(fd: int) -> None:
    """A pool process (``python -c``): load the function once, then score what arrives until EOF."""
    parent = os.getppid()

    def orphaned() -> None:  # a hung call must not outlive a worker that was killed
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    conn = Connection(fd)
    spec, reward_args, path = conn.recv()
    sys.path[:] = path  # the parent's import path: a dotted spec resolves as it did there
    try:
        call = _Call(spec, reward_args)
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    warm_up = getattr(call.fn, "warm_up", None)
    if warm_up is not None:  # heavy first-call set-up (imports, grammars): not charged to a call's timeout
        with contextlib.suppress(Exception):
            warm_up()
    conn.send(("ready", ""))
    while True:
        try:
            x = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", call.run_sync(x)))
        except Exception as e:
            conn.send(("error", _reason(e)))


class _Proc:
    """One pool process, started as a fresh interpreter (not forked: the worker runs threads, and
    multiprocessing's spawn would re-import the parent's ``__main__``)."""

    def __init__(self, spec: str, reward_args: dict[str, Any]) -> None:
        ours, theirs = socket.socketpair()
        code = f"from rolloutpipe.tasks.reward import _child_main; _child_main({theirs.fileno()})"
        self.p = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()])
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send((spec, reward_args, list(sys.path)))
        self.ready = False

    def wait_ready(self) -> None:
        if self.ready:
            return
        if not self.conn.poll(START_TIMEOUT_S):
            raise RuntimeError(f"a verifier process did not start within {START_TIMEOUT_S:.0f} s")
        try:
            status, detail = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"a verifier process exited on start (code {self.p.wait()})") from None
        if status != "ready":
            raise ConfigError(f"the verifier process cannot load task.verifier: {detail}")
        self.ready = True

    def exitcode(self) -> int | None:
        """The exit code of a process whose pipe closed (it is reaped a moment after)."""
        try:
            return self.p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.p.kill()
        with contextlib.suppress(Exception):
            self.p.wait(timeout=5)
        self.conn.close()


class ProcessPool:
    """``processes`` processes that each hold the reward function; a hung call kills its process.

    Thread-safe and blocking: :class:`Scorer` calls it from a thread of its own executor.
    """

    def __init__(self, spec: str, reward_args: Mapping[str, Any], processes: int, timeout_s: float) -> None:
        self.spec, self.reward_args = spec, dict(reward_args)
        self.timeout_s = timeout_s
        self.idle: queue.Queue[_Proc] = queue.Queue()
        self.all: list[_Proc] = []
        self.lock = threading.Lock()
        for _ in range(processes):
            self._add()

    def _add(self) -> None:
        proc = _Proc(self.spec, self.reward_args)
        with self.lock:
            self.all.append(proc)
        self.idle.put(proc)

    def _replace(self, proc: _Proc) -> None:
        proc.kill()
        with self.lock:
            if proc in self.all:
                self.all.remove(proc)
        self._add()

    def call(self, x: ScoreInput) -> Score:
        proc = self.idle.get()
        try:
            proc.wait_ready()
        except BaseException:
            self._replace(proc)
            raise
        try:
            proc.conn.send(x)
            if not proc.conn.poll(self.timeout_s):
                self._replace(proc)
                return Score(0.0, "timeout", f"no result within {self.timeout_s:g} s")
            status, value = proc.conn.recv()
        except (EOFError, OSError, BrokenPipeError) as e:
            code = proc.exitcode()
            self._replace(proc)
            return Score(0.0, "error", f"the verifier process died (exit code {code}): {type(e).__name__}")
        self.idle.put(proc)
        if status == "ok":
            return Score(float(value))
        return Score(0.0, "error", str(value))

    def close(self) -> None:
        with self.lock:
            procs, self.all = self.all, []
        for proc in procs:
            proc.kill()


class Scorer:
    """``task.verifier`` behind one interface: ``await score(x)`` in a worker, ``score_sync`` elsewhere."""

    def __init__(self, task: Any) -> None:
        self.spec: str = task.verifier
        self.timeout_s: float = task.verifier_timeout_s
        self.call = _Call(self.spec, task.reward_args)  # a bad path or signature fails here, in the parent
        pool = task.verifier_pool
        if pool == "auto":
            pool = "inline" if getattr(self.call.fn, "cheap", False) else "process"
        self.mode: Literal["inline", "process"] = pool
        self.pool: ProcessPool | None = None
        self.threads: concurrent.futures.ThreadPoolExecutor | None = None
        if pool == "process":
            self.pool = ProcessPool(self.spec, task.reward_args, task.verifier_processes, self.timeout_s)
            self.threads = concurrent.futures.ThreadPoolExecutor(
                task.verifier_processes, thread_name_prefix="verifier"
            )

    @property
    def fn(self) -> Callable[..., Any]:
        return self.call.fn

    def _inline(self, x: ScoreInput) -> Score:
        try:
            return Score(self.call.run_sync(x))
        except Exception as e:
            return Score(0.0, "error", _reason(e))

    async def score(self, x: ScoreInput) -> Score:
        if self.pool is not None:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.threads, self.pool.call, x)
        if self.call.is_async:  # slime's coroutine: awaited here, bounded by the timeout
            try:
                out = await asyncio.wait_for(self.call(x), self.timeout_s)
                return Score(to_reward(out, self.call.reward_key))
            except TimeoutError:
                return Score(0.0, "timeout", f"no result within {self.timeout_s:g} s")
            except Exception as e:
                return Score(0.0, "error", _reason(e))
        return self._inline(x)

    def score_sync(self, x: ScoreInput) -> Score:
        """For callers without an event loop of their own (the trainer's evaluator, in a thread)."""
        if self.pool is not None:
            return self.pool.call(x)
        return self._inline(x)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if self.threads is not None:
            self.threads.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Scorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_verifier(task: Any) -> None:
    """Fail early (before any role starts) on a ``task.verifier`` that cannot be loaded or classified."""
    _Call(task.verifier, task.reward_args)
