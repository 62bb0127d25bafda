"""``rolloutpipe bench --suite broker --quick`` end to end, on the real roles, plus its pieces.

It measures nothing (two small rows, one repeat); it checks that ``results.json`` has the shape the
issue asks for, that every sample released was trained (counted independently from each run's
``metrics.jsonl``), and that the figures are sane: positive rates, p50 <= p99, a finite ratio.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from pathlib import Path

import pytest

from rolloutpipe.bench.broker import Row, bytes_breakdown, load_spec, row_overrides, run_broker
from rolloutpipe.broker.embedded import EmbeddedRedis
from rolloutpipe.broker.events import RolloutRequest
from rolloutpipe.cli import main
from rolloutpipe.config import EmulatedEngineConfig, load_config
from rolloutpipe.engines.emulated import EmulatedEngine
from rolloutpipe.errors import ConfigError

ROW_KEYS = ("workers", "payload_bytes", "offered_samples_per_s", "samples_per_s", "dispatch_p50_s",
            "dispatch_p99_s", "ratio_to_ceiling", "redis_cpu", "aggregator_cpu", "trainer_cpu",
            "redis_used_memory_max_bytes")  # fmt: skip


@pytest.mark.slow
def test_broker_bench_quick(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    text, where = run_broker("broker", tmp_path, url=redis_server.url, progress=False, quick=True)
    doc = json.loads((tmp_path / "results.json").read_text())
    spec = load_spec("broker", quick=True)
    per_run = spec["steps"] * spec["prompts_per_step"] * spec["group_size"]
    assert (tmp_path / "broker.png").stat().st_size > 10_000
    assert "results.json" in where
    [ceiling] = doc["ceilings"]
    assert ceiling["redis_py_samples_per_s"] > 0
    if shutil.which("redis-benchmark"):  # the C client's figure, on the same server and payload size
        assert ceiling["redis_benchmark_samples_per_s"] > 0
    assert doc["ceiling_samples_per_s"] == {str(ceiling["payload_bytes"]): ceiling["redis_py_samples_per_s"]}
    # a sample carries 4 bytes a response token twice (ids, logprobs) and 4 a prompt token
    assert ceiling["payload_bytes"] > 8 * 1024 + 4 * spec["prompt_tokens"]
    want = [(a, w) for a in spec["aggregators"] for w in spec["workers"]]
    assert [(r["aggregators"], r["workers"]) for r in doc["rows"]] == want
    assert 2 in spec["aggregators"]  # the quick run goes through the sharded path too
    # one aggregator alone, on this server: it drained every group it was given
    assert ceiling["aggregator_samples_per_s"] > 0
    for row in doc["rows"]:
        for k in ROW_KEYS:
            assert k in row, k
        assert row["offered_samples_per_s"] is None  # quick: the instant engine only
        assert row["payload_bytes"] == ceiling["payload_bytes"]
        assert row["samples_per_s"] > 0
        assert 0 <= row["dispatch_p50_s"] <= row["dispatch_p99_s"]
        assert math.isfinite(row["ratio_to_ceiling"]) and row["ratio_to_ceiling"] > 0
        assert row["ratio_to_ceiling"] == pytest.approx(row["samples_per_s"] / row["ceiling_samples_per_s"])
        assert f"| {row['workers']} | {row['aggregators']} |" in text
    for run in doc["runs"]:
        ms = [json.loads(x) for x in (tmp_path / run["name"] / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in ms] == list(range(spec["steps"]))
        trained = sum(m["samples"] for m in ms)
        released = sum(m["samples"] + m["samples_wasted"] for m in ms)
        assert trained == released == per_run == run["samples_trained"] == run["samples_released"]
        assert run["dead_letters"] == 0
        measured = sum(m["samples"] for m in ms[1:])
        assert run["samples_per_s"] == pytest.approx(measured / (ms[-1]["train_end"] - ms[0]["train_end"]))
        # every group after the warm-up step has a dispatch latency
        assert run["groups_measured"] == (spec["steps"] - 1) * spec["prompts_per_step"]


def test_paced_rows_offer_their_load(tmp_path: Path) -> None:
    spec = load_spec("broker")
    over = row_overrides(spec, Row(workers=4, tokens=1024, offered=2000.0, repeat=0), tmp_path)
    cfg = load_config(Path(spec["base"]), over, environ={})
    e = cfg.rollout.emulated
    # one sample = one emulated second; `slots` of them per worker every time_scale seconds
    assert e.decode_base_s * e.length_median == pytest.approx(1.0)
    assert cfg.rollout.workers * e.max_num_seqs / e.time_scale == pytest.approx(2000.0)
    instant = row_overrides(spec, Row(workers=4, tokens=1024, offered=None, repeat=0), tmp_path)
    assert load_config(Path(spec["base"]), instant, environ={}).rollout.emulated.time_scale == 0.0
    assert cfg.trainer.backend == "emulated" and cfg.trainer.emulated.time_scale == 0.0


def test_bad_suite_settings_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "broker.yaml"
    bad.write_text("response_tokens: [1024]\nworkers: [0]\n")
    with pytest.raises(ConfigError, match="missing settings"):
        load_spec(str(bad))
    good = Path("configs/bench/broker.yaml").read_text()
    bad.write_text(
        good.replace("offered_samples_per_s: [250, 1000, 5000, null]", "offered_samples_per_s: [-5]")
    )
    with pytest.raises(ConfigError, match="offered_samples_per_s"):
        load_spec(str(bad))


def test_broker_suite_refuses_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--suite", "broker", "--steps", "3"]) == 2
    assert "configs/bench/broker.yaml" in capsys.readouterr().err


def test_group_re_embeds_its_samples() -> None:
    b = bytes_breakdown(1024, 16, 8)
    assert b["response_ids_bytes"] == b["logprobs_bytes"] == 4096
    # today every token crosses Redis four times: sample in and out, group in and out
    assert b["group_bytes_per_sample"] >= b["sample_bytes"]
    assert b["wire_bytes_per_sample"] >= 4 * (8 * 1024)


async def test_instant_engine_returns_at_once() -> None:
    eng = EmulatedEngine(EmulatedEngineConfig(time_scale=0.0, length_median=300, length_sigma=0.0,
                                              max_response_tokens=301, prompt_tokens=16))  # fmt: skip
    req = RolloutRequest(run="r", step=0, policy_version=0, request_id="1-0", group_id="0:0", prompt_index=0,
                         sample_index=0, prompt="p", answer="a", seed=0, max_new_tokens=301,
                         released_at=0.0)  # fmt: skip
    gen = await asyncio.wait_for(eng.generate(req), 1.0)
    assert len(gen.response_ids) == len(gen.logprobs) == 300 and len(gen.prompt_ids) == 16
    assert gen.finish_reason == "stop"
    assert eng._task is None  # no batching loop was started
    await eng.close()
