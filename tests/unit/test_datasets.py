"""Datasets in the formats users have (``rolloutpipe/tasks/formats.py``): verl's parquet, slime's JSON
lines, any local file HF ``datasets`` reads.  The fixtures are written here, in each format, by the
libraries that write them (pyarrow, ``datasets``); nothing is downloaded.

Each malformed file must fail with an error naming the file, the row and the field; a row without
an answer is reported and skipped, never trained on.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rolloutpipe.config import Config, TaskConfig
from rolloutpipe.errors import ConfigError
from rolloutpipe.model.lm import PromptLength, prompt_measure
from rolloutpipe.model.tokenizer import HFTokenizer
from rolloutpipe.tasks.datasets import Prompt, load_dataset, task_prompts
from rolloutpipe.tasks.formats import FORMATS


def verl_row(i: int, a: int, b: int, answer: str | None = "auto") -> dict[str, Any]:
    """A row as verl's ``examples/data_preprocess/gsm8k.py`` writes it."""
    return {
        "data_source": "mod10",
        "prompt": [{"role": "user", "content": f"{a}+{b}="}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str((a + b) % 10) if answer == "auto" else answer},
        "extra_info": {"split": "train", "index": i},
    }


def write_verl(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_verl_parquet_rows_become_prompts_with_their_reward_inputs(tmp_path: Path) -> None:
    f = write_verl(tmp_path / "train.parquet", [verl_row(i, i, 2 * i) for i in range(5)])
    prompts = load_dataset("verl", 5, seed=0, path=str(f))
    by_text = {p.text: p for p in prompts}
    assert sorted(by_text) == sorted(f"{i}+{2 * i}=" for i in range(5))  # each row once
    p = by_text["3+6="]
    assert p.answer == "9"
    assert p.messages == ({"role": "user", "content": "3+6="},)
    assert p.data_source == "mod10"
    assert p.extra_info == {"split": "train", "index": 3}
    assert type(p.extra_info["index"]) is int  # plain Python, as msgpack carries it


def test_prompts_are_shuffled_by_seed_and_cycled(tmp_path: Path) -> None:
    f = write_verl(tmp_path / "t.parquet", [verl_row(i, i, 0) for i in range(4)])
    a = [p.text for p in load_dataset("verl", 10, seed=1, path=str(f))]
    b = [p.text for p in load_dataset("verl", 10, seed=1, path=str(f))]
    c = [p.text for p in load_dataset("verl", 10, seed=2, path=str(f))]
    assert a == b and a[:4] == a[4:8] and sorted(a[:4]) == ["0+0=", "1+0=", "2+0=", "3+0="]
    assert a[:4] != c[:4] or a == c  # another seed, another order (4! orders: equal by chance 1/24)


def test_slime_jsonl_with_string_prompts_and_with_messages(tmp_path: Path) -> None:
    f = write_jsonl(
        tmp_path / "slime.jsonl",
        [
            {"prompt": "1+2=", "label": "3", "metadata": {"level": 1}},
            {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "4+4="}],
             "label": 8, "metadata": {"level": 2}},
        ],
    )  # fmt: skip
    prompts = {p.answer: p for p in load_dataset("slime", 2, seed=0, path=str(f))}
    assert prompts["3"] == Prompt("1+2=", "3", (), "", {"level": 1})
    conv = prompts["8"]  # a number label is the answer's text
    assert conv.text == "be brief\n4+4=" and len(conv.messages) == 2 and conv.extra_info == {"level": 2}


def test_field_names_come_from_config_like_slimes_input_and_label_keys(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "q.jsonl", [{"question": "5+5=", "sol": {"final": "0"}, "meta": {"k": 1}}])
    task = TaskConfig(dataset="slime", path=str(f), prompt_key="question", label_key="sol.final",
                      metadata_key="meta")  # fmt: skip
    (p,) = task_prompts(task, 1, seed=0)
    assert (p.text, p.answer, p.extra_info) == ("5+5=", "0", {"k": 1})


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "csv", "save_to_disk"])
def test_hf_format_reads_any_local_file_datasets_reads(tmp_path: Path, kind: str) -> None:
    import datasets

    rows = [{"q": f"{i}+1=", "a": str((i + 1) % 10)} for i in range(6)]
    ds = datasets.Dataset.from_list(rows)
    path = tmp_path / ("disk" if kind == "save_to_disk" else f"data.{kind}")
    if kind == "parquet":
        ds.to_parquet(str(path))
    elif kind == "jsonl":
        ds.to_json(str(path))
    elif kind == "csv":
        ds.to_csv(str(path), index=False)
    else:
        ds.save_to_disk(str(path))
    task = TaskConfig(dataset="hf", path=str(path), prompt_key="q", label_key="a")
    got = sorted((p.text, p.answer) for p in task_prompts(task, 6, seed=0))
    assert got == sorted((r["q"], r["a"]) for r in rows)


def test_the_eval_split_reads_eval_path(tmp_path: Path) -> None:
    train = write_verl(tmp_path / "train.parquet", [verl_row(0, 1, 1)])
    held = write_verl(tmp_path / "test.parquet", [verl_row(0, 7, 7)])
    task = TaskConfig(dataset="verl", path=str(train), eval_path=str(held))
    assert {p.text for p in task_prompts(task, 3, seed=0)} == {"1+1="}
    assert {p.text for p in task_prompts(task, 3, seed=0, split="eval")} == {"7+7="}
    with pytest.raises(ConfigError, match=r"needs task\.eval_path"):
        task_prompts(TaskConfig(dataset="verl", path=str(train)), 3, seed=0, split="eval")


def test_rows_without_an_answer_are_reported_and_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [
        verl_row(0, 1, 2),
        verl_row(1, 2, 2, answer=None),
        verl_row(2, 3, 2, answer="  "),
        verl_row(3, 4, 2),
    ]
    f = write_verl(tmp_path / "gaps.parquet", rows)
    with caplog.at_level(logging.WARNING, logger="rolloutpipe.data"):
        prompts = load_dataset("verl", 8, seed=0, path=str(f))
    assert {p.text for p in prompts} == {"1+2=", "4+2="}  # never 2+2= or 3+2=
    log = caplog.text
    assert "2 of 4 rows have no answer" in log
    assert f"{f}: row 2: no answer in field 'reward_model.ground_truth'" in log
    assert f"{f}: row 3: no answer" in log


def test_a_file_where_no_row_has_an_answer_is_an_error(tmp_path: Path) -> None:
    f = write_verl(tmp_path / "none.parquet", [verl_row(0, 1, 2, answer=None)])
    with pytest.raises(ConfigError, match=r"holds no usable prompts \(1 rows without an answer\)"):
        load_dataset("verl", 4, seed=0, path=str(f))


@pytest.mark.parametrize(
    ("fmt", "rows", "message"),
    [
        ("verl", [verl_row(0, 1, 1), {**verl_row(1, 1, 1), "prompt": [{"content": "1+1="}]}],
         r"row 2: field 'prompt': message 0 is \{'role': None, 'content': '1\+1='\}"),
        ("verl", [{**verl_row(0, 1, 1), "reward_model": {"style": "rule", "ground_truth": ["1", "2"]}}],
         r"row 1: field 'reward_model.ground_truth' is a list, not an answer"),
        ("verl", [{k: v for k, v in verl_row(0, 1, 1).items() if k != "prompt"}],
         r"row 1: no field 'prompt' \(task.prompt_key\); the row's fields are ability, data_source"),
        ("slime", [{"prompt": "1+1=", "label": "2"}, {"prompt": 12, "label": "2"}],
         r"row 2: field 'prompt': expected a string or a non-empty list of chat messages, got int"),
        ("slime", [{"prompt": "1+1=", "label": "2", "metadata": "oops"}],
         r"row 1: field 'metadata' \(task.metadata_key\) is a str, not a mapping"),
    ],
)  # fmt: skip
def test_a_malformed_row_names_the_file_the_row_and_the_field(
    tmp_path: Path, fmt: str, rows: list[dict[str, Any]], message: str
) -> None:
    if fmt == "verl":
        f = write_verl(tmp_path / "bad.parquet", rows)
    else:
        f = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ConfigError, match=message) as err:
        load_dataset(fmt, 4, seed=0, path=str(f))
    assert str(f) in str(err.value)


def test_a_jsonl_line_that_is_not_json_is_named_by_its_line(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "broken.jsonl",
                    ['{"prompt": "1+1=", "label": "2"}', "", '{"prompt": "2+2=", "label": "4"',
                     '{"prompt": "3+3=", "label": "6"}'])  # fmt: skip
    with pytest.raises(ConfigError, match=r"broken\.jsonl: cannot read it as \.jsonl: line 3 is not JSON"):
        load_dataset("slime", 4, seed=0, path=str(f))


def test_a_parquet_file_that_is_not_parquet_is_a_clear_error(tmp_path: Path) -> None:
    f = tmp_path / "fake.parquet"
    f.write_bytes(b"not parquet at all")
    with pytest.raises(ConfigError, match=r"fake\.parquet: cannot read it as \.parquet"):
        load_dataset("verl", 4, seed=0, path=str(f))


@pytest.mark.parametrize(
    ("task", "message"),
    [
        (TaskConfig(dataset="verl"), r"the verl dataset needs task\.path"),
        (TaskConfig(dataset="verl", path="/nonexistent/x.parquet"),
         r"/nonexistent/x\.parquet does not exist"),
        (TaskConfig(dataset="hf", path="data.xlsx"), r"does not exist"),
        (TaskConfig(dataset="rolloutpipe.tasks.datasets:mod10_addition", prompt_key="q"),
         r"does not read task\.prompt_key"),
    ],
)  # fmt: skip
def test_config_mistakes_are_clear_errors(task: TaskConfig, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        task_prompts(task, 4, seed=0)


def test_an_unknown_suffix_is_a_clear_error(tmp_path: Path) -> None:
    f = tmp_path / "data.xlsx"
    f.write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"cannot tell the file's format from its suffix"):
        load_dataset("hf", 4, seed=0, path=str(f))


def test_every_format_has_defaults_for_its_fields() -> None:
    assert FORMATS["verl"].label == "reward_model.ground_truth" and FORMATS["verl"].metadata == "extra_info"
    assert FORMATS["slime"].prompt == "prompt" and FORMATS["slime"].label == "label"


class _ChatTokenizer:
    """Stands in for a HF tokenizer with a chat template: records what it was asked to encode."""

    chat_template = "{{ messages }}"
    eos_token_id = 9

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def apply_chat_template(self, msgs: list[dict[str, str]], **kw: Any) -> list[int]:
        self.seen.append(msgs)
        return [1, 2, 3]


def test_a_conversation_goes_through_the_chat_template_whole() -> None:
    codec = HFTokenizer.__new__(HFTokenizer)
    codec.tok, codec.chat, codec.eos_token_id = _ChatTokenizer(), True, 9
    conv = ({"role": "system", "content": "be brief"}, {"role": "user", "content": "4+4="})
    codec.encode_prompt("be brief\n4+4=", conv)
    codec.encode_prompt("1+1=")
    assert codec.tok.seen == [list(conv), [{"role": "user", "content": "1+1="}]]


# --------------------------------------------------------- prompts the model cannot take (issue 31)


def _long_prompts(tmp_path: Path) -> TaskConfig:
    rows = [{"prompt": f"{i % 10}+1=", "label": (i + 1) % 10} for i in range(8)]
    rows[3] = {"prompt": "1+" * 100 + "1=", "label": 1}  # 202 characters: 203 tokens with BOS
    rows[5] = {"prompt": "2+" * 70 + "2=", "label": 2}  # 142 characters
    return TaskConfig(dataset="slime", path=str(write_jsonl(tmp_path / "long.jsonl", rows)))


def _measure(task: TaskConfig) -> PromptLength | None:
    return prompt_measure(Config(task=task, rollout={"engine": "transformers"}))  # type: ignore[arg-type]


def test_a_prompt_longer_than_the_models_context_is_refused_at_load(tmp_path: Path) -> None:
    """Prompts longer than the model's context were trained on silently (the tiny model's 128
    positions).  Now the load refuses them, naming the count, the longest and the keys to set."""
    task = _long_prompts(tmp_path)
    assert len(task_prompts(task, 8, 0)) == 8  # no measure: as before
    with pytest.raises(ConfigError) as e:
        task_prompts(task, 8, 0, measure=_measure(task))
    assert "2 of 8 prompts are longer than 128 tokens (the model's context)" in str(e.value)
    assert "has 203" in str(e.value) and "task.filter_overlong_prompts=true" in str(e.value)
    short = task.model_copy(update={"max_prompt_length": 4})  # "0+1=" is 5 tokens with BOS
    with pytest.raises(
        ConfigError, match=r"8 of 8 prompts are longer than 4 tokens \(task.max_prompt_length\)"
    ):
        task_prompts(short, 8, 0, measure=_measure(short))


def test_filter_overlong_prompts_drops_them_with_a_warning_and_never_all(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    task = _long_prompts(tmp_path).model_copy(
        update={"filter_overlong_prompts": True, "max_prompt_length": 150}
    )
    with caplog.at_level(logging.WARNING, "rolloutpipe.tasks"):
        kept = task_prompts(task, 8, 0, measure=_measure(task))
    assert len(kept) == 7 and all(len(p.text) < 150 for p in kept)  # the 142-character one fits 150
    assert "1 of 8 prompts are longer than 150 tokens" in caplog.text and "dropped" in caplog.text
    none = task.model_copy(update={"max_prompt_length": 2})
    with pytest.raises(ConfigError, match="would drop them all"):
        task_prompts(none, 8, 0, measure=_measure(none))


def test_a_prompt_the_tokenizer_cannot_encode_is_refused_at_load_and_emulated_runs_are_not_checked(
    tmp_path: Path,
) -> None:
    """A character outside the tiny model's vocabulary failed every request at run time; now the load
    names the prompt.  The emulated engine (and an engine plugin) runs no model: nothing checked."""
    task = TaskConfig(
        dataset="slime", path=str(write_jsonl(tmp_path / "w.jsonl", [{"prompt": "W1=", "label": 1}]))
    )
    with pytest.raises(ConfigError, match=r"prompt 0 \('W1='\) cannot be tokenized: character 'W'"):
        task_prompts(task, 1, 0, measure=_measure(task))
    assert prompt_measure(Config(task=task, rollout={"engine": "emulated"})) is None  # type: ignore[arg-type]
    plugin = {"engine": "transformers", "engine_plugin": "x:y"}
    assert prompt_measure(Config(task=task, rollout=plugin)) is None  # type: ignore[arg-type]
