"""A fixed-prompt evaluation of the trainer's own fp32 policy, free of any pool's numerics.

A fleet's training reward mixes what the policy can do with what each pool's format does to
it: a degraded pool lowers it while the trainer's policy may be fine. The evaluation asks the
question a collapse is about: has the *trainer's* policy got worse? The same prompts every
time, sampled from an fp32 copy of the trainer's current weights with the same seed every
time (so two evaluations differ only through the weights), at the training temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from .pools import PoolSpec
from .sampler import PoolSampler
from .task import Episode, StringTask
from .tokenizer import CharTokenizer


@dataclass(frozen=True)
class Evaluation:
    """Fixed-prompt fp32 evaluation reward, recorded in ``SimStep.eval_reward``.

    Attributes:
        prompts: prompts evaluated (0 = no evaluation, the default); one answer each.
        every: evaluate at steps 0, every, 2 * every, ... (and on no other step).
    """

    prompts: int = 0
    every: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.prompts, int) and self.prompts >= 0):
            raise ValueError(f"expected integer evaluation prompts >= 0, got {self.prompts!r}")
        if not (isinstance(self.every, int) and self.every >= 1):
            raise ValueError(f"expected integer evaluation every >= 1, got {self.every!r}")

    def due(self, step: int) -> bool:
        return self.prompts > 0 and step % self.every == 0


class Evaluator:
    """Holds the fixed prompts and an fp32 copy of the policy to answer them."""

    def __init__(self, spec: Evaluation, task: StringTask, alphabet: str, model_config: PretrainedConfig,
                 tokenizer: CharTokenizer, seed: int) -> None:
        self.spec = spec
        self.episodes: list[Episode] = task.sample(spec.prompts, torch.Generator().manual_seed(seed), alphabet)
        self._sampler = PoolSampler(PoolSpec("eval", precision="fp32"), model_config, tokenizer)
        self._seed = seed
        self._max_new_tokens = task.max_answer_tokens() + 2

    def reward(self, state: dict[str, torch.Tensor], version: int, temperature: float) -> float:
        """Mean reward of the policy ``state`` on the fixed prompts (same sampling seed each time)."""
        self._sampler.load(state, version, "fp32")
        rollouts = self._sampler.rollout(self.episodes, temperature=temperature,
                                         max_new_tokens=self._max_new_tokens, seed=self._seed)
        return sum(ep.reward(r.answers) for ep, r in zip(self.episodes, rollouts)) / len(self.episodes)
