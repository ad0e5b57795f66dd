"""NeMo-RL: the ``BatchedDataDict`` the GRPO loss receives -> TokenBatch.

Targets NeMo-RL 0.3-0.5 (2025-2026, ``ClippedPGLossFn`` in ``nemo_rl/algorithms/loss_functions.py``).
Keys, as NeMo-RL names and lays them out (B samples, S positions of the whole message log):

==========================  ===========  ======================================================
key                         shape        meaning
==========================  ===========  ======================================================
``prev_logprobs``           [B, S]       trainer log-probs (the policy's ``get_logprobs``)
``generation_logprobs``     [B, S]       sampler log-probs returned by the generation backend
``token_mask``              [B, S]       1 on assistant tokens the loss trains on, 0 on prompt,
                                         user/environment turns and padding
``sample_mask``             [B]          0 for samples dropped from the loss
``input_ids``               [B, S]       token ids
``advantages``              [B, S]       per-token advantages
==========================  ===========  ======================================================

Log-probs at position ``i`` are those of ``input_ids[:, i]``; position 0 has none, and the loss
reads ``[:, 1:]``, so the adapter excludes position 0 as well. NeMo-RL's own mismatch scalars are
``gen_kl_error`` and ``token_mult_prob_error`` (see ``aliases.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from mismatch_monitor.batch import TokenBatch

from .common import Labels, get, padded_batch, require, sequence_labels, tensor

FRAMEWORK = "NeMo-RL"


def nemo_rl_batch(
    data: Any,
    *,
    labels: Labels | None = None,
    policy_version: torch.Tensor | None = None,
    trainer_version: int | None = None,
    turns: bool = False,
) -> TokenBatch:
    """A TokenBatch from NeMo-RL's train data (a ``BatchedDataDict`` or plain mapping)."""
    trainer = tensor(require(data, "prev_logprobs", FRAMEWORK))
    sampler = tensor(require(data, "generation_logprobs", FRAMEWORK))
    token_mask = tensor(require(data, "token_mask", FRAMEWORK)).bool()
    sample_mask = get(data, "sample_mask")
    mask = token_mask.clone()
    mask[:, 0] = False                                   # no log-prob for the first position
    if sample_mask is not None:
        mask &= tensor(sample_mask).bool()[:, None]
    B = mask.shape[0]
    advantages = get(data, "advantages")
    input_ids = get(data, "input_ids")
    return padded_batch(
        trainer, sampler, mask,
        labels=sequence_labels(labels, B), turns=turns, advantages=advantages,
        policy_version=policy_version, trainer_version=trainer_version,
        token_ids=None if input_ids is None else tensor(input_ids),
    )
