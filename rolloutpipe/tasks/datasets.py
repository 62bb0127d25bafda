"""Shipped verifiable tasks.  A dataset is a dotted path to ``f(num_prompts, seed) -> list[Prompt]``.

A dataset that reads a file takes a keyword argument ``path`` (``task.path`` in the config).  A
dataset with a held-out evaluation split takes ``split="train" | "eval"`` and must keep the two
disjoint: ``eval.every`` in the config needs one.
"""

from __future__ import annotations

import inspect
import json
import logging
import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rolloutpipe.errors import ConfigError
from rolloutpipe.plugins import import_string

if TYPE_CHECKING:
    from rolloutpipe.config import TaskConfig

log = logging.getLogger("rolloutpipe.tasks")


@dataclass(frozen=True)
class Prompt:
    """A prompt and its answer; a file dataset (``data.py``) may also give the prompt as chat
    ``messages`` (then ``text`` is their contents) and what a verl or slime reward function reads."""

    text: str
    answer: str
    messages: tuple[dict[str, str], ...] = field(default=(), hash=False)
    data_source: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict, hash=False)


def mod10_addition(num_prompts: int, seed: int) -> list[Prompt]:
    """``a+b=`` with single digits; the answer is ``(a+b) mod 10``.  100 distinct prompts."""
    rng = random.Random(seed)
    base = [Prompt(f"{a}+{b}=", str((a + b) % 10)) for a in range(10) for b in range(10)]
    return [base[rng.randrange(len(base))] for _ in range(num_prompts)]


def successor(num_prompts: int, seed: int) -> list[Prompt]:
    """``a+1=`` -> ``(a+1) mod 10``: the easiest task, learnt in seconds."""
    rng = random.Random(seed)
    return [Prompt(f"{a}+1=", str((a + 1) % 10)) for a in (rng.randrange(10) for _ in range(num_prompts))]


DIGIT_OPS = {"-": "copy", "+": "add one to every digit (mod 10)", "*": "reverse"}


def digit_ops_answer(prompt: str) -> str:
    """``-3141=`` -> ``3141``; ``+3141=`` -> ``4252``; ``*3141=`` -> ``1413``."""
    op, digits = prompt[0], prompt[1:].rstrip("=")
    if op == "-":
        return digits
    if op == "+":
        return "".join(str((int(c) + 1) % 10) for c in digits)
    if op == "*":
        return digits[::-1]
    raise ValueError(f"not a digit_ops prompt: {prompt!r}")


def digit_ops_is_eval(prompt: str) -> bool:
    """The held-out split: one prompt in ten, by a hash of its text, whatever the seed."""
    return zlib.crc32(prompt.encode()) % 10 == 0


def digit_ops(num_prompts: int, seed: int, split: str = "train", max_len: int = 6) -> list[Prompt]:
    """``<op><digits>=``: copy (``-``), add one to each digit (``+``) or reverse (``*``) a string of
    1 to ``max_len`` digits.  The answer is several tokens long and must end with EOS.

    A task where allocation matters: each answer digit is a chance to fail, so prompts of one digit
    are soon solved always, six reversed digits almost never, and the rest sometimes.  One prompt in
    ten (``digit_ops_is_eval``) is held out: ``split="eval"`` draws only those, ``"train"`` never.
    Op and length are uniform; with the same seed the same prompts come in the same order.
    """
    if split not in ("train", "eval"):
        raise ConfigError(f"digit_ops: split must be 'train' or 'eval', not {split!r}")
    rng = random.Random(f"digit_ops/{split}/{seed}")
    out: list[Prompt] = []
    while len(out) < num_prompts:
        n = rng.randint(1, max_len)
        text = rng.choice(sorted(DIGIT_OPS)) + "".join(rng.choice("0123456789") for _ in range(n)) + "="
        if digit_ops_is_eval(text) == (split == "eval"):
            out.append(Prompt(text, digit_ops_answer(text)))
    return out


def long_add_is_eval(prompt: str) -> bool:
    """The held-out split of ``long_add``: one prompt in ten, by a hash of its text."""
    return zlib.crc32(b"long_add/" + prompt.encode()) % 10 == 0


def long_add(
    num_prompts: int, seed: int, split: str = "train", min_digits: int = 2, max_digits: int = 4
) -> list[Prompt]:
    """``a+b=`` with ``a`` and ``b`` of ``min_digits`` to ``max_digits`` digits; the answer is the
    sum's digits.  The task of ``configs/agent.yaml``: the tiny model cannot add numbers this long,
    and the calculator can (``task.tool_format: arith``: a response `` a+b=`` calls it, and the
    result's digits follow), so its reward is the share of responses that call it and copy the
    prompt right.  One prompt in ten (``long_add_is_eval``) is held out."""
    if split not in ("train", "eval"):
        raise ConfigError(f"long_add: split must be 'train' or 'eval', not {split!r}")
    if not 1 <= min_digits <= max_digits:
        raise ConfigError(f"long_add: need 1 <= min_digits <= max_digits, not {min_digits}, {max_digits}")
    rng = random.Random(f"long_add/{split}/{seed}")
    out: list[Prompt] = []

    def number() -> int:
        n = rng.randint(min_digits, max_digits)
        return rng.randrange(10 ** (n - 1), 10**n)

    while len(out) < num_prompts:
        a, b = number(), number()
        text = f"{a}+{b}="
        if long_add_is_eval(text) == (split == "eval"):
            out.append(Prompt(text, str(a + b)))
    return out


def long_add_warm(num_prompts: int, seed: int, split: str = "train", tool_share: float = 0.5) -> list[Prompt]:
    """The warm start of ``configs/agent.yaml``: ``long_add``'s train prompts, a ``tool_share`` of
    them answered with the calculator's call and its result (`` a+b=<sum>``), the rest with the sum
    written directly (which the tiny model gets wrong).  The base model so learns the call's format
    and to stop after its result, and calls the tool on about that share of prompts: what RL then
    has to raise."""
    rng = random.Random(f"long_add_warm/{seed}")
    rows = long_add(num_prompts, seed, split)
    return [Prompt(p.text, f" {p.text}{p.answer}" if rng.random() < tool_share else p.answer) for p in rows]


def jsonl(num_prompts: int, seed: int, path: str = "") -> list[Prompt]:
    """Prompts from a JSON-lines file with ``prompt`` and ``answer`` fields (GSM8K's ``question``
    and ``#### answer`` are understood too), shuffled with ``seed`` and cycled to ``num_prompts``."""
    if not path:
        raise ConfigError("the jsonl dataset needs task.path (a .jsonl file)")
    rows: list[Prompt] = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read task.path {path!r}: {e}") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
            prompt = d["prompt"] if "prompt" in d else d["question"]
            answer = str(d["answer"]).rsplit("####", 1)[-1].strip()
        except (ValueError, KeyError, TypeError) as e:
            msg = f"{path}:{n}: expected an object with prompt (or question) and answer: {e}"
            raise ConfigError(msg) from e
        rows.append(Prompt(str(prompt), answer))
    if not rows:
        raise ConfigError(f"{path} holds no prompts")
    random.Random(seed).shuffle(rows)
    return [rows[i % len(rows)] for i in range(num_prompts)]


# ``task.dataset`` names of the shipped readers (any other value is a dotted path)
DATASETS = {
    "verl": "rolloutpipe.tasks.formats:verl",
    "slime": "rolloutpipe.tasks.formats:slime",
    "hf": "rolloutpipe.tasks.formats:hf",
    "jsonl": "rolloutpipe.tasks.datasets:jsonl",
}


def load_dataset(
    dotted: str, num_prompts: int, seed: int, path: str = "", split: str = "", **options: str
) -> list[Prompt]:
    """The dataset's prompts; ``split`` ("train" or "eval") only for datasets that take one.

    ``options`` (``eval_path``, ``prompt_key`` …: the file datasets' ``task.*`` keys) go to the
    dataset when set; setting one that the dataset does not take is an error, not ignored.
    """
    fn: Callable[..., list[Prompt]] = import_string(DATASETS.get(dotted, dotted))
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    kw: dict[str, str] = {"path": path} if path else {}
    kw.update({k: v for k, v in options.items() if v})
    ignored = [k for k in kw if k != "path" and k not in params and not takes_any]
    if ignored:
        keys = ", ".join(f"task.{k}" for k in ignored)
        raise ConfigError(f"dataset {dotted!r} does not read {keys}: unset it, or use a file dataset")
    if split:
        if "split" not in params and not takes_any:
            raise ConfigError(f"dataset {dotted!r} has no held-out split (it takes no 'split' argument)")
        kw["split"] = split
    prompts = fn(num_prompts, seed, **kw)
    if not prompts:
        raise ConfigError(f"dataset {dotted!r} returned no prompts")
    return prompts


class Measure(Protocol):
    """A prompt's length in tokens (``model.lm.PromptLength``), and the most it may have."""

    limit: int | None
    what: str  # where the limit comes from, for the error

    def __call__(self, text: str, messages: Sequence[Any] = ()) -> int: ...


def fit_prompts(prompts: list[Prompt], measure: Measure, drop: bool, split: str = "") -> list[Prompt]:
    """The prompts of at most ``measure.limit`` tokens; a longer one is an error naming it, or, with
    ``drop`` (``task.filter_overlong_prompts``), left out with a warning.  A prompt the tokenizer
    cannot encode is an error either way: every request of it would fail."""
    lengths = []
    for i, p in enumerate(prompts):
        try:
            lengths.append(measure(p.text, p.messages))
        except ValueError as e:
            raise ConfigError(f"prompt {i} ({p.text[:40]!r}) cannot be tokenized: {e}") from e
    if measure.limit is None:
        return prompts
    over = [i for i, n in enumerate(lengths) if n > measure.limit]
    if not over:
        return prompts
    name = f"{split} prompts" if split else "prompts"
    worst = max(over, key=lengths.__getitem__)
    what = (
        f"{len(over)} of {len(prompts)} {name} are longer than {measure.limit} tokens ({measure.what}); "
        f"the longest, prompt {worst} ({prompts[worst].text[:40]!r}), has {lengths[worst]}"
    )
    if not drop:
        raise ConfigError(
            f"{what}: set task.max_prompt_length, or task.filter_overlong_prompts=true to drop them"
        )
    if len(over) == len(prompts):
        raise ConfigError(f"{what}: task.filter_overlong_prompts would drop them all")
    log.warning("%s: dropped (task.filter_overlong_prompts)", what)
    skip = set(over)
    return [p for i, p in enumerate(prompts) if i not in skip]


def task_prompts(
    task: TaskConfig, num_prompts: int, seed: int, split: str = "", measure: Measure | None = None
) -> list[Prompt]:
    """``load_dataset`` with the task config's file and field options; with ``measure``, only the
    prompts that fit (``fit_prompts``)."""
    prompts = load_dataset(
        task.dataset,
        num_prompts,
        seed,
        task.path,
        split,
        eval_path=task.eval_path,
        prompt_key=task.prompt_key,
        label_key=task.label_key,
        metadata_key=task.metadata_key,
    )
    return prompts if measure is None else fit_prompts(prompts, measure, task.filter_overlong_prompts, split)
