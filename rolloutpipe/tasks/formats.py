"""Datasets in the formats users already have, read with HF ``datasets`` (config ``task.dataset``).

A user coming from verl or slime has prepared data; RolloutPipe takes it as it is:

* ``verl``: verl's parquet rows (``examples/data_preprocess/*.py`` write them): ``prompt`` a list of
  chat messages, ``reward_model.ground_truth`` the answer, ``data_source`` and ``extra_info`` handed
  to the reward function (``compute_score(data_source, solution_str, ground_truth, extra_info)``).
* ``slime``: slime's JSON lines, read the way ``--input-key`` / ``--label-key`` / ``--metadata-key``
  say: a prompt (a string, or a list of chat messages) and a label.  slime's ``--apply-chat-template``
  is ``model.chat_template`` here; a prompt given as messages always goes through the template.
* ``hf``: any local file HF ``datasets`` reads (parquet, JSON lines, CSV, arrow) or a folder written
  by ``Dataset.save_to_disk``, with the field names given in config.

The field names default per format (:data:`FORMATS`) and are overridden by ``task.prompt_key``,
``task.label_key`` (dotted for a nested field) and ``task.metadata_key``.  The rows are read by
``datasets``, not by hand; this module only checks each row's fields, so that a malformed row is an
error naming the file, the row and the field, and a row without an answer is reported and skipped,
never trained on.  ``task.eval_path`` is the held-out file that ``eval.every`` scores.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutpipe.errors import ConfigError
from rolloutpipe.tasks.datasets import Prompt

log = logging.getLogger("rolloutpipe.data")


@dataclass(frozen=True)
class Fields:
    """Where a format keeps the prompt, the answer, and what the reward function also gets."""

    prompt: str
    label: str
    metadata: str = ""
    data_source: str = ""


# verl: verl/utils/dataset/rl_dataset.py reads ``prompt`` (prompt_key), and its reward manager passes
# ``data_source``, ``reward_model.ground_truth`` and ``extra_info`` to compute_score.  slime:
# ``--input-key`` / ``--label-key`` / ``--metadata-key`` (its examples use prompt / label / metadata).
FORMATS: dict[str, Fields] = {
    "verl": Fields("prompt", "reward_model.ground_truth", "extra_info", "data_source"),
    "slime": Fields("prompt", "label", "metadata"),
    "hf": Fields("prompt", "answer"),
}

# Which of HF datasets' packaged builders reads a file, by its suffix.
_BUILDERS = {
    ".parquet": "parquet",
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".arrow": "arrow",
}


def read_rows(path: str) -> list[dict[str, Any]]:
    """Every row of ``path`` as a dict, read by HF ``datasets`` (no hub access: local files only)."""
    import datasets

    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"dataset file {p} does not exist (task.path / task.eval_path)")
    datasets.disable_progress_bars()
    try:
        if p.is_dir():
            ds: Any = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if "train" not in ds:
                    raise ConfigError(f"{p} holds splits {sorted(ds)}: point task.path at one of them")
                ds = ds["train"]
        else:
            builder = _BUILDERS.get(p.suffix.lower())
            if builder is None:
                known = ", ".join(sorted(_BUILDERS))
                raise ConfigError(f"{p}: cannot tell the file's format from its suffix (one of {known})")
            ds = datasets.load_dataset(builder, data_files=str(p), split="train")
    except ConfigError:
        raise
    except Exception as e:  # datasets wraps pyarrow's parse errors; name the line where we can
        raise ConfigError(f"{p}: cannot read it as {p.suffix or 'a dataset'}: {_why(p, e)}") from e
    return list(ds)


def _why(p: Path, e: BaseException) -> str:
    """The reader's error, with the first bad line of a JSON-lines file (pyarrow's "row" counts
    within a block, so it does not name the line)."""
    if p.suffix.lower() in (".jsonl", ".json"):
        try:
            lines = p.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as read_error:
            return str(read_error)
        for n, line in enumerate(lines, 1):
            if line.strip():
                try:
                    json.loads(line)
                except ValueError as bad:
                    return f"line {n} is not JSON ({bad})"
    cause = e.__cause__ or e.__context__
    return f"{e}" + (f" ({cause})" if cause else "")


def _get(row: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    """``row["a"]["b"]`` for ``"a.b"``; (False, None) when a level is missing or None."""
    cur: Any = row
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or cur.get(part) is None:
            return False, None
        cur = cur[part]
    return True, cur


def _messages(value: Any, where: str) -> tuple[str, tuple[dict[str, str], ...]]:
    """A prompt field -> (its text, its chat messages or ``()``).  The text of a conversation is its
    messages' contents joined by newlines: what a codec without a chat template encodes."""
    if isinstance(value, str):
        return value, ()
    if isinstance(value, list | tuple) and value:
        msgs = []
        for i, m in enumerate(value):
            if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m):
                raise ConfigError(
                    f"{where}: message {i} is {m!r}; a prompt is a string or a list of chat messages "
                    "{'role': ..., 'content': ...}"
                )
            msgs.append({"role": str(m["role"]), "content": str(m["content"] or "")})
        return "\n".join(m["content"] for m in msgs), tuple(msgs)
    raise ConfigError(
        f"{where}: expected a string or a non-empty list of chat messages, got {type(value).__name__} "
        f"{value!r:.80}"
    )


def to_prompts(
    rows: Iterable[Mapping[str, Any]], fields: Fields, source: str
) -> tuple[list[Prompt], list[str]]:
    """Rows -> prompts.  A malformed row raises; a row without an answer is skipped and reported."""
    out: list[Prompt] = []
    skipped: list[str] = []  # why each was skipped: ``file: row N: …``
    for n, row in enumerate(rows, 1):
        here = f"{source}: row {n}"
        ok, raw_prompt = _get(row, fields.prompt)
        if not ok:
            have = ", ".join(sorted(row)) or "none"
            raise ConfigError(
                f"{here}: no field {fields.prompt!r} (task.prompt_key); the row's fields are {have}"
            )
        text, messages = _messages(raw_prompt, f"{here}: field {fields.prompt!r}")
        ok, label = _get(row, fields.label)
        if isinstance(label, list | tuple) and len(label) == 1:
            label = label[0]  # verl's ground_truth is sometimes a one-element list
        if not ok or (isinstance(label, str) and not label.strip()):
            skipped.append(f"{here}: no answer in field {fields.label!r} (task.label_key): skipped")
            continue
        if isinstance(label, Mapping | list | tuple):
            raise ConfigError(
                f"{here}: field {fields.label!r} is a {type(label).__name__}, not an answer; "
                "point task.label_key at the answer itself (dotted for a nested field)"
            )
        extra: dict[str, Any] = {}
        if fields.metadata:
            ok, meta = _get(row, fields.metadata)
            if ok and not isinstance(meta, Mapping):
                raise ConfigError(
                    f"{here}: field {fields.metadata!r} (task.metadata_key) is a "
                    f"{type(meta).__name__}, not a mapping"
                )
            extra = _plain(dict(meta)) if ok else {}
        data_source = ""
        if fields.data_source:
            ok, ds = _get(row, fields.data_source)
            data_source = str(ds) if ok else ""
        out.append(Prompt(text, str(label), messages=messages, data_source=data_source, extra_info=extra))
    return out, skipped


def _plain(value: Any) -> Any:
    """Arrow's values as msgpack can carry them (numpy scalars and arrays become Python ones)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return _plain(value.tolist())
    if isinstance(value, str | int | float | bool | bytes) or value is None:
        return value
    return str(value)  # dates, decimals …: their text


def load_file(
    fmt: str,
    num_prompts: int,
    seed: int,
    path: str = "",
    split: str = "train",
    eval_path: str = "",
    prompt_key: str = "",
    label_key: str = "",
    metadata_key: str = "",
) -> list[Prompt]:
    """``num_prompts`` prompts of the file (``task.path``, or ``task.eval_path`` for the held-out
    split), shuffled with ``seed`` and cycled: prompts recur every epoch, as in verl and slime."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown dataset format {fmt!r}: one of {', '.join(FORMATS)}")
    if split not in ("train", "eval"):
        raise ConfigError(f"{fmt} dataset: split must be 'train' or 'eval', not {split!r}")
    file = eval_path if split == "eval" else path
    if not file:
        key = "task.eval_path" if split == "eval" else "task.path"
        raise ConfigError(f"the {fmt} dataset needs {key} (a file, or a save_to_disk folder)")
    base = FORMATS[fmt]
    fields = Fields(
        prompt_key or base.prompt,
        label_key or base.label,
        metadata_key or base.metadata,
        base.data_source,
    )
    prompts, skipped = to_prompts(read_rows(file), fields, file)
    if skipped:
        shown = "\n  ".join(skipped[:5]) + (f"\n  … and {len(skipped) - 5} more" if len(skipped) > 5 else "")
        log.warning("%s: %d of %d rows have no answer and are skipped:\n  %s",
                    file, len(skipped), len(skipped) + len(prompts), shown)  # fmt: skip
    if not prompts:
        raise ConfigError(f"{file} holds no usable prompts ({len(skipped)} rows without an answer)")
    random.Random(seed).shuffle(prompts)
    return [prompts[i % len(prompts)] for i in range(num_prompts)]


def verl(num_prompts: int, seed: int, **kw: Any) -> list[Prompt]:
    """verl's parquet (or any file with its fields): see the module docstring."""
    return load_file("verl", num_prompts, seed, **kw)


def slime(num_prompts: int, seed: int, **kw: Any) -> list[Prompt]:
    """slime's JSON lines (or any file with its fields): see the module docstring."""
    return load_file("slime", num_prompts, seed, **kw)


def hf(num_prompts: int, seed: int, **kw: Any) -> list[Prompt]:
    """Any local file HF datasets reads, with the field names given in config."""
    return load_file("hf", num_prompts, seed, **kw)
