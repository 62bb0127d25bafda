"""``gpu_calibrate --engine hf`` end to end on a tiny model on CPU (the path run on the lent H200,
where vLLM is absent): every grid point under the cap is measured and the fit and the trainer's
three figures are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_hf_calibration_writes_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "hf"
    cmd = [sys.executable, "-m", "rolloutpipe.bench.gpu_calibrate", "--tiny", "--engine", "hf",
           "--out", str(out), "--batch-sizes", "1,4", "--contexts", "16,64",
           "--max-cached-tokens", "128"]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, timeout=600)
    res = json.loads(out.with_suffix(".json").read_text())
    grid = {(r["context"], r["batch"]) for r in res["hf"]["decode"]}
    assert grid == {(16, 1), (16, 4), (64, 1)}  # 64 x 4 = 256 cached tokens is over the cap
    assert all(r["decode_step_s"] > 0 for r in res["hf"]["decode"])
    t = res["trainer"]
    assert t["forward_tokens_per_s"] > 0 and t["tokens_per_s_no_recompute"] > 0 and t["slime_passes"] > 0
    assert "slime's step" in out.with_suffix(".txt").read_text()
