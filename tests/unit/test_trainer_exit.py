"""The supervisor's wait for the trainer after the last version (launch/cluster.py).

The fresh-clone CI of f29d740 failed with "the trainer exited with code 0 after the last
version": the loop read ``poll()`` twice and a trainer that exited between the reads (``None``
then ``0``) was taken for a crash.  A fake process replays that sequence exactly.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from rolloutpipe.errors import RoleError
from rolloutpipe.launch.cluster import _await_trainer_exit


class FakeProc:
    def __init__(self, codes: list[int | None]) -> None:
        self.codes = list(codes)
        self.calls = 0

    def poll(self) -> int | None:
        self.calls += 1
        return self.codes.pop(0) if len(self.codes) > 1 else self.codes[0]


def cluster_with(codes: list[int | None], tmp_path: Path) -> SimpleNamespace:
    log = tmp_path / "trainer.log"
    log.write_text("last line\n")
    trainer = SimpleNamespace(name="trainer", proc=FakeProc(codes), log_path=log)
    respawns: list[object] = []

    def respawn(rp: SimpleNamespace) -> None:
        respawns.append(rp)
        rp.proc = FakeProc([None, 0])  # the restarted trainer finishes

    return SimpleNamespace(procs=[trainer], respawn=respawn, respawns=respawns)


def test_exit_between_two_reads_is_a_normal_finish(tmp_path: Path) -> None:
    c = cluster_with([None, 0], tmp_path)
    _await_trainer_exit(c, max_restarts=0)  # type: ignore[arg-type]
    assert c.respawns == []


def test_a_crash_after_the_last_version_is_an_error_without_restarts(tmp_path: Path) -> None:
    c = cluster_with([None, 1], tmp_path)
    with pytest.raises(RoleError, match="code 1"):
        _await_trainer_exit(c, max_restarts=0)  # type: ignore[arg-type]


def test_a_crash_is_restarted_when_restarts_are_allowed(tmp_path: Path) -> None:
    c = cluster_with([-9], tmp_path)
    _await_trainer_exit(c, max_restarts=1)  # type: ignore[arg-type]
    assert len(c.respawns) == 1


def test_no_trainer_returns_at_once(tmp_path: Path) -> None:
    _await_trainer_exit(SimpleNamespace(procs=[], respawn=None), max_restarts=0)  # type: ignore[arg-type]
