"""verl: a ``DataProto`` after the actor's ``compute_log_prob`` -> TokenBatch.

Targets verl 0.5-0.7 (2025-2026: ``rollout_corr`` helper, agent loop, router replay R3). The keys,
as verl names and lays them out (B sequences, P prompt and R response positions):

===========================  ==============  =====================================================
``batch`` key                shape           meaning
===========================  ==============  =====================================================
``old_log_probs``            [B, R] float    trainer log-probs (actor ``compute_log_prob``) = pi
``rollout_log_probs``        [B, R] float    sampler log-probs (``rollout.calculate_log_probs``)
                                             = mu; padding holds 0.0
``response_mask``            [B, R] int      1 on generated tokens; 0 on tool/observation
                                             tokens of multi-turn rollouts and on padding
``responses``                [B, R] int      response token ids (right-padded)
``prompts``                  [B, P] int      prompt token ids (left-padded)
``advantages``               [B, R] float    per-token advantages
``routed_experts``           [B, P+R, L, K]  expert ids the rollout engine routed each position
                                             to (router replay R3), aligned with ``input_ids``
===========================  ==============  =====================================================

``non_tensor_batch["data_source"]`` (one string per sequence) becomes the ``env`` label.

The trainer's ``metrics`` dict of a step (what ``RayPPOTrainer.fit`` logs under ``global_steps``)
gives the run's training outcomes through :func:`verl_outcomes`:

    collector.log_step(step, verl_batch(batch))
    collector.log_outcomes(step, verl_outcomes(metrics))

``critic/score/mean`` (the sequence score before any KL penalty) is ``reward``; ``actor/pg_loss``,
``actor/grad_norm`` and ``actor/entropy`` are ``loss``, ``grad_norm`` and ``entropy`` (verl's
means over the step's micro-batches, as it logs them); each validation reward
``val-core/<data_source>/reward/mean@<n>`` is ``eval_reward/<data_source>@<n>``.

In bypass mode verl sets ``old_log_probs`` to the very tensor ``rollout_log_probs``; there is no
trainer re-score to compare then, and the adapter says so instead of reporting zero mismatch:
pass the log-probs of the actor's update forward as ``trainer_logprobs``.
"""

from __future__ import annotations

import numbers
from typing import Any, Mapping

import torch

from mismatch_monitor.batch import BatchError, TokenBatch

from .common import (
    Labels,
    get,
    padded_batch,
    producing_rows,
    require,
    sequence_labels,
    tensor,
)

FRAMEWORK = "verl"
# verl's metric key -> outcome name (see the module docstring)
OUTCOME_KEYS: dict[str, str] = {"critic/score/mean": "reward", "actor/pg_loss": "loss",
                                "actor/grad_norm": "grad_norm", "actor/entropy": "entropy"}
_VALIDATION = ("val-core/", "/reward/mean@")


def verl_outcomes(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The training outcomes in one step's verl ``metrics`` dict, by outcome name (numbers only;
    a non-finite one is kept, for ``log_outcomes`` to count as an error)."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            continue
        if key in OUTCOME_KEYS:
            out[OUTCOME_KEYS[key]] = float(value)
        elif key.startswith(_VALIDATION[0]) and _VALIDATION[1] in key:
            source, n = key[len(_VALIDATION[0]):].rsplit(_VALIDATION[1], 1)
            out[f"eval_reward/{source}@{n}"] = float(value)
    return out


def verl_batch(
    data: Any,
    *,
    labels: Labels | None = None,
    trainer_logprobs: torch.Tensor | None = None,
    trainer_routed_experts: torch.Tensor | None = None,
    policy_version: torch.Tensor | None = None,
    trainer_version: int | None = None,
    turns: bool = False,
) -> TokenBatch:
    """A TokenBatch from a verl ``DataProto`` (or the mapping of its ``batch``).

    Args:
        data: the DataProto (``.batch``, ``.non_tensor_batch``) or a mapping of its tensors.
        labels: extra labels, a string for every sequence or one string per sequence.
        trainer_logprobs: [B, R] trainer log-probs to use instead of ``old_log_probs``.
        trainer_routed_experts: [B, P+R, L, K] the trainer's expert ids, laid out like
            ``routed_experts`` (verl ships the rollout's only); both enable routing-flip counts.
        policy_version, trainer_version: [B] sampler weight versions and the trainer's version.
        turns: slice by turn (runs of generated tokens in ``response_mask``).
    """
    tensors = get(data, "batch") if get(data, "batch") is not None else data
    non_tensor = get(data, "non_tensor_batch") or {}
    sampler = tensor(require(tensors, "rollout_log_probs", FRAMEWORK,
                             " (set actor_rollout_ref.rollout.calculate_log_probs=True)"))
    if trainer_logprobs is None:
        trainer_logprobs = tensor(require(tensors, "old_log_probs", FRAMEWORK))
        if trainer_logprobs is sampler or trainer_logprobs.data_ptr() == sampler.data_ptr():
            raise BatchError(
                "expected old_log_probs to be the actor's re-score, got the rollout_log_probs tensor "
                "itself (verl bypass mode); pass the update forward's log-probs as trainer_logprobs")
    mask = tensor(require(tensors, "response_mask", FRAMEWORK)).bool()
    B, R = mask.shape
    advantages = get(tensors, "advantages")
    experts = None
    if trainer_routed_experts is not None:
        sampler_routed = tensor(require(tensors, "routed_experts", FRAMEWORK))
        first = sampler_routed.shape[1] - R                       # P: response token 0 sits here
        experts = (producing_rows(tensor(trainer_routed_experts), first, R),
                   producing_rows(sampler_routed, first, R))
    return padded_batch(
        tensor(trainer_logprobs), sampler, mask,
        labels=sequence_labels(labels, B, env=non_tensor.get("data_source")),
        turns=turns, advantages=advantages,
        policy_version=policy_version, trainer_version=trainer_version,
        trainer_experts=None if experts is None else experts[0],
        sampler_experts=None if experts is None else experts[1],
        token_ids=None if get(tensors, "responses") is None else tensor(get(tensors, "responses")),
    )
