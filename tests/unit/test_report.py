"""``rolloutpipe report DIR``: pictures and a self-contained HTML page from a run's files."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rolloutpipe.tools.report import ReportError, write_html_report
from tests.support.config import ROOT


def _fake_run(d: Path, steps: int = 5, timeline: bool = True) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    t = 1000.0
    with (d / "metrics.jsonl").open("w") as m, (d / "timeline.jsonl").open("w") as tl:
        for k in range(steps):
            row = {"step": k, "mode": "cgp-fgd", "reward_mean": 0.1 * k, "rollout_to_train_end_s": 1.0,
                   "trainer_wait_ratio": 0.3, "first_group_s": 0.2, "train_busy_s": 0.7, "groups": 2,
                   "samples": 4, "fence_rejections": 0, "dead_letters": 0}  # fmt: skip
            m.write(json.dumps(row) + "\n")
            groups = [
                {"id": f"{k}:{g}", "minibatch": g, "completed_at": t + 0.3 + 0.3 * g,
                 "read_at": t + 0.31 + 0.3 * g,
                 "samples": [[f"w{s % 2}", t + 0.01 * s, t + 0.3 + 0.3 * g] for s in range(2)]}
                for g in range(2)
            ]  # fmt: skip
            busy = [[t + 0.35, t + 0.6], [t + 0.65, t + 1.0]]
            rec = {"step": k, "mode": "cgp-fgd", "step_start": t, "train_end": t + 1.0, "busy": busy,
                   "groups": groups}  # fmt: skip
            if timeline:
                tl.write(json.dumps(rec) + "\n")
            t += 1.1
    if not timeline:
        (d / "timeline.jsonl").unlink()
    return d


def test_report_writes_pictures_and_one_self_contained_page(tmp_path: Path) -> None:
    run = _fake_run(tmp_path / "run")
    out = write_html_report(run)
    assert set(out) == {"html", "steps_png", "timeline_png"}
    for png in (out["steps_png"], out["timeline_png"]):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    page = out["html"].read_text()
    assert page.count("data:image/png;base64,") == 2  # both pictures embedded: one file to share
    assert "<td>4</td>" in page  # the last step's row


def test_steps_that_trained_no_group_are_left_off_the_timeline(tmp_path: Path) -> None:
    """Dynamic sampling out of refills trains no group: the step's start is +inf (no sample
    started it).  A run of only such steps once made the axis limit NaN, and ``rolloutpipe run``
    ended with a traceback after the run."""
    run = _fake_run(tmp_path / "run")
    recs = [json.loads(x) for x in (run / "timeline.jsonl").read_text().splitlines()]
    with (run / "timeline.jsonl").open("a") as tl:
        tl.write(json.dumps({**recs[0], "step": 5, "step_start": float("inf"), "groups": []}) + "\n")
    assert write_html_report(run)["timeline_png"].stat().st_size > 5000  # the other steps drawn
    (run / "timeline.jsonl").write_text(
        "".join(json.dumps({**r, "step_start": float("inf"), "groups": []}) + "\n" for r in recs)
    )
    out = write_html_report(run)
    assert "timeline_png" not in out and out["html"].exists()


def test_report_without_timeline_says_how_to_get_one(tmp_path: Path) -> None:
    out = write_html_report(_fake_run(tmp_path / "run", timeline=False))
    assert "timeline_png" not in out
    assert "trainer.record_timeline=true" in out["html"].read_text()


def test_report_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ReportError, match=r"no metrics\.jsonl"):
        write_html_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ReportError, match="empty"):
        write_html_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n')
    with pytest.raises(ReportError, match=r"metrics.jsonl:2"):
        write_html_report(tmp_path)


def test_report_cli(tmp_path: Path) -> None:
    run = _fake_run(tmp_path / "run")
    p = subprocess.run([sys.executable, "-m", "rolloutpipe", "report", str(run)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "report.html" in p.stdout and (run / "report.html").exists()
    shutil.rmtree(run)
    p = subprocess.run([sys.executable, "-m", "rolloutpipe", "report", str(run)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 2 and "rolloutpipe: error:" in p.stderr and "metrics.jsonl" in p.stderr


def test_the_step_picture_shows_the_training_stats_one_unit_per_panel() -> None:
    """report.png put seconds and a ratio on one axis and left out loss, grad norm, clip fraction,
    entropy, KL and response length, which metrics.jsonl holds."""
    from rolloutpipe.tools.report import step_panels

    rows = [{"step": k, "reward_mean": 0.5, "trainer_wait_ratio": 0.2, "rollout_to_train_end_s": 3.0 + k,
             "tokens": 40 * (k + 1), "samples": 8, "eval_reward": 0.4 if k == 1 else None,
             "train": {"loss": 0.1 * k, "grad_norm": 2.0, "clipfrac": 0.01, "entropy": 0.9, "kl": 0.001}}
            for k in range(3)]  # fmt: skip
    panels = dict(step_panels(rows))
    assert list(panels) == ["mean reward", "trainer wait ratio", "rollout-to-train-end (s)",
                            "mean response length (tokens)", "loss", "grad norm (before clipping)",
                            "clip fraction", "entropy", "KL to the reference"]  # fmt: skip
    assert panels["mean reward"]["held-out"] == [(1, 0.4)]
    assert panels["mean response length (tokens)"]["tokens"] == [(0, 5.0), (1, 10.0), (2, 15.0)]
    assert panels["loss"]["loss"][2] == (2, 0.2)
    assert all(len(lines) == 1 for title, lines in panels.items() if "(s)" in title or "ratio" in title)
    no_kl = dict(step_panels([{**r, "train": {"loss": 0.0}} for r in rows]))
    assert "KL to the reference" not in no_kl and "loss" in no_kl
