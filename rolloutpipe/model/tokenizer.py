"""Tokenizers: prompt text to token ids, response ids to text (not a wire codec: that is ``broker/codec.py``).

The tiny model's character vocabulary (``CharTokenizer``; ``build_tokenizer`` saves the same ids as an
HF tokenizer next to the model) and a real checkpoint's own tokenizer with its chat template
(``HFTokenizer``).  ``lm.tokenizer_for`` picks one for a config.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

VOCAB = ["<pad>", "<bos>", "<eos>", *"0123456789", *"+=-* "]  # 18 tokens, char level
PAD, BOS, EOS = 0, 1, 2


def build_tokenizer() -> Any:
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as WordTokenizer
    from transformers import PreTrainedTokenizerFast

    tok = WordTokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )


class Tokenizer(Protocol):
    """Prompt text -> token ids (BOS/chat template included); response ids -> text.

    ``messages`` (a dataset's prompt as a conversation, ``tasks/formats.py``) go through the chat
    template where the tokenizer has one; ``text`` (their contents) is what a tokenizer without one encodes.
    """

    eos_token_id: int

    def encode_prompt(self, text: str, messages: Sequence[Mapping[str, str]] = ()) -> np.ndarray: ...

    def encode_text(self, text: str) -> np.ndarray:
        """``text`` as it continues a sequence: no BOS, no template (an episode's tool result)."""
        ...

    def decode(self, ids: np.ndarray) -> str: ...


class CharTokenizer:
    """Fast encode/decode for the char vocabulary (same ids as the saved tokenizer)."""

    eos_token_id = EOS

    def __init__(self) -> None:
        self.ids = {t: i for i, t in enumerate(VOCAB)}

    def encode_prompt(self, text: str, messages: Sequence[Mapping[str, str]] = ()) -> np.ndarray:
        try:
            return np.asarray([BOS] + [self.ids[c] for c in text], dtype=np.int32)
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the vocabulary") from e

    def encode_text(self, text: str) -> np.ndarray:
        """Each character's id; one outside the vocabulary is dropped (a tool's output)."""
        return np.asarray([self.ids[c] for c in text if c in self.ids], dtype=np.int32)

    def decode(self, ids: np.ndarray) -> str:
        return "".join(VOCAB[int(i)] for i in ids if int(i) > EOS)


class HFTokenizer:
    """A real checkpoint's own tokenizer (``model.path``), with its chat template if it has one."""

    def __init__(self, path: Path, chat_template: bool) -> None:
        from transformers import AutoTokenizer

        self.tok: Any = AutoTokenizer.from_pretrained(path)
        self.chat = chat_template and getattr(self.tok, "chat_template", None) is not None
        eos = self.tok.eos_token_id
        if eos is None:
            raise ValueError(f"the tokenizer at {path} has no eos_token_id")
        self.eos_token_id = int(eos)

    def encode_prompt(self, text: str, messages: Sequence[Mapping[str, str]] = ()) -> np.ndarray:
        if self.chat:
            msgs = [dict(m) for m in messages] or [{"role": "user", "content": text}]
            ids = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
                ids = ids["input_ids"]
        else:
            ids = self.tok(text, add_special_tokens=True)["input_ids"]
        return np.asarray(ids, dtype=np.int32)

    def encode_text(self, text: str) -> np.ndarray:
        return np.asarray(self.tok(text, add_special_tokens=False)["input_ids"], dtype=np.int32)

    def decode(self, ids: np.ndarray) -> str:
        text: str = self.tok.decode([int(i) for i in ids], skip_special_tokens=True)
        return text
