"""Weight publishing: safetensors plus a sha256 manifest, written atomically.

A version directory appears only complete (written under a temporary name, then renamed), and a
reader verifies every file's sha256 against the PolicyVersion event before loading anything.

The temporary name is ``.tmp-vNNNNNN-PID-HOST``: the writer's process id and host name say whose it
is.  A writer killed before its rename leaves it behind; every publish removes such orphans of dead
writers (same host, process gone; or this process's own, when it is not writing it), and never a
folder whose writer may live (its process exists, or it is on another host sharing the storage).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rolloutpipe.broker.events import PolicyVersion
from rolloutpipe.errors import WeightsVerificationError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("rolloutpipe.trainer")
WEIGHTS_FILE = "model.safetensors"
# .tmp-v000007-4242-host (HOST is absent in folders of older versions of this code: this host's)
TMP_NAME = re.compile(r"\.tmp-v(\d+)-(\d+)(?:-(.+))?")
_writing: set[Path] = set()  # temp folders this process is writing now
_writing_lock = threading.Lock()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def publish_weights(
    state: dict[str, torch.Tensor], root: Path, run: str, version: int, keep: int = 0
) -> PolicyVersion:
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    final = root / f"v{version:06d}"
    tmp = root / f".tmp-v{version:06d}-{os.getpid()}-{socket.gethostname()}"
    with _writing_lock:
        _writing.add(tmp)
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp / WEIGHTS_FILE))
        digests = {WEIGHTS_FILE: sha256_file(tmp / WEIGHTS_FILE)}
        (tmp / "manifest.json").write_text(json.dumps({"policy_version": version, "sha256": digests}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed write leaves nothing (a kill cannot get here)
        raise
    finally:
        with _writing_lock:
            _writing.discard(tmp)
    remove_orphans(root)
    if keep > 0:
        prune_versions(root, version, keep)
    return PolicyVersion(
        run=run,
        step=version,
        policy_version=version,
        path=str(final.resolve()),
        sha256=digests,
        published_at=time.time(),
    )


def prune_versions(root: Path, newest: int, keep: int) -> list[Path]:
    """Remove the version folders under ``root`` other than the ``keep`` newest up to ``newest``.

    Workers only ever need the newest version.  Versions are compared by number, never by name, and
    ``newest`` itself is never removed.  A folder numbered above ``newest`` is another run's left in
    the same folder (``rolloutpipe run`` refuses a reused ``--out`` unless told ``--overwrite``): it
    is removed too, since no worker of this run may load it.
    """
    versions = sorted(
        (int(d.name[1:]), d) for d in root.glob("v[0-9]*") if d.is_dir() and d.name[1:].isdigit()
    )
    current = [(v, d) for v, d in versions if v <= newest]
    doomed = [d for v, d in versions if v > newest] + [d for _, d in current[: max(0, len(current) - keep)]]
    for d in doomed:
        shutil.rmtree(d, ignore_errors=True)
    return doomed


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def remove_orphans(root: Path) -> list[Path]:
    """Remove the temp folders under ``root`` left by writers that died before their rename.

    An orphan is a folder of this host whose process is gone, or one of this process (a restarted
    container's trainer often has its predecessor's PID) that it is not writing now.  A folder of a
    live process, or of another host, is left alone: its writer may be at work.
    """
    host, me = socket.gethostname(), os.getpid()
    removed = []
    for d in root.glob(".tmp-v*"):
        m = TMP_NAME.fullmatch(d.name)
        if m is None or (m[3] is not None and m[3] != host):
            continue
        pid = int(m[2])
        if pid == me:
            with _writing_lock:
                if d in _writing:
                    continue
        elif pid_alive(pid):
            continue
        shutil.rmtree(d, ignore_errors=True)
        log.info("removed %s, left by a weight writer (pid %d) that died before publishing it", d, pid)
        removed.append(d)
    return removed


def verify_weights(pv: PolicyVersion) -> None:
    root = Path(pv.path)
    for name, want in pv.sha256.items():
        f = root / name
        if not f.exists():
            raise WeightsVerificationError(f"policy version {pv.policy_version}: {f} is missing")
        got = sha256_file(f)
        if got != want:
            raise WeightsVerificationError(
                f"policy version {pv.policy_version}: sha256 of {f} is {got[:12]}…, "
                f"the manifest says {want[:12]}…"
            )


def load_verified_state(pv: PolicyVersion) -> dict[str, torch.Tensor]:
    """Verify then load.  A half-written or corrupted file raises WeightsVerificationError."""
    from safetensors.torch import load_file

    verify_weights(pv)
    state: dict[str, torch.Tensor] = load_file(str(Path(pv.path) / WEIGHTS_FILE))
    return state
