"""Rollouts of every pool -> the padded tensors the trainer scores -> one :class:`TokenBatch`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..batch import TokenBatch
from .pools import PoolSpec
from .sampler import Rollout
from .trainer import kept_set


@dataclass(frozen=True)
class Padded:
    """A step's dialogues right-padded to ``[B, T]`` (token p of row b at ``[b, p]``).

    ``pool_rows`` maps a pool name to its row indices; ``kept`` is ``[B, T, V]`` bool (True where
    no kept set was shipped) and ``shipped`` ``[B]`` marks rows whose pool shipped one.
    """

    ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    sampler_logprobs: torch.Tensor
    turn_index: torch.Tensor
    kept_logmass: torch.Tensor
    sampler_experts: torch.Tensor | None
    kept: torch.Tensor
    shipped: torch.Tensor
    policy_version: torch.Tensor
    pool_rows: dict[str, list[int]]


def pad_rollouts(rollouts: list[Rollout], pools: list[PoolSpec], vocab_size: int, pad_id: int) -> Padded:
    """``rollouts[i]`` was sampled by ``pools[i]``."""
    B, T = len(rollouts), max(len(r.ids) for r in rollouts)
    ids = torch.full((B, T), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((B, T), dtype=torch.int64)
    response_mask = torch.zeros((B, T), dtype=torch.bool)
    sampler_logprobs = torch.zeros((B, T), dtype=torch.float32)
    turn_index = torch.zeros((B, T), dtype=torch.int64)
    kept_logmass = torch.zeros((B, T), dtype=torch.float32)
    kept = torch.ones((B, T, vocab_size), dtype=torch.bool)
    first = rollouts[0].experts
    experts = None if first is None else torch.zeros((B, T) + tuple(first.shape[1:]), dtype=torch.uint8)
    pool_rows: dict[str, list[int]] = {}
    for b, (r, pool) in enumerate(zip(rollouts, pools)):
        pool_rows.setdefault(pool.name, []).append(b)
        ids[b, : len(r.ids)] = torch.tensor(r.ids)
        attention_mask[b, : len(r.ids)] = 1
        p = r.positions
        response_mask[b, p] = True
        sampler_logprobs[b, p] = r.sampler_logprobs
        turn_index[b, p] = r.turns
        kept_logmass[b, p] = r.kept_logmass
        if r.kept is not None:
            kept[b, p] = r.kept
        if experts is not None:
            experts[b, p] = r.experts
    shipped = torch.tensor([pool.ship_kept_set for pool in pools], dtype=torch.bool)
    versions = torch.tensor([r.policy_version for r in rollouts], dtype=torch.int64)
    return Padded(ids, attention_mask, response_mask, sampler_logprobs, turn_index, kept_logmass,
                  experts, kept, shipped, versions, pool_rows)


def trainer_token_logprobs(logp: torch.Tensor, padded: Padded, pools: dict[str, PoolSpec]
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi of every token ``[B, T]`` (with gradient) and ``in_trainer_support`` ``[B, T]``.

    Rows whose pool shipped its kept set are re-normalised over that set (top-p replay), and
    their support is checked against the trainer's own top-k/top-p set; rows of a vLLM
    truncating pool are re-normalised over the trainer's own set (a sampled token outside it
    has log pi = -inf and is out of support); every other row is scored on the full
    distribution, whose support is the whole vocabulary.
    """
    token = logp.gather(-1, padded.ids.unsqueeze(-1)).squeeze(-1)                  # [B, T]
    support = torch.ones_like(padded.response_mask)
    for name, rows in padded.pool_rows.items():
        spec = pools[name]
        if spec.renormalises_over_trainer_set:    # vLLM's processed log-probs, kept set not shipped
            own = kept_set(logp[rows].detach(), spec.top_k, spec.top_p)            # [b, T, V]
            lse = logp[rows].masked_fill(~own, -torch.inf).logsumexp(-1)           # [b, T]
            token = token.index_put((torch.tensor(rows),), token[rows] - lse)
            support[rows] = own.gather(-1, padded.ids[rows].unsqueeze(-1)).squeeze(-1)
    if bool(padded.shipped.any()):
        lse = logp.masked_fill(~padded.kept, -torch.inf).logsumexp(-1)             # [B, T]
        token = torch.where(padded.shipped.unsqueeze(1), token - lse, token)
        for name, rows in padded.pool_rows.items():
            spec = pools[name]
            if spec.ship_kept_set:
                own = kept_set(logp[rows].detach(), spec.top_k, spec.top_p)       # [b, T, V]
                support[rows] = own.gather(-1, padded.ids[rows].unsqueeze(-1)).squeeze(-1)
    return token, support


def token_batch(padded: Padded, trainer_logprobs: torch.Tensor, support: torch.Tensor,
                trainer_experts: torch.Tensor | None, labels: dict[str, list[str]],
                advantages: torch.Tensor | None, trainer_version: int, multi_turn: bool) -> TokenBatch:
    """The step's batch as the monitor receives it (every tensor detached)."""
    return TokenBatch.from_padded(
        trainer_logprobs.detach(), padded.sampler_logprobs, padded.response_mask,
        labels=labels,
        turn_index=padded.turn_index if multi_turn else None,
        policy_version=padded.policy_version,
        trainer_version=trainer_version,
        advantages=None if advantages is None else advantages.to(torch.float32),
        trainer_experts=trainer_experts,
        sampler_experts=padded.sampler_experts,
        in_trainer_support=support,
        sampler_kept_logmass=padded.kept_logmass,
        token_ids=padded.ids,
    )
