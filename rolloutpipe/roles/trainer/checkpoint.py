"""Trainer checkpoints: the durable half of a step commit.

A checkpoint ``OUT/checkpoints/{run}/ckpt-{k:06d}`` is the trainer's state *before* step k, i.e.
after step k-1: model weights and optimizer tensors (safetensors), optimizer scalars and the step
(``state.json``), and a ``manifest.json`` with the sha256 of every file.  It is written under a
temporary name and renamed, so a half-written checkpoint never exists under its final name; a
reader verifies every sha256 before loading anything.  No pickle anywhere.

Step k commits in this order (``step.commit``):

1. append step k's consumed groups, metrics and timeline rows to the OUT logs (and fsync);
2. write checkpoint k+1, which also records step k's group ids, their ``groups`` entry ids, the
   step's ``StepMetrics`` and the byte size of every OUT log after step 1 -- **the commit point**;
3. publish weights version k+1, with the step's metrics, in one ``MULTI`` (metrics, ``version``);
4. ``SADD consumed:k`` + ``XACK`` of the step's group entries, in one ``MULTI``.

A restarted trainer finds the newest valid checkpoint c and the published version v:

* crash before 2 (c == v == k): step k is not committed.  The logs are truncated to checkpoint
  k's sizes (dropping anything appended for step k), the state is checkpoint k's, and the step is
  redone: its groups are still pending in the ``trainer`` consumer group, the reader reads pending
  entries first, and ``consumed:k`` does not hold them yet, so each is trained once in the redo.
* crash between 2 and 3 (c == v + 1): step k is committed but not visible.  Steps 3 and 4 are
  redone from the checkpoint (its weights *are* version k+1's, its metrics are the step's), then
  training continues at k+1.  Publishing is idempotent (same bytes, same version).
* crash between 3 and 4 (c == v, the checkpoint has step k-1's commit record): step 4 is redone
  before the reader starts; ``SADD`` and ``XACK`` are idempotent.  A group of a committed step is
  never trained again: its entry gets acknowledged and its id is in ``consumed:k``.

So the consumed-group ids are needed in the checkpoint only to finish steps 3-4 of the last
commit; ``consumed:k`` in Redis remains the dedup set.  A version ahead of every checkpoint
(c < v) cannot be produced by this order and is refused (``CheckpointError``) rather than
resumed from the wrong weights.  A backend without checkpoint support (DeepSpeed) still gets the
commit record; only its tensors are not saved, and its resume is logged as a warning.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rolloutpipe.errors import RolloutPipeError
from rolloutpipe.model.weights import sha256_file

if TYPE_CHECKING:
    import torch

log = logging.getLogger("rolloutpipe.trainer")
STATE_FILE = "state.json"
MANIFEST = "manifest.json"


class CheckpointError(RolloutPipeError):
    """A checkpoint that is missing, corrupted or inconsistent with the published version."""


@runtime_checkable
class Checkpointable(Protocol):
    def checkpoint_state(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        """Named tensor files (``name -> tensors``) and JSON scalars."""
        ...

    def load_checkpoint_state(
        self, tensors: dict[str, dict[str, torch.Tensor]], meta: dict[str, Any]
    ) -> None: ...


@dataclass
class Checkpoint:
    step: int  # the next step to train == the policy version of the weights
    path: Path
    state: dict[str, Any]

    @property
    def initial(self) -> bool:
        return bool(self.state.get("initial", False))

    def tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        from safetensors.torch import load_file

        return {
            name: load_file(str(self.path / f"{name}.safetensors")) for name in self.state.get("tensors", [])
        }


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    root: Path,
    step: int,
    state: dict[str, Any],
    tensors: dict[str, dict[str, torch.Tensor]] | None = None,
    keep: int = 2,
) -> Checkpoint:
    """Write checkpoint ``step`` atomically (temp dir, fsync, rename) and prune to ``keep``."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"ckpt-{step:06d}"
    tmp = root / f".tmp-ckpt-{step:06d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    state = {**state, "step": step, "tensors": sorted(tensors or {})}
    if tensors:
        from safetensors.torch import save_file

        for name, ts in tensors.items():
            save_file(
                {k: v.detach().cpu().contiguous().clone() for k, v in ts.items()},
                str(tmp / f"{name}.safetensors"),
            )
    (tmp / STATE_FILE).write_text(json.dumps(state))
    files = sorted(p.name for p in tmp.iterdir())
    digests = {}
    for name in files:
        _fsync(tmp / name)
        digests[name] = sha256_file(tmp / name)
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "sha256": digests}))
    _fsync(tmp / MANIFEST)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _fsync(root)
    for stale in root.glob(".tmp-ckpt-*"):  # left by a trainer killed while saving
        shutil.rmtree(stale, ignore_errors=True)
    if keep > 0:  # by number, and never the one just written (ckpt-000060 of an earlier run sorts last)
        steps = sorted((int(p.name[5:]), p) for p in root.glob("ckpt-[0-9]*") if p.name[5:].isdigit())
        older = [p for s, p in steps if s <= step]
        for old in [p for s, p in steps if s > step] + older[: max(0, len(older) - keep)]:
            shutil.rmtree(old, ignore_errors=True)
    return Checkpoint(step, final, state)


def verify(path: Path) -> Checkpoint:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        for name, want in manifest["sha256"].items():
            if sha256_file(path / name) != want:
                raise CheckpointError(f"{path / name}: sha256 does not match the manifest")
        state = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: unreadable checkpoint: {e}") from e
    if STATE_FILE not in manifest["sha256"] or state.get("step") != manifest.get("step"):
        raise CheckpointError(f"{path}: manifest and state disagree")
    return Checkpoint(int(state["step"]), path, state)


def latest(root: Path) -> Checkpoint | None:
    """The newest checkpoint whose manifest verifies (a corrupted newer one is skipped, loudly)."""
    for path in sorted(root.glob("ckpt-[0-9]*"), reverse=True):
        try:
            return verify(path)
        except CheckpointError as e:
            log.error("skipping checkpoint %s: %s", path.name, e)
    return None


def clear(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------------------------- OUT logs' offsets


def append_logs(appends: dict[Path, bytes], logs: list[Path]) -> dict[str, int]:
    """Append each file's bytes and fsync; the sizes of every log afterwards (the commit's offsets)."""
    for path, data in appends.items():
        with path.open("ab") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return log_sizes(logs)


def log_sizes(logs: list[Path]) -> dict[str, int]:
    return {p.name: p.stat().st_size if p.exists() else 0 for p in logs}


def truncate_logs(out: Path, offsets: dict[str, int]) -> None:
    """Drop whatever an uncommitted step appended after the checkpoint's offsets."""
    for name, size in offsets.items():
        p = out / name
        if p.exists() and p.stat().st_size > size:
            log.info("truncating %s to %d bytes (uncommitted step)", p.name, size)
            os.truncate(p, size)


# ----------------------------------------------------------------------------- optimizer (no pickle)


def optimizer_to_safetensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Tensors of ``opt.state_dict()`` as ``state.{param}.{name}``; everything else as JSON."""
    import torch

    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, st in sd["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{idx}.{name}"] = v
            else:
                scalars.setdefault(str(idx), {})[name] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_safetensors(
    opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = v
    for idx, sc in meta["scalars"].items():
        state.setdefault(int(idx), {}).update(sc)
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]]
    opt.load_state_dict({"state": state, "param_groups": groups})
