"""OpenRLHF: an ``Experience`` after ``make_experience`` -> TokenBatch.

Targets OpenRLHF 0.8-0.9 (2025-2026, ``openrlhf/trainer/ppo_utils/experience.py``), where the
vLLM importance-sampling correction (``--enable_vllm_is_correction``) keeps the engine's
log-probs. Fields, as OpenRLHF names and lays them out (B samples, T = prompt + response
positions, A = action positions, the last A of ``sequences``):

==========================  ===========  ======================================================
``Experience`` field        shape        meaning
==========================  ===========  ======================================================
``action_log_probs``        [B, A]       trainer log-probs of the actions (the actor's forward
                                         in ``make_experience``; ``old_log_probs`` in the loss)
``rollout_log_probs``       [B, A]       sampler log-probs returned by vLLM
``action_mask``             [B, A] bool  actions that are trained on (False on padding)
``sequences``               [B, T]       prompt + response token ids; actions are ``[:, -A:]``
``advantages``              [B, A]       per-action advantages
==========================  ===========  ======================================================

OpenRLHF's own mismatch scalar is ``vllm_kl`` (see ``aliases.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from mismatch_monitor.batch import TokenBatch

from .common import Labels, get, padded_batch, require, sequence_labels, tensor

FRAMEWORK = "OpenRLHF"


def openrlhf_batch(
    experience: Any,
    *,
    labels: Labels | None = None,
    trainer_logprobs: torch.Tensor | None = None,
    policy_version: torch.Tensor | None = None,
    trainer_version: int | None = None,
    turns: bool = False,
) -> TokenBatch:
    """A TokenBatch from an OpenRLHF ``Experience`` (or a mapping with its field names).

    ``trainer_logprobs`` [B, A] replaces ``action_log_probs`` (e.g. the current policy's
    log-probs from the update forward). ``turns`` slices by runs of trained actions.
    """
    sampler = tensor(require(experience, "rollout_log_probs", FRAMEWORK,
                             " (enable the vLLM importance-sampling correction)"))
    trainer = tensor(trainer_logprobs if trainer_logprobs is not None
                     else require(experience, "action_log_probs", FRAMEWORK))
    mask = tensor(require(experience, "action_mask", FRAMEWORK)).bool()
    B, A = mask.shape
    sequences = get(experience, "sequences")
    advantages = get(experience, "advantages")
    return padded_batch(
        trainer, sampler, mask,
        labels=sequence_labels(labels, B), turns=turns, advantages=advantages,
        policy_version=policy_version, trainer_version=trainer_version,
        token_ids=None if sequences is None else tensor(sequences)[:, -A:],
    )
