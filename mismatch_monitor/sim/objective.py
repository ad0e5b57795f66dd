"""The RL objective: the default one-step policy gradient, or PPO epochs over each batch.

PPO's old policy is where training frameworks differ, and where the mismatch enters:

* ``old_logprobs="trainer"``: the trainer re-scores the batch in fp32 before the first epoch
  (one more forward) and clips around that; the off-policy correction then weights each token
  (or sequence) by ``pi_old / mu``, the decoupled objective of truncated IS;
* ``old_logprobs="sampler"``: the engine's log-probs ``mu`` serve as the old policy (the shortcut
  that saves the recompute). The ratio ``pi / mu`` then carries the whole mismatch, PPO's clip is
  centred on the sampler rather than the trainer, and nothing is left for a correction to weight.

``ratio="sequence"`` takes one ratio per answer, ``exp(sum_t (log pi_t - log old_t))`` (the
product of the token ratios, sequence-level IS), so a long answer multiplies its tokens' errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Literal

import torch

from ..config import MetricConfig
from .trainer import Trainer, correction_weights

ObjectiveKind = Literal["pg", "ppo"]
RatioLevel = Literal["token", "sequence"]
OldLogprobs = Literal["trainer", "sampler"]
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class Objective:
    """How the trainer turns a batch into updates.

    Attributes:
        kind: ``pg`` (one step of ``-w * A * log pi``, the default) or ``ppo`` (clipped surrogate).
        epochs: PPO optimiser steps over each batch (each with a fresh forward); 1 with ``pg``.
        clip: PPO's epsilon: the ratio is clipped to ``[1 - clip, 1 + clip]``.
        ratio: ``token`` (one ratio per token, token-mean loss) or ``sequence`` (one ratio per
            answer, the product of its tokens' ratios; mean over answers).
        old_logprobs: the old policy of the ratio: ``trainer`` (fp32 recompute) or ``sampler``
            (the engine's log-probs; see the module docstring).
    """

    kind: ObjectiveKind = "pg"
    epochs: int = 1
    clip: float = 0.2
    ratio: RatioLevel = "token"
    old_logprobs: OldLogprobs = "trainer"

    def __post_init__(self) -> None:
        if self.kind not in ("pg", "ppo"):
            raise ValueError(f"expected objective kind 'pg' or 'ppo', got {self.kind!r}")
        if not (isinstance(self.epochs, int) and self.epochs >= 1):
            raise ValueError(f"expected integer epochs >= 1, got {self.epochs!r}")
        if self.kind == "pg" and (self.epochs, self.ratio, self.old_logprobs) != (1, "token", "trainer"):
            raise ValueError("expected epochs=1, ratio='token', old_logprobs='trainer' with kind 'pg' "
                             f"(the options of 'ppo'), got {self.epochs}, {self.ratio!r}, {self.old_logprobs!r}")
        if not (math.isfinite(self.clip) and 0.0 < self.clip < 1.0):
            raise ValueError(f"expected 0 < clip < 1, got {self.clip}")
        if self.ratio not in ("token", "sequence"):
            raise ValueError(f"expected ratio 'token' or 'sequence', got {self.ratio!r}")
        if self.old_logprobs not in ("trainer", "sampler"):
            raise ValueError(f"expected old_logprobs 'trainer' or 'sampler', got {self.old_logprobs!r}")


def ppo_loss(new: torch.Tensor, old: torch.Tensor, mismatch: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, objective: Objective, correction: str, thresholds: MetricConfig) -> torch.Tensor:
    """The clipped surrogate over ``[B, T]`` tensors (``mask``: tokens that get gradient).

    ``new``: log pi with gradient; ``old``: the old policy's log-probs; ``mismatch``:
    ``log pi_old - log mu`` (the correction's log-ratio, zero with the sampler as old);
    ``advantages``: ``[B]``.
    """
    log_ratio = torch.where(mask, new - old.detach(), torch.zeros_like(new))
    # like verl, the log-ratio is clamped to +-20 before exp: finite, however far the sampler is
    mismatch = torch.where(mask, mismatch.detach(), torch.zeros_like(new))
    lo, hi = 1.0 - objective.clip, 1.0 + objective.clip
    if objective.ratio == "sequence":
        rows = mask.any(1)
        ratio = log_ratio.sum(1)[rows].clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        weight = correction_weights(mismatch.sum(1)[rows], correction, thresholds)
        adv = advantages[rows]
        surrogate = torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
        return -(weight * surrogate).sum() / max(int(rows.sum()), 1)
    ratio = log_ratio[mask].clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    weight = correction_weights(mismatch[mask], correction, thresholds)
    adv = advantages.unsqueeze(1).expand_as(mask)[mask]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(lo, hi) * adv)
    return -(weight * surrogate).sum() / max(int(mask.sum()), 1)


def ppo_update(trainer: Trainer, rescore: Callable[[], torch.Tensor], first: torch.Tensor,
               sampler_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               objective: Objective) -> tuple[float, float]:
    """``objective.epochs`` optimiser steps on one batch, one version bump.

    ``first``: log pi ``[B, T]`` of the batch's scoring forward (with gradient: epoch 1 uses it);
    ``rescore()`` gives a fresh one for each later epoch. Returns the last epoch's loss and the
    largest gradient norm (before clipping) of the epochs.
    """
    if objective.old_logprobs == "trainer":
        old, mismatch = first.detach(), first.detach() - sampler_logprobs
    else:
        old, mismatch = sampler_logprobs, torch.zeros_like(sampler_logprobs)
    new, losses, norms = first, [], []
    for epoch in range(objective.epochs):
        if epoch:
            new = rescore()
        loss = ppo_loss(new, old, mismatch, advantages, mask, objective, trainer.correction, trainer.thresholds)
        norms.append(trainer.optimise(loss))
        losses.append(float(loss.detach()))
    trainer.version += 1
    return losses[-1], max(norms)
