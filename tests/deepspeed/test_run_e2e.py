"""``rolloutpipe run`` with the DeepSpeed trainer: the launcher line that ``Cluster`` builds
(torchrun, 2 ranks, gloo on CPU) trains the tiny model end to end with every other role a process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.config import ROOT

pytestmark = [pytest.mark.deepspeed, pytest.mark.timeout(600)]


def test_rolloutpipe_run_with_deepspeed_trainer(tmp_path: Path, model_cache: str) -> None:
    out = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "-m", "rolloutpipe", "run", "configs/demo.yaml", "--steps", "3", "--out", str(out),
         "--no-progress", f"model.cache_dir={model_cache}", "trainer.backend=deepspeed", "trainer.nproc=2",
         "trainer.deepspeed.zero_stage=2", "trainer.deepspeed.dtype=fp32"],
        cwd=ROOT, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    log = (out / "logs" / "trainer.log").read_text(errors="replace") if (out / "logs").exists() else ""
    assert p.returncode == 0, p.stderr[-3000:] + log[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(r["groups"] == 16 and r["samples"] == 256 and r["fence_rejections"] == 0 for r in rows)
    manifest = json.loads((out / "weights" / "v000003" / "manifest.json").read_text())
    assert manifest["policy_version"] == 3 and set(manifest["sha256"]) == {"model.safetensors"}
    assert "rank 0/2: ZeRO-2" in log and "rank 1/2: ZeRO-2" in log, log[-2000:]  # two ranks ran
