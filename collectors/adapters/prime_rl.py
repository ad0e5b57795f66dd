"""prime-rl: a packed training micro-batch plus the trainer's log-probs -> TokenBatch.

Targets prime-rl 0.2-0.4 (2025-2026, ``src/prime_rl/trainer/rl``). prime-rl packs several samples
into one row (batch size 1, S positions); the trainer computes its log-probs in the forward, so
they are passed next to the micro-batch. Keys, as prime-rl names and lays them out:

==========================  ================  ==================================================
key                         shape             meaning
==========================  ================  ==================================================
``inference_logprobs``      [1, S] float      sampler log-probs returned by vLLM
``loss_mask``               [1, S] bool       trained tokens (older releases); newer releases
                                              carry it per loss in ``advantages[i]["mask"]``
``position_ids``            [1, S] int        restarts at 0 at every packed sample
``sequence_lengths``        list[int]         packed sample lengths (newer releases)
``input_ids``               [1, S] int        token ids
``advantages``              [1, S] float, or  per-token advantages (older), or a list of
                            list of dicts     ``{"loss", "values", "mask"}`` channels (newer)
``env_names``               list[str] (S)     environment of each position (newer releases)
``routed_experts``          [1, S, L, K] int  experts vLLM routed each position to
==========================  ================  ==================================================

``trainer_logprobs`` [1, S] (or [S]) holds log pi of ``input_ids`` at every position, aligned like
``inference_logprobs``. prime-rl's own mismatch scalar is ``mismatch_kl`` (see ``aliases.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from mismatch_monitor.batch import BatchError, TokenBatch

from .common import Labels, get, require, sequence_labels, tensor, turn_index

FRAMEWORK = "prime-rl"


def prime_rl_batch(
    micro_batch: Any,
    trainer_logprobs: torch.Tensor,
    *,
    labels: Labels | None = None,
    trainer_routed_experts: torch.Tensor | None = None,
    policy_version: torch.Tensor | None = None,
    trainer_version: int | None = None,
    turns: bool = False,
) -> TokenBatch:
    """A TokenBatch from one packed prime-rl micro-batch and the trainer's log-probs for it.

    ``trainer_routed_experts`` [1, S, L, K] is the trainer's routing laid out like
    ``routed_experts``; with both, routing flips are counted.
    """
    sampler = tensor(require(micro_batch, "inference_logprobs", FRAMEWORK)).reshape(-1)
    trainer = tensor(trainer_logprobs).reshape(-1)
    S = sampler.shape[0]
    if trainer.shape[0] != S:
        raise BatchError(f"shape mismatch: inference_logprobs [{S}] vs trainer_logprobs [{trainer.shape[0]}]")
    mask, advantages = _mask_and_advantages(micro_batch, S)
    seq = _sequence_ids(micro_batch, S)                                       # [S]
    B = int(seq.max()) + 1 if S else 0
    starts = torch.searchsorted(seq, torch.arange(B))                        # first position of each
    env_names = get(micro_batch, "env_names")
    fields: dict[str, Any] = {}
    if advantages is not None:
        w = mask.to(torch.float64)
        fields["advantages"] = (torch.zeros(B, dtype=torch.float64).index_add_(0, seq, advantages.to(torch.float64) * w)
                                / torch.zeros(B, dtype=torch.float64).index_add_(0, seq, w).clamp(min=1.0))
    if turns:
        per_seq = torch.zeros(B, S, dtype=torch.bool)
        per_seq[seq, torch.arange(S)] = mask                                  # each sample on its own row
        fields["turn_index"] = turn_index(per_seq)[seq, torch.arange(S)][mask]
    input_ids = get(micro_batch, "input_ids")
    if input_ids is not None:
        fields["token_ids"] = tensor(input_ids).reshape(-1)[mask]
    if trainer_routed_experts is not None:
        routed = tensor(require(micro_batch, "routed_experts", FRAMEWORK))
        produced_by = (torch.arange(S) - 1).clamp(min=0)[mask]               # the position before
        fields["trainer_experts"] = tensor(trainer_routed_experts).reshape(S, *routed.shape[-2:])[produced_by]
        fields["sampler_experts"] = routed.reshape(S, *routed.shape[-2:])[produced_by]
    return TokenBatch.from_flat(
        trainer[mask], sampler[mask], seq_ids=seq[mask], num_sequences=B,
        labels=sequence_labels(labels, B, env=None if env_names is None else [env_names[int(i)] for i in starts]),
        policy_version=policy_version, trainer_version=trainer_version, **fields)


def _mask_and_advantages(micro_batch: Any, S: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    advantages = get(micro_batch, "advantages")
    loss_mask = get(micro_batch, "loss_mask")
    if isinstance(advantages, (list, tuple)):                                # newer: loss channels
        channel = advantages[0]
        mask = tensor(channel["mask"]).reshape(-1).bool() if loss_mask is None else tensor(loss_mask).reshape(-1).bool()
        return mask, tensor(channel["values"]).reshape(-1)
    if loss_mask is None:
        raise BatchError("expected prime-rl batch key 'loss_mask' or advantage channels with a 'mask', got neither")
    mask = tensor(loss_mask).reshape(-1).bool()
    return mask, None if advantages is None else tensor(advantages).reshape(-1)


def _sequence_ids(micro_batch: Any, S: int) -> torch.Tensor:
    lengths = get(micro_batch, "sequence_lengths")
    if lengths is not None:
        lengths = torch.as_tensor(list(lengths), dtype=torch.int64)
        if int(lengths.sum()) != S:
            raise BatchError(f"expected sequence_lengths to sum to S={S}, got {int(lengths.sum())}")
        return torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    positions = tensor(require(micro_batch, "position_ids", FRAMEWORK)).reshape(-1)
    return ((positions == 0).long().cumsum(0) - 1).clamp(min=0) if S else positions.long()
