"""The fp32 trainer: re-scores the sampled tokens with one full forward and takes a GRPO step.

The loss is the token-mean policy gradient ``-mean_t(w_t * A_i * log pi_t)`` with group-
normalised advantages ``A_i`` and a stop-gradient weight ``w_t`` from the off-policy correction:

* ``none``: w = 1 (the sampler's tokens are treated as if ``pi`` had drawn them);
* ``tis``: truncated IS, w = min(rho, C) with C = ``MetricConfig.tis_cap``;
* ``mis``: masked IS, w = rho inside ``MetricConfig.icepop_band`` and 0 outside (IcePop).

The cap and the band come from the same :class:`MetricConfig` the monitor counts with, so the
fractions it reports are exactly what this correction clipped or masked.
"""

from __future__ import annotations

from typing import Literal

import torch

from ..config import MetricConfig
from .policy import RouterTap

Correction = Literal["none", "tis", "mis"]
CORRECTIONS: tuple[str, ...] = ("none", "tis", "mis")


def kept_set(logp: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The trainer's own top-k / top-p set of ``logp`` ``[..., V]`` (bool, same shape).

    A token is kept when fewer than ``top_k`` tokens beat it and the probability mass of the
    tokens ranked above it is below ``top_p`` (computed on the top-k-renormalised distribution).
    """
    keep = torch.ones_like(logp, dtype=torch.bool)
    if top_k > 0:
        kth = logp.topk(min(top_k, logp.shape[-1]), dim=-1).values[..., -1:]
        keep &= logp >= kth
    if top_p < 1.0:
        probs = torch.softmax(logp.masked_fill(~keep, -torch.inf), -1)
        sorted_p, order = probs.sort(-1, descending=True)
        mass_above = sorted_p.cumsum(-1) - sorted_p
        keep_sorted = mass_above < top_p
        keep &= torch.zeros_like(keep).scatter(-1, order, keep_sorted)
    return keep


def correction_weights(log_ratio: torch.Tensor, correction: str, thresholds: MetricConfig) -> torch.Tensor:
    """Stop-gradient per-token weights of ``correction`` for ``log_ratio`` = log pi - log mu."""
    if correction == "none":
        return torch.ones_like(log_ratio)
    rho = log_ratio.exp()
    if correction == "tis":
        return rho.clamp(max=thresholds.tis_cap)
    if correction == "mis":
        lo, hi = thresholds.icepop_band
        return torch.where((rho > lo) & (rho <= hi), rho, torch.zeros_like(rho))
    raise ValueError(f"expected a correction in {CORRECTIONS}, got {correction!r}")


class Trainer:
    """Owns the fp32 policy and its optimiser; ``version`` counts the updates taken."""

    def __init__(self, model: torch.nn.Module, *, learning_rate: float, grad_clip: float,
                 correction: str, thresholds: MetricConfig) -> None:
        if correction not in CORRECTIONS:
            raise ValueError(f"expected a correction in {CORRECTIONS}, got {correction!r}")
        self.model = model
        self.correction = correction
        self.thresholds = thresholds
        self.grad_clip = grad_clip
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
        self.version = 0

    def state(self) -> dict[str, torch.Tensor]:
        """A detached fp32 copy of the weights (what a weight sync would send)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def score(self, ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Full forward over right-padded ``ids`` ``[B, T]``.

        Returns ``logp`` ``[B, T, V]`` (row p: log-probs at ``temperature`` of the token at
        position p, row 0 unused) with gradient, and ``[B, T, L, K]`` uint8 experts of the
        position that produced each token (None for a dense model).
        """
        self.model.train()
        tap = RouterTap(self.model)
        with tap:
            logits = self.model(input_ids=ids, attention_mask=attention_mask).logits.float()
        logp = torch.log_softmax(logits / temperature, -1)               # [B, T, V] next-token
        logp = torch.cat([torch.zeros_like(logp[:, :1]), logp[:, :-1]], 1)
        experts = None
        if tap.active:
            B, T = ids.shape
            L, _, K = tap.calls[0].shape
            per_pos = tap.calls[0].view(L, B, T, K).permute(1, 2, 0, 3)   # [B, T, L, K]
            experts = torch.cat([per_pos[:, :1], per_pos[:, :-1]], 1).contiguous()
        return logp, experts

    def update(self, trainer_logprobs: torch.Tensor, sampler_logprobs: torch.Tensor,
               advantages: torch.Tensor) -> tuple[float, float]:
        """One GRPO step over ``[N]`` tokens; returns (loss, gradient norm before clipping)."""
        weights = correction_weights(trainer_logprobs.detach() - sampler_logprobs, self.correction,
                                     self.thresholds)
        loss = -(weights * advantages * trainer_logprobs).sum() / max(trainer_logprobs.numel(), 1)
        grad_norm = self.optimise(loss)
        self.version += 1
        return float(loss.detach()), grad_norm

    def optimise(self, loss: torch.Tensor) -> float:
        """One optimiser step on ``loss`` (no version bump: a PPO batch takes several); returns
        the gradient norm before clipping."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        return float(grad_norm)
