"""Weight publishing: safetensors plus a sha256 manifest, written atomically.

A version directory appears only complete (written under a temporary name, then renamed), and a
reader verifies every file's sha256 against the PolicyVersion event before loading anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rolloutpipe.broker.events import PolicyVersion
from rolloutpipe.errors import WeightsVerificationError

if TYPE_CHECKING:
    import torch

WEIGHTS_FILE = "model.safetensors"


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
    tmp = root / f".tmp-v{version:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp / WEIGHTS_FILE))
    digests = {WEIGHTS_FILE: sha256_file(tmp / WEIGHTS_FILE)}
    (tmp / "manifest.json").write_text(json.dumps({"policy_version": version, "sha256": digests}))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    if keep > 0:  # workers only ever need the newest version; older ones are pruned
        for old in sorted(root.glob("v[0-9]*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return PolicyVersion(
        run=run,
        step=version,
        policy_version=version,
        path=str(final.resolve()),
        sha256=digests,
        published_at=time.time(),
    )


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
