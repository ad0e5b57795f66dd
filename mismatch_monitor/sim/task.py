"""A verifiable toy task: transform a string of letters, over one or several turns.

Turn 0's prompt is ``<bos> OP letters =``; the answer is ``OP(letters)`` followed by EOS, where
OP is copy (``>``), reverse (``<``) or sort (``^``). In the multi-turn variant the environment
then says ``| OP' =`` and the next answer is ``OP'`` applied to the model's *own* previous
answer, so every turn is checkable from its context alone.

Reward of one turn: the share of positions where the answer matches the target, over the
longer of the two (a missing EOS counts as a truncated answer). Reward of an episode: the mean
over its turns, in [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from .tokenizer import CharTokenizer

Op = Literal[">", "<", "^"]
OP_NAMES: dict[str, str] = {">": "copy", "<": "reverse", "^": "sort"}


def apply_op(op: str, text: str) -> str:
    if op == ">":
        return text
    if op == "<":
        return text[::-1]
    if op == "^":
        return "".join(sorted(text))
    raise ValueError(f"expected an op in {sorted(OP_NAMES)}, got {op!r}")


def turn_reward(target: str, answer: str) -> float:
    """Share of matching positions over the longer string; 1.0 when both are empty."""
    width = max(len(target), len(answer))
    if width == 0:
        return 1.0
    return sum(a == b for a, b in zip(target, answer)) / width


@dataclass(frozen=True)
class Episode:
    """One prompt: the source letters and the op of every turn."""

    source: str
    ops: tuple[str, ...]
    preamble: str = ""

    @property
    def env(self) -> str:
        """Environment label: the op of turn 0 (``copy``/``reverse``/``sort``)."""
        return OP_NAMES[self.ops[0]]

    def prompt(self) -> str:
        return f"{self.preamble}{self.ops[0]}{self.source}="

    @staticmethod
    def follow_up(op: str) -> str:
        return f"|{op}="

    def reward(self, answers: Sequence[str]) -> float:
        """Mean turn reward; answer k is judged against op_k of answer k-1 (the source for k=0)."""
        if len(answers) != len(self.ops):
            raise ValueError(f"expected {len(self.ops)} answers, got {len(answers)}")
        previous, total = self.source, 0.0
        for op, answer in zip(self.ops, answers):
            total += turn_reward(apply_op(op, previous), answer)
            previous = answer
        return total / len(self.ops)

    def reference_answers(self) -> list[str]:
        out, previous = [], self.source
        for op in self.ops:
            previous = apply_op(op, previous)
            out.append(previous)
        return out


@dataclass(frozen=True)
class StringTask:
    """Episode generator.

    Attributes:
        min_length, max_length: source letters per episode (inclusive).
        turns: answers per episode (1 = single-turn).
        ops: the ops prompts are drawn from.
        preamble: text every prompt starts with (after BOS), like a system prompt shared by all
            requests; it gives an inference engine's prefix cache something to reuse.
    """

    min_length: int = 3
    max_length: int = 14
    turns: int = 1
    ops: tuple[str, ...] = (">", "<", "^")
    preamble: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "ops", tuple(self.ops))
        if not 1 <= self.min_length <= self.max_length:
            raise ValueError(f"expected 1 <= min_length <= max_length, got {self.min_length}, {self.max_length}")
        if not 1 <= self.turns <= 8:
            raise ValueError(f"expected 1 <= turns <= 8, got {self.turns}")
        bad = [op for op in self.ops if op not in OP_NAMES]
        if not self.ops or bad:
            raise ValueError(f"expected ops from {sorted(OP_NAMES)}, got {self.ops}")

    def max_answer_tokens(self) -> int:
        """Longest correct answer of one turn, EOS included."""
        return self.max_length + 1

    def sample(self, n: int, generator: torch.Generator, alphabet: str) -> list[Episode]:
        """``n`` episodes drawn with ``generator`` (reproducible)."""
        lengths = torch.randint(self.min_length, self.max_length + 1, (n,), generator=generator)
        letters = torch.randint(0, len(alphabet), (n, self.max_length), generator=generator)
        ops = torch.randint(0, len(self.ops), (n, self.turns), generator=generator)
        return [Episode("".join(alphabet[j] for j in letters[i, : lengths[i]].tolist()),
                        tuple(self.ops[j] for j in ops[i].tolist()), self.preamble) for i in range(n)]

    def demonstration(self, episode: Episode, tokenizer: CharTokenizer) -> tuple[list[int], list[int]]:
        """Token ids of the whole reference dialogue and its response mask (1 = answer token)."""
        ids, mask = [tokenizer.bos_id], [0]
        for k, (op, answer) in enumerate(zip(episode.ops, episode.reference_answers())):
            context = episode.prompt() if k == 0 else Episode.follow_up(op)
            ids += tokenizer.encode(context)
            mask += [0] * len(context)
            ids += tokenizer.encode(answer) + [tokenizer.eos_id]
            mask += [1] * (len(answer) + 1)
        return ids, mask
