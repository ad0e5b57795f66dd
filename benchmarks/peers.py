"""What a peer computes on the same step: verl-style rollout-correction metrics, unsliced.

verl's rollout-correction metrics are token-global masked means over the padded batch
([B, T] log-probs of the trainer and the rollout engine, and the response mask). Written here
from their published definitions (verl docs, "rollout correction"), not from verl's code, as
eager torch on the padded tensors, the way a trainer computes them every step:

    lr = log pi - log mu (masked tokens only; clamped to +-20 before exp, as such code does)
    k1 = mean(-lr)   k3 = mean(exp(lr) - 1 - lr)   w = exp(lr)
    IS weight mean = mean(w), std = sqrt(mean(w^2) - mean(w)^2), chi^2 = mean(w^2) - 1,
    ESS = (sum w)^2 / (n sum w^2), fraction high = mean(w > C), fraction low = mean(w < 1/C)

Eleven scalars for the whole batch: no slice, no quantile, no sequence-level value. Ours, timed
beside it, is ``TokenBatch.from_padded`` plus ``compute_stats``: every slice, quantile,
correction fraction and sequence statistic, from the same padded tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mismatch_monitor.batch import TokenBatch

POOLS, HARDWARE = 6, 4


@dataclass
class Padded:
    trainer: torch.Tensor     # [B, T] float32
    sampler: torch.Tensor     # [B, T]
    mask: torch.Tensor        # [B, T] bool, a prefix of each row
    turn: torch.Tensor        # [B, T] int64
    labels: dict[str, list[str]]
    policy_version: torch.Tensor
    advantages: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())

    def batch(self) -> TokenBatch:
        return TokenBatch.from_padded(self.trainer, self.sampler, self.mask, labels=self.labels,
                                      turn_index=self.turn, policy_version=self.policy_version, trainer_version=4,
                                      advantages=self.advantages)


def make_padded(slots: int, T: int = 4096, seed: int = 0, device: str | torch.device = "cpu") -> Padded:
    """[slots / T, T] padded rows, each a response of uniform length in [T/4, T] (62% of the
    slots are tokens), heavy-tailed lr as in bench_engine.make_data, turns rising along a row,
    6 pools x 4 hardware."""
    g = torch.Generator().manual_seed(seed)
    B = max(1, slots // T)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    pos = torch.arange(T).expand(B, T)
    mask = pos < lengths[:, None]
    sampler = torch.empty(B, T).exponential_(0.5, generator=g).neg_()
    lr = torch.empty(B, T).normal_(0.0, 1e-3, generator=g)
    tail = torch.rand(B, T, generator=g) < 1e-3
    k = int(tail.sum())
    lr[tail] = torch.empty(k).uniform_(1.0, 5.0, generator=g) * (torch.randint(0, 2, (k,), generator=g) * 2 - 1)
    trainer = (sampler + lr).clamp_(max=0.0)
    turn = pos * torch.randint(1, 17, (B,), generator=g)[:, None] // lengths[:, None]
    pool = torch.randint(0, POOLS, (B,), generator=g).tolist()
    hw = torch.randint(0, HARDWARE, (B,), generator=g).tolist()
    labels = {"pool": [f"pool{i}" for i in pool], "hardware": [f"hw{i}" for i in hw]}
    to = lambda t: t.to(device)  # noqa: E731
    return Padded(to(trainer), to(sampler), to(mask), to(turn), labels,
                  to(torch.randint(0, 4, (B,), generator=g)), to(torch.randn(B, generator=g)))


def verl_style_metrics(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, cap: float = 2.0
                       ) -> dict[str, float]:
    """The unsliced rollout-correction scalars of one padded step (see the module docstring)."""
    m = mask.to(trainer.dtype)
    n = m.sum()

    def masked_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * m).sum() / n

    lr = torch.clamp(trainer - sampler, -20.0, 20.0)
    w = torch.exp(lr)
    mean_w, mean_w2 = masked_mean(w), masked_mean(w * w)
    sum_w, sum_w2 = (w * m).sum(), (w * w * m).sum()
    out = {
        "k1": masked_mean(-lr), "k3": masked_mean(w - 1.0 - lr), "chi2": mean_w2 - 1.0,
        "is_mean": mean_w, "is_std": torch.sqrt(torch.clamp(mean_w2 - mean_w * mean_w, min=0.0)),
        "ess": sum_w * sum_w / (n * sum_w2), "frac_high": masked_mean((w > cap).to(m.dtype)),
        "frac_low": masked_mean((w < 1.0 / cap).to(m.dtype)),
        "ppl_trainer": torch.exp(-masked_mean(trainer)), "ppl_rollout": torch.exp(-masked_mean(sampler)),
        "log_ppl_diff": masked_mean(sampler) - masked_mean(trainer),
    }
    # a trainer logs Python floats: one copy to the host
    values = torch.stack(list(out.values())).tolist()
    return dict(zip(out, values))


def check_against_ours(p: Padded, stats) -> float:
    """Largest relative difference between the peer's k1, k3, chi^2 and ESS and ours (the same
    tokens: a sanity check that both time the same work, not a test)."""
    from mismatch_monitor import metrics

    ours = metrics.report(stats).iloc[0]
    peer = verl_style_metrics(p.trainer.double(), p.sampler.double(), p.mask)
    pairs = [(peer["k1"], ours["mismatch/k1_kl"]), (peer["k3"], ours["mismatch/k3_kl"]),
             (peer["chi2"], ours["mismatch/chi2"]), (peer["ess"], ours["mismatch/ess"])]
    return max(abs(a - b) / max(abs(b), 1e-300) for a, b in pairs if math.isfinite(b))
