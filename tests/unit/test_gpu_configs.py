"""The GPU configs load, place roles on devices, and their task pieces work (no GPU needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rolloutpipe.config import load_config
from rolloutpipe.errors import ConfigError
from rolloutpipe.launch.cluster import Cluster, trainer_launcher
from rolloutpipe.tasks.datasets import jsonl, load_dataset
from rolloutpipe.tasks.verifiers import last_number_match
from tests.support.config import ROOT

GPU_CONFIGS = sorted((ROOT / "configs").glob("qwen3-1.7b-*.yaml"))


def test_there_are_gpu_configs() -> None:
    assert len(GPU_CONFIGS) >= 2


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=lambda p: p.name)
def test_gpu_config_is_vllm_plus_deepspeed(path: Path) -> None:
    cfg = load_config(path, environ={})
    assert cfg.rollout.engine == "vllm" and cfg.trainer.backend == "deepspeed"
    assert cfg.model.path and cfg.task.path
    # one GPU per worker, disjoint from the trainer's
    rollout = {d for ds in cfg.rollout.devices for d in ds.split(",")}
    trainer = set(cfg.trainer.devices.split(","))
    assert len(cfg.rollout.devices) == cfg.rollout.workers
    assert not rollout & trainer, "rollout and trainer pools must not share a GPU"
    assert len(trainer) == cfg.trainer.nproc
    tp = cfg.rollout.vllm.tensor_parallel_size
    assert all(len(ds.split(",")) == tp for ds in cfg.rollout.devices)


def test_deepspeed_trainer_is_started_under_torchrun(tmp_path: Path) -> None:
    cfg = load_config(GPU_CONFIGS[0], [f"out={tmp_path}"], environ={})
    assert trainer_launcher(cfg.trainer) == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={cfg.trainer.nproc}",
        "-m",
        "--",
    ]
    assert trainer_launcher(cfg.trainer.model_copy(update={"backend": "torch"})) == ["-m"]

    spawned: list[tuple[str, str, list[str]]] = []

    class Recording(Cluster):
        def spawn(self, role, name, extra=None, *, devices="", launcher=None):  # type: ignore[no-untyped-def]
            spawned.append((name, devices, launcher or []))

    Recording(cfg, "redis://x", tmp_path).start()
    by_name = {n: (d, lnch) for n, d, lnch in spawned}
    assert by_name["trainer"] == (cfg.trainer.devices, trainer_launcher(cfg.trainer))
    for i in range(cfg.rollout.workers):
        assert by_name[f"rollout-{i}"] == (cfg.rollout.devices[i], [])  # spawn's default: -m


def test_jsonl_dataset(tmp_path: Path) -> None:
    f = tmp_path / "d.jsonl"
    f.write_text(
        json.dumps({"question": "2+2?", "answer": "work...\n#### 4"})
        + "\n\n"
        + json.dumps({"prompt": "3+3?", "answer": 6})
        + "\n"
    )
    rows = load_dataset("rolloutpipe.tasks.datasets:jsonl", 5, 0, str(f))
    assert len(rows) == 5
    assert {(r.text, r.answer) for r in rows} == {("2+2?", "4"), ("3+3?", "6")}
    with pytest.raises(ConfigError, match=r"task\.path"):
        jsonl(3, 0)
    f.write_text('{"prompt": "x"}\n')
    with pytest.raises(ConfigError, match=r"d.jsonl:1"):
        jsonl(3, 0, str(f))


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("so it is \\boxed{1,024}", "1024", 1.0),
        ("first 3, then 18 apples", "18", 1.0),
        ("the answer is 17", "18", 0.0),
        ("\\boxed{18} but later 3", "18", 1.0),
        ("no number", "18", 0.0),
        ("-2.50", "-2.5", 1.0),
    ],
)
def test_last_number_match(response: str, answer: str, reward: float) -> None:
    assert last_number_match(response, answer) == reward
