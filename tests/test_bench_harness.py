"""The bench harness: which suite ``--suite NAME`` selects, the flags each refuses, and the frame."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rolloutpipe.bench.harness import (
    BenchArgs,
    Suite,
    lookup,
    register,
    session,
    suites,
    where,
    write_results,
)
from rolloutpipe.broker.embedded import EmbeddedRedis
from rolloutpipe.cli import main
from rolloutpipe.errors import ConfigError


@pytest.mark.parametrize(
    ("name", "suite"),
    [
        ("", "paper"),
        ("paper", "paper"),
        ("gsm8k", "paper"),  # a paper-style suite file
        ("broker", "broker"),
        ("configs/bench/broker.yaml", "broker"),
        ("allocation", "allocation"),
        ("multiplex", "multiplex"),
    ],
)
def test_a_suite_name_selects_its_suite(name: str, suite: str) -> None:
    assert lookup(name).name == suite


def test_every_suite_registers_once_and_the_catch_all_asks_last() -> None:
    names = [s.name for s in suites()]
    assert sorted(names) == ["allocation", "broker", "multiplex", "paper"]
    assert names[-1] == "paper" and names[0] == "broker"
    assert all(s.config.exists() for s in suites())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--suite", "broker", "x.y=1"], "--suite broker takes its settings"),
        (["bench", "--suite", "broker", "--scale", "0.1"], "not overrides, --steps or --scale"),
        (["bench", "--suite", "multiplex", "--steps", "3"], "--suite multiplex takes its settings"),
        (["bench", "--suite", "multiplex", "--scale", "0.1"], "configs/bench/multiplex.yaml and overrides"),
        (["bench", "--quick"], "--quick is for the allocation and broker suites"),
        (["bench", "--suite", "paper", "--quick"], "(--suite allocation|broker)"),
    ],
)
def test_refused_flags_stop_before_anything_runs(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_missing_suite_file_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--suite", "no-such-suite"]) == 2
    assert "benchmark suite 'no-such-suite' not found" in capsys.readouterr().err


def test_a_suite_checks_its_flags(tmp_path: Path) -> None:
    s = Suite(name="t", run=lambda a: ("", ""), config=tmp_path, refuses=frozenset({"steps"}), refusal="no")
    s.check(BenchArgs(suite="t", out=tmp_path, overrides=["a=1"]))
    with pytest.raises(ConfigError, match="no"):
        s.check(BenchArgs(suite="t", out=tmp_path, steps=3))
    with pytest.raises(ValueError, match="unknown flags"):
        Suite(name="t", run=lambda a: ("", ""), config=tmp_path, refuses=frozenset({"bogus"}))
    with pytest.raises(ValueError, match="registered twice"):
        register(Suite(name="paper", run=lambda a: ("", ""), config=tmp_path))


def test_the_session_stops_its_redis_and_the_results_are_written(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), session("", progress=False, total=1, desc="t") as s:
        assert s.url.startswith("redis://") and s.redis_pid is not None
        pid = s.redis_pid
        raise RuntimeError("a suite fails half-way")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the embedded server is gone (stopped and reaped)
    write_results(tmp_path, {"a": 1}, "| t |")
    assert (tmp_path / "results.md").read_text() == "| t |\n"
    assert where(tmp_path, 3.4, tmp_path / "x.png").endswith(
        "results.md, " + str(tmp_path / "x.png") + " (3 s)"
    )


def test_an_outside_redis_is_used_as_given(redis_server: EmbeddedRedis) -> None:
    with session(redis_server.url, progress=False, total=1, desc="t") as s:
        assert s.url == redis_server.url and s.redis_pid is None
