"""A character tokenizer built locally: no download, one id per character.

The vocabulary is three special tokens, the task's instruction symbols and a small alphabet.
Ids are stable (they depend only on the alphabet), so a run's token ids mean the same thing
in every process that rebuilds the tokenizer from the same alphabet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
# instruction symbols of the toy task (see task.py): copy, reverse, sort, answer, next turn
SYMBOLS: tuple[str, ...] = (">", "<", "^", "=", "|")


@dataclass(frozen=True)
class CharTokenizer:
    """Maps characters to ids and back.

    Attributes:
        alphabet: the letters strings are made of (distinct, none of them a symbol).
    """

    alphabet: str = "abcdefghijkl"
    _tokens: tuple[str, ...] = field(init=False, repr=False)
    _ids: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.alphabet) < 2 or len(set(self.alphabet)) != len(self.alphabet):
            raise ValueError(f"expected an alphabet of at least 2 distinct characters, got {self.alphabet!r}")
        clash = sorted(set(self.alphabet) & set(SYMBOLS))
        if clash:
            raise ValueError(f"expected alphabet without the task symbols {SYMBOLS}, got {clash}")
        tokens = (PAD, BOS, EOS) + SYMBOLS + tuple(self.alphabet)
        object.__setattr__(self, "_tokens", tokens)
        object.__setattr__(self, "_ids", {t: i for i, t in enumerate(tokens)})

    @property
    def tokens(self) -> tuple[str, ...]:
        """Every token, in id order (what a Hugging Face vocabulary of the same ids is built from)."""
        return self._tokens

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def pad_id(self) -> int:
        return self._ids[PAD]

    @property
    def bos_id(self) -> int:
        return self._ids[BOS]

    @property
    def eos_id(self) -> int:
        return self._ids[EOS]

    def encode(self, text: str) -> list[int]:
        """Characters of ``text`` (letters and symbols only) -> ids."""
        try:
            return [self._ids[c] for c in text]
        except KeyError as err:
            raise ValueError(f"expected characters from {self.alphabet!r} or {SYMBOLS}, got {err.args[0]!r}") from None

    def decode(self, ids: Sequence[int] | torch.Tensor, *, stop_at_eos: bool = True) -> str:
        """Ids -> text; special tokens are dropped, decoding stops at the first EOS."""
        out: list[str] = []
        for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids):
            if stop_at_eos and i == self.eos_id:
                break
            if 0 <= i < len(self._tokens) and i > self.eos_id:
                out.append(self._tokens[i])
        return "".join(out)
