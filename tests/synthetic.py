"""Small synthetic batches for store/collector tests: real tensors, a controlled mismatch."""

from __future__ import annotations

import torch

from mismatch_monitor.batch import TokenBatch

POOLS = ("bf16", "fp8", "stale")


def make_batch(step: int, *, seed: int = 0, sequences: int = 24, max_len: int = 40,
               scale: float = 1e-2, tail: bool = True, pools: tuple[str, ...] = POOLS) -> TokenBatch:
    """A padded batch whose sampler log-probs differ from the trainer's by a per-pool amount."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    B, T = sequences, max_len
    trainer = -torch.rand(B, T, generator=g, dtype=torch.float64) * 4.0 - 1e-3
    pool_of = [pools[i % len(pools)] for i in range(B)]
    width = torch.tensor([scale * (1 + 2 * (i % len(pools))) for i in range(B)], dtype=torch.float64)
    noise = torch.randn(B, T, generator=g, dtype=torch.float64) * width[:, None]
    if tail:
        spikes = torch.rand(B, T, generator=g) < 0.01
        noise = torch.where(spikes, noise.sign() * (1.0 + 2 * torch.rand(B, T, generator=g, dtype=torch.float64)), noise)
    sampler = (trainer - noise).clamp(max=0.0)
    lengths = torch.randint(max_len // 4, max_len + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    turns = (torch.arange(T)[None, :] // 10).expand(B, T)
    return TokenBatch.from_padded(
        trainer.to(torch.float32), sampler.to(torch.float32), mask,
        labels={"pool": pool_of},
        turn_index=turns,
        policy_version=[max(0, step - (i % 3)) for i in range(B)],
        trainer_version=step,
        advantages=torch.randn(B, generator=g),
        token_ids=torch.randint(0, 100, (B, T), generator=g),
    )
