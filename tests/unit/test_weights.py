"""Weight publishing leaves no temp folder behind, even when its writer is killed mid-write.

``publish_weights`` writes ``.tmp-v…`` and renames it to ``vNNNNNN``.  A trainer killed in between
leaves the temp folder; the next publish removes it once its writer is dead, never while the
writer lives.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from rolloutpipe.model.weights import WEIGHTS_FILE, load_verified_state, publish_weights
from tests.support.config import ROOT

# A trainer that is killed inside publish_weights: it stops once the weights file is written
# (hashing it is the next thing publish_weights does) and waits to be killed.
WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    import rolloutpipe.model.weights as w

    def stuck(path):
        print("writing", path.parent.name, flush=True)
        time.sleep(600)

    w.sha256_file = stuck
    w.publish_weights({"w": torch.ones(3)}, Path(sys.argv[1]), "r", 7)
    """
)


def _tmp(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob(".tmp*"))


def test_a_killed_writers_temp_folder_is_removed_but_never_a_live_ones(tmp_path: Path) -> None:
    state = {"w": torch.zeros(3)}
    cmd = [sys.executable, "-c", WRITER, str(tmp_path)]
    with subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True) as child:
        try:
            assert child.stdout is not None
            line = child.stdout.readline()
            assert line.startswith("writing "), f"the writer did not start: {line!r}"
            live = tmp_path / line.split()[1]
            assert live.name.startswith(f".tmp-v000007-{child.pid}") and (live / WEIGHTS_FILE).exists()

            publish_weights(state, tmp_path, "r", 1, keep=3)  # the writer lives: its folder stays
            assert _tmp(tmp_path) == [live.name] and (live / WEIGHTS_FILE).exists()
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(30)
    assert live.exists()  # killed inside publish_weights: its folder is left behind
    # a writer on another host (shared storage): this host cannot tell whether it lives
    elsewhere = tmp_path / f".tmp-v000005-{child.pid}-not-{socket.gethostname()}"
    elsewhere.mkdir()

    pv = publish_weights(state, tmp_path, "r", 2, keep=3)
    assert _tmp(tmp_path) == [elsewhere.name]  # the killed writer's folder is gone
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v000001", "v000002"]
    load_verified_state(pv)


def test_this_process_removes_its_own_unfinished_folders(tmp_path: Path) -> None:
    """A restarted container's trainer often has the PID its dead predecessor had (PID 1)."""
    state = {"w": torch.zeros(3)}
    left = tmp_path / f".tmp-v000004-{os.getpid()}-{socket.gethostname()}"  # the predecessor's
    left.mkdir()
    (left / WEIGHTS_FILE).write_bytes(b"half a file")
    publish_weights(state, tmp_path, "r", 5)
    assert _tmp(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000005"]


def test_a_failed_publish_removes_its_temp_folder(tmp_path: Path) -> None:
    import rolloutpipe.model.weights as w

    real = w.sha256_file

    def full_disk(path: Path) -> str:
        raise OSError(28, "No space left on device")

    w.sha256_file = full_disk
    try:
        try:
            publish_weights({"w": torch.zeros(3)}, tmp_path, "r", 6)
        except OSError as e:
            assert e.errno == 28
        else:
            raise AssertionError("publish_weights did not raise")
    finally:
        w.sha256_file = real
    assert list(tmp_path.iterdir()) == []


def test_a_new_version_is_never_pruned_by_an_earlier_runs_higher_ones(tmp_path: Path) -> None:
    """A reused folder holds v000058-v000060 of an earlier run; publishing v000000 with ``keep=3``
    used to sort by name and delete the version it had just written (``make demo`` run twice hung
    on 'v000000/model.safetensors is missing').  Versions are compared by number."""
    for v in (58, 59, 60):
        publish_weights({"w": torch.full((2,), float(v))}, tmp_path, "r", v)
    pv = publish_weights({"w": torch.zeros(2)}, tmp_path, "r", 0, keep=3)
    assert torch.equal(load_verified_state(pv)["w"], torch.zeros(2))
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v000000"]  # the other run's are not ours
    for v in (1, 2, 3):
        publish_weights({"w": torch.full((2,), float(v))}, tmp_path, "r", v, keep=2)
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v000002", "v000003"]


def test_a_new_checkpoint_is_never_pruned_by_an_earlier_runs_higher_ones(tmp_path: Path) -> None:
    from rolloutpipe.roles.trainer import checkpoint

    for s in (58, 59, 60):
        checkpoint.save(tmp_path, s, {}, keep=2)
    checkpoint.save(tmp_path, 0, {"initial": True}, keep=2)
    ck = checkpoint.latest(tmp_path)
    assert ck is not None and ck.step == 0
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-000000"]
