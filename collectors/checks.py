"""What ``log_step`` checks before it computes anything, and how it tells mistakes from bad data.

Two kinds of trouble reach the collector and they are treated differently:

* **a mistake in the call** (a misspelt field, a list where a tensor belongs, a step that is not
  an integer, both a batch and fields): a programming error, raised at once as ``TypeError``
  even when not strict. Swallowing it would store every step empty without a word.
* **bad data** (shapes that do not line up, a step out of the int64 range, log-probs that look
  like probabilities): counted, logged with its message and recorded in the run (``errors``
  table); raised only in strict mode.

Also here: the labels a batch takes from the declared pool metadata (:func:`with_pool_labels`).
"""

from __future__ import annotations

import dataclasses
import difflib
import operator
from typing import Any, Mapping

import torch

from mismatch_monitor.batch import BatchError, TokenBatch
from mismatch_monitor.engine import MismatchStats

# every field log_step and StepHook.add take beside a TokenBatch (TokenBatch.from_padded/from_flat)
PADDED_ONLY = ("response_mask",)
FLAT_ONLY = ("seq_offsets", "seq_ids", "num_sequences")
COMMON = ("labels", "turn_index", "policy_version", "trainer_version", "advantages", "trainer_experts",
          "sampler_experts", "in_trainer_support", "sampler_kept_logmass", "token_ids")
FIELDS = ("trainer_logprobs", "sampler_logprobs") + PADDED_ONLY + FLAT_ONLY + COMMON
# fields that must be tensors when given (the others also take lists of per-sequence values)
TENSOR_FIELDS = ("trainer_logprobs", "sampler_logprobs", "response_mask", "seq_ids", "turn_index",
                 "trainer_experts", "sampler_experts", "in_trainer_support", "sampler_kept_logmass",
                 "token_ids")

# a stored step is an int64 >= 0 (the Parquet column and every reader's type)
MAX_STEP = 2**63 - 1

# log-probs are <= 0; when nearly all of one side's values lie in (0, 1] it holds probabilities
PROBABILITY_SHARE = 0.9


class StepError(BatchError):
    """A step number the run cannot store (outside int64 >= 0)."""


class ProbabilitiesNotLogProbs(BatchError):
    """Probabilities were passed where log-probabilities belong."""


def check_fields(fields: Mapping[str, Any]) -> None:
    """Raise ``TypeError`` for an unknown field name (with the closest known one)."""
    for name in fields:
        if name not in FIELDS:
            close = difflib.get_close_matches(name, FIELDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"log_step got an unexpected field {name!r}{hint} (known fields: "
                            f"{', '.join(FIELDS)})")


def check_call(step: Any, batch: Any, fields: Mapping[str, Any]) -> None:
    """Raise ``TypeError`` for a call that cannot be meant (see the module docstring)."""
    if isinstance(step, bool):
        raise TypeError(f"expected step to be an int, got bool {step!r}")
    try:
        operator.index(step)
    except TypeError:
        raise TypeError(f"expected step to be an int, got {type(step).__name__} {step!r}") from None
    check_fields(fields)
    fields = {k: v for k, v in fields.items() if v is not None}
    if batch is not None:
        if not isinstance(batch, TokenBatch):
            raise TypeError(f"expected batch to be a TokenBatch, got {type(batch).__name__}")
        if fields:
            raise TypeError(f"pass either a TokenBatch or tensor fields, not both (got {sorted(fields)})")
        return
    missing = [n for n in ("trainer_logprobs", "sampler_logprobs") if fields.get(n) is None]
    if missing:
        raise TypeError(f"log_step needs a TokenBatch or trainer_logprobs and sampler_logprobs; "
                        f"missing {', '.join(missing)}")
    for name in TENSOR_FIELDS:
        value = fields.get(name)
        if value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"expected {name} to be a torch.Tensor, got {type(value).__name__}")
    labels = fields.get("labels")
    if labels is not None and not isinstance(labels, Mapping):
        raise TypeError(f"expected labels to be a mapping of dimension -> values per sequence, "
                        f"got {type(labels).__name__}")
    padded = fields.get("response_mask") is not None
    flat = [n for n in FLAT_ONLY if fields.get(n) is not None]
    if padded and flat:
        raise TypeError(f"response_mask (padded [B, T] layout) cannot be combined with {', '.join(flat)} "
                        f"(flat [N] layout)")


def checked_step(step: Any) -> int:
    """``step`` as an int64 >= 0; ``StepError`` (a data error: counted) otherwise."""
    value = operator.index(step)
    if not 0 <= value <= MAX_STEP:
        raise StepError(f"expected step to be an int64 >= 0 (0..2**63-1), got {value}; this step is "
                        f"not recorded")
    return value


def as_token_batch(batch: TokenBatch | None, fields: Mapping[str, Any]) -> TokenBatch:
    """A TokenBatch from either a batch or tensor fields (padded with ``response_mask``, else flat)."""
    if batch is not None:
        check_call(0, batch, fields)
        return batch
    check_call(0, None, fields)
    given = {k: v for k, v in fields.items() if v is not None}
    if "response_mask" in given:
        return TokenBatch.from_padded(**given)
    if not any(n in given for n in ("seq_offsets", "seq_ids")):
        raise BatchError("expected response_mask [B, T] (padded layout) or seq_offsets [B + 1] / "
                         "seq_ids [N] (flat layout), got none of them")
    return TokenBatch.from_flat(**given)


def probability_sides(batch: TokenBatch) -> dict[str, float]:
    """The sides (``trainer_logprobs``/``sampler_logprobs``) whose finite values lie in (0, 1]
    for at least :data:`PROBABILITY_SHARE` of the tokens, with that share."""
    out: dict[str, float] = {}
    for name in ("trainer_logprobs", "sampler_logprobs"):
        values = getattr(batch, name)
        finite = torch.isfinite(values)
        n = int(finite.sum())
        if n == 0:
            continue
        share = int(((values > 0) & (values <= 1) & finite).sum()) / n
        if share >= PROBABILITY_SHARE:
            out[name] = share
    return out


def probabilities_error(sides: Mapping[str, float], num_tokens: int) -> ProbabilitiesNotLogProbs:
    listing = " and ".join(f"{name} ({share:.0%} of {num_tokens} tokens in (0, 1])"
                           for name, share in sides.items())
    return ProbabilitiesNotLogProbs(
        f"{listing} look like probabilities, not log-probabilities: log-probs are <= 0; pass "
        f"torch.log(p) (or the log_softmax values). These tokens are set aside as positive log-probs, "
        f"so the step's metrics describe none of them")


def data_warnings(batch: TokenBatch, stats: MismatchStats) -> list[Exception]:
    """Problems of a batch whose step is still recorded: probabilities given as log-probs
    (looked for only when the engine set positive log-probs aside, so it costs nothing else)."""
    if not len(stats.tables["tokens"]) or not int(stats.column("tokens", "n_positive_logprob").sum()):
        return []
    sides = probability_sides(batch)
    return [probabilities_error(sides, batch.num_tokens)] if sides else []


def with_pool_labels(batch: TokenBatch, pools: Mapping[str, Mapping[str, Any]]) -> TokenBatch:
    """Fill hardware/precision/engine/env labels a batch lacks from the declared pool metadata."""
    names = batch.labels.get("pool")
    if names is None or not pools:
        return batch
    labels = dict(batch.labels)
    for dim in ("hardware", "precision", "engine", "env"):
        if dim in labels or not any(dim in meta for meta in pools.values()):
            continue
        values = (pools.get(p, {}).get(dim) if p is not None else None for p in names)
        labels[dim] = tuple(None if v is None else str(v) for v in values)
    return dataclasses.replace(batch, labels=labels) if len(labels) != len(batch.labels) else batch
