"""``rolloutpipe run`` trains the tiny model from a verl parquet file and from a slime JSON-lines file,
each scored by a reward function written the way that framework's users write it
(``tests/support/byo_rewards.py``), and refuses a malformed file of each format with a clear error.

The check of the rewards is independent of the reward path: every trained sample's response ids are
decoded here and compared with the row's answer; a reward function that got the wrong text, the
wrong answer, or lost the row's data_source / extra_info / metadata (it raises, and scores 0) fails.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rolloutpipe.broker.codec import iter_events
from rolloutpipe.broker.events import Group
from rolloutpipe.model.tokenizer import CharTokenizer
from tests.support.config import ROOT

pytestmark = pytest.mark.slow
STEPS = 4


def _rp(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rolloutpipe", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def _mod10(split: str) -> list[tuple[str, str]]:
    pairs = [(f"{a}+{b}=", str((a + b) % 10)) for a in range(10) for b in range(10)]
    return pairs[::7] if split == "test" else [p for i, p in enumerate(pairs) if i % 7]


def _trained(out: Path) -> list[Group]:
    groups = [g for g in iter_events((out / "groups.msgpack").read_bytes()) if isinstance(g, Group)]
    assert len(groups) == STEPS * 16
    return groups


def _check_rewards(groups: list[Group], answers: dict[str, str], correct_reward: float) -> None:
    """Every sample's reward is its response's first character against the row's answer."""
    codec, right = CharTokenizer(), 0
    for g in groups:
        for s in g.samples:
            prompt = codec.decode(s.prompt_ids)
            assert prompt in answers, f"trained on {prompt!r}, which is not a row with an answer"
            want = correct_reward if codec.decode(s.response_ids)[:1] == answers[prompt] else 0.0
            assert s.reward == want, (prompt, codec.decode(s.response_ids), s.reward)
            right += want > 0
    assert right > 0, "no sample scored: the check above could not tell a broken reward from a model"


def test_run_trains_from_a_verl_parquet_file_with_a_verl_compute_score(
    tmp_path: Path, model_cache: str
) -> None:
    def rows(split: str) -> list[dict[str, Any]]:
        return [
            {"data_source": "mod10", "prompt": [{"role": "user", "content": q}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": a}, "extra_info": {"split": split, "index": i}}
            for i, (q, a) in enumerate(_mod10(split))
        ]  # fmt: skip

    train = rows("train")
    # rows without an answer: reported and skipped, never trained on
    train += [{**train[0], "prompt": [{"role": "user", "content": f"-{d}="}],
               "reward_model": {"style": "rule", "ground_truth": None}} for d in range(3)]  # fmt: skip
    pq.write_table(pa.Table.from_pylist(train), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows("test")), tmp_path / "test.parquet")
    out = tmp_path / "out"
    p = _rp("run", "configs/demo.yaml", "--steps", str(STEPS), "--out", str(out), "--no-progress",
            f"model.cache_dir={model_cache}", "trainer.record_groups=true",
            # the three lines of the README's verl recipe
            "task.dataset=verl", f"task.path={tmp_path / 'train.parquet'}",
            "task.verifier=tests/support/byo_rewards.py:compute_score",
            f"task.eval_path={tmp_path / 'test.parquet'}", "eval.every=2", "eval.num_prompts=16")  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"3 of {len(train)} rows have no answer and are skipped" in p.stderr
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert [m["eval_reward"] is not None for m in metrics] == [False, True, False, True]
    _check_rewards(_trained(out), dict(_mod10("train")), correct_reward=1.0)


def test_run_trains_from_a_slime_jsonl_file_with_a_slime_reward_function(
    tmp_path: Path, model_cache: str
) -> None:
    f = tmp_path / "train.jsonl"
    f.write_text("".join(json.dumps({"prompt": q, "label": int(a), "metadata": {"tag": "m"}}) + "\n"
                         for q, a in _mod10("train")))  # fmt: skip
    out = tmp_path / "out"
    p = _rp("run", "configs/demo.yaml", "--steps", str(STEPS), "--out", str(out), "--no-progress",
            f"model.cache_dir={model_cache}", "trainer.record_groups=true",
            "task.dataset=slime", f"task.path={f}", "task.verifier=tests.support.byo_rewards:custom_rm",
            "task.reward_args={correct_reward: 2.0}")  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    _check_rewards(_trained(out), dict(_mod10("train")), correct_reward=2.0)


@pytest.mark.parametrize(
    ("name", "content", "fmt", "message"),
    [
        ("bad.parquet", "verl-bad-row", "verl", r"bad.parquet: row 2: field 'prompt': expected a string"),
        ("bad.jsonl", '{"prompt": "1+1=", "label": 2}\n{"prompt": "2+2=", "label": 4\n', "slime",
         r"bad.jsonl: cannot read it as .jsonl: line 2 is not JSON"),
    ],
)  # fmt: skip
def test_run_refuses_a_malformed_file_with_a_clear_error(
    tmp_path: Path, name: str, content: str, fmt: str, message: str
) -> None:
    f = tmp_path / name
    if content == "verl-bad-row":
        good = {"data_source": "mod10", "prompt": [{"role": "user", "content": "1+1="}],
                "reward_model": {"ground_truth": "2"}, "extra_info": {"split": "train"}}  # fmt: skip
        pq.write_table(pa.Table.from_pylist([good, {**good, "prompt": []}]), f)
    else:
        f.write_text(content)
    p = _rp("run", "configs/demo.yaml", "--steps", "1", "--out", str(tmp_path / "out"), "--no-progress",
            f"task.dataset={fmt}", f"task.path={f}")  # fmt: skip
    assert p.returncode == 2, p.stderr[-3000:]
    assert message in p.stderr
    assert "Traceback" not in p.stderr
