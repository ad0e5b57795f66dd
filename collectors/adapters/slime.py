"""slime (and its fork Miles): the rollout data the Megatron actor trains on -> TokenBatch.

Targets slime 0.1-0.2 / Miles (2025-2026, ``slime/backends/megatron_utils/loss.py``). slime keeps
one entry per sample, each covering that sample's response tokens only (B samples, R_i response
tokens, T_i = prompt + response tokens of sample i):

============================  ======================  ==========================================
key                           per sample              meaning
============================  ======================  ==========================================
``log_probs``                 [R_i] float             trainer log-probs (the actor's
                                                      ``compute_log_prob``; ``old_log_probs``
                                                      in the loss)
``rollout_log_probs``         [R_i] float             sampler log-probs returned by SGLang
``loss_masks``                [R_i] int               1 on tokens the loss trains on (0 on tool
                                                      output in multi-turn samples)
``response_lengths``          int                     R_i
``tokens``                    [T_i] int               prompt + response token ids
``advantages``                [R_i] float             per-token advantages
``rollout_routed_experts``    [T_i - 1, L, K] int     experts SGLang routed each position to;
                                                      row j is the position that produced
                                                      token j + 1 (routing replay R3)
============================  ======================  ==========================================

slime's own mismatch scalar is ``train_rollout_logprob_abs_diff`` (see ``aliases.py``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from mismatch_monitor.batch import BatchError, TokenBatch

from .common import Labels, get, require, sequence_labels, tensor, turn_index

FRAMEWORK = "slime"


def slime_batch(
    rollout_data: Any,
    *,
    labels: Labels | None = None,
    trainer_routed_experts: Sequence[torch.Tensor] | None = None,
    policy_version: torch.Tensor | None = None,
    trainer_version: int | None = None,
    turns: bool = False,
) -> TokenBatch:
    """A TokenBatch from slime's per-sample rollout data (a dict of per-sample lists).

    ``trainer_routed_experts``: the trainer's expert ids per sample, laid out like
    ``rollout_routed_experts`` ([T_i - 1, L, K]); with both, routing flips are counted.
    """
    trainer = [tensor(x, torch.float64) for x in require(rollout_data, "log_probs", FRAMEWORK)]
    sampler = [tensor(x, torch.float64) for x in require(rollout_data, "rollout_log_probs", FRAMEWORK)]
    B = len(trainer)
    masks = get(rollout_data, "loss_masks")
    masks = [tensor(m).bool() for m in masks] if masks is not None else [torch.ones(len(t), dtype=torch.bool) for t in trainer]
    for i, (t, s, m) in enumerate(zip(trainer, sampler, masks)):
        if not t.shape == s.shape == m.shape:
            raise BatchError(f"shape mismatch in sample {i}: log_probs {tuple(t.shape)} vs "
                             f"rollout_log_probs {tuple(s.shape)} vs loss_masks {tuple(m.shape)}")
    seq_ids = torch.cat([torch.full((int(m.sum()),), i, dtype=torch.int64) for i, m in enumerate(masks)]) \
        if B else torch.zeros(0, dtype=torch.int64)
    fields: dict[str, Any] = {}
    if turns:
        fields["turn_index"] = torch.cat([turn_index(m[None])[0][m] for m in masks])
    tokens = get(rollout_data, "tokens")
    if tokens is not None:
        fields["token_ids"] = torch.cat([tensor(tok)[len(tok) - len(m):][m] for tok, m in zip(tokens, masks)])
    advantages = get(rollout_data, "advantages")
    if advantages is not None:
        fields["advantages"] = torch.stack([tensor(a, torch.float64)[m].mean() if m.any() else torch.tensor(0.0, dtype=torch.float64)
                                            for a, m in zip(advantages, masks)])
    if trainer_routed_experts is not None:
        routed = require(rollout_data, "rollout_routed_experts", FRAMEWORK)
        fields["trainer_experts"] = _response_rows(trainer_routed_experts, masks)
        fields["sampler_experts"] = _response_rows(routed, masks)
    return TokenBatch.from_flat(
        torch.cat([t[m] for t, m in zip(trainer, masks)]) if B else torch.zeros(0, dtype=torch.float64),
        torch.cat([s[m] for s, m in zip(sampler, masks)]) if B else torch.zeros(0, dtype=torch.float64),
        seq_ids=seq_ids, num_sequences=B, labels=sequence_labels(labels, B),
        policy_version=policy_version, trainer_version=trainer_version, **fields)


def _response_rows(per_sample: Sequence[Any], masks: list[torch.Tensor]) -> torch.Tensor:
    """[N, L, K] rows of the trained response tokens from per-sample [T_i - 1, L, K] routing.

    Response token r of sample i sits at T_i - R_i + r; row T_i - R_i + r - 1 produced it, and
    with T_i - 1 rows that is row ``len(rows) - R_i + r``.
    """
    out = []
    for i, (rows, m) in enumerate(zip(per_sample, masks)):
        rows = tensor(rows)
        start = rows.shape[0] - m.shape[0]
        if start < 0:
            raise BatchError(f"expected at least R_i = {m.shape[0]} routing rows in sample {i}, got {rows.shape[0]}")
        out.append(rows[start:start + m.shape[0]][m])
    return torch.cat(out)
