"""A plain step hook for any training loop: micro-batches in, one logged step out.

    hook = StepHook(collector)
    for step in range(num_steps):
        for micro in micro_batches:                      # gradient accumulation
            ...                                          # forward, loss, backward
            hook.add(trainer_logprobs=pi, sampler_logprobs=mu, response_mask=mask,
                     labels={"pool": pools})
        optimizer.step()
        wandb.log(hook.end_step(step), step=step)

The run store keeps one record per step (a step logged twice is replaced by the later write),
so an optimizer step's micro-batches are concatenated into one batch and logged once.
:func:`concat_batches` is exact: every statistic of the concatenation equals the merge of the
micro-batches' statistics, because sequences are never split across micro-batches.

Bad input follows the collector's policy: a micro-batch that cannot be read is passed on to the
collector, which records the failed step with the real error (and raises only in strict mode).
A mistake in the call (an unknown field, a list where a tensor belongs) raises at ``add``.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, Sequence

import torch

from mismatch_monitor.batch import BatchError, TokenBatch
from .checks import as_token_batch, check_fields

log = logging.getLogger("mismatch_monitor")

# per-token optional fields of TokenBatch (shape [N, ...]); each is all-or-none across a step
_PER_TOKEN = ("turn_index", "trainer_experts", "sampler_experts", "in_trainer_support",
              "sampler_kept_logmass", "token_ids")


class StepSink(Protocol):
    """What the hook logs into: :class:`~mismatch_monitor.collectors.MismatchCollector`."""

    strict: bool

    def log_step(self, step: int, batch: TokenBatch | None = None, **fields: Any) -> dict[str, float]: ...


def concat_batches(batches: Sequence[TokenBatch]) -> TokenBatch:
    """One batch holding every sequence of ``batches``, in order (sequence ids renumbered).

    Every batch must carry the same label dimensions and the same optional fields. Staleness
    (``trainer_version - policy_version``) is kept per sequence: when micro-batches were scored
    at different trainer versions, policy versions are re-expressed against the largest one.
    """
    batches = list(batches)
    if not batches:
        raise BatchError("expected at least one batch to concatenate, got none")
    if len(batches) == 1:
        return batches[0]
    first = batches[0]
    devices = {str(b.device) for b in batches}
    if len(devices) > 1:
        raise BatchError(f"expected all micro-batches on one device, got {sorted(devices)}")
    dims = set(first.labels)
    for i, b in enumerate(batches[1:], 1):
        if set(b.labels) != dims:
            raise BatchError(
                f"expected the same label dimensions in every micro-batch, got {sorted(dims)} in "
                f"micro-batch 0 and {sorted(b.labels)} in micro-batch {i}")

    def present(name: str) -> bool:
        have = [getattr(b, name) is not None for b in batches]
        if any(have) and not all(have):
            missing = [i for i, h in enumerate(have) if not h]
            raise BatchError(f"expected {name} in every micro-batch or in none, missing in {missing}")
        return all(have)

    offsets = torch.tensor([0] + [b.num_sequences for b in batches]).cumsum(0).tolist()
    cat = {name: torch.cat([getattr(b, name) for b in batches]) if present(name) else None
           for name in _PER_TOKEN}
    trainer_version = policy_version = None
    if present("policy_version"):
        trainer_version = max(int(b.trainer_version) for b in batches)
        # pv' = pv + (T - tv_i) keeps tv_i - pv = T - pv' for every sequence
        policy_version = torch.cat([b.policy_version + (trainer_version - int(b.trainer_version))
                                    for b in batches])
    advantages = torch.cat([b.advantages for b in batches]) if present("advantages") else None
    seq_offsets = None
    if all(b.seq_offsets is not None for b in batches):     # contiguous sequences stay contiguous
        starts = torch.tensor([0] + [b.num_tokens for b in batches]).cumsum(0).tolist()
        seq_offsets = torch.cat([first.seq_offsets.new_zeros(1)]
                                + [b.seq_offsets[1:] + start for b, start in zip(batches, starts)])
    return TokenBatch(
        trainer_logprobs=torch.cat([b.trainer_logprobs for b in batches]),
        sampler_logprobs=torch.cat([b.sampler_logprobs for b in batches]),
        seq_ids=torch.cat([b.seq_index + off for b, off in zip(batches, offsets)]),
        position_index=torch.cat([b.position for b in batches]),
        num_sequences=int(offsets[-1]),
        labels={d: tuple(v for b in batches for v in b.labels[d]) for d in first.labels},
        policy_version=policy_version,
        trainer_version=trainer_version,
        advantages=advantages,
        seq_offsets=seq_offsets,
        **cat,
    )


class StepHook:
    """Collects the micro-batches of one optimizer step and logs them as one step.

    Args:
        collector: where steps go (a ``MismatchCollector`` or anything with ``log_step``).
        strict: raise on bad input instead of recording it; defaults to ``collector.strict``.
    """

    def __init__(self, collector: StepSink, *, strict: bool | None = None) -> None:
        self.collector = collector
        self.strict = bool(getattr(collector, "strict", False)) if strict is None else strict
        self.error_count = 0
        self.last_batch: TokenBatch | None = None
        self._pending: list[TokenBatch] = []
        self._rejected: dict[str, Any] | None = None

    @property
    def pending(self) -> int:
        """Micro-batches added since the last :meth:`end_step`."""
        return len(self._pending)

    def add(self, batch: TokenBatch | None = None, **fields: Any) -> None:
        """Add one micro-batch (a TokenBatch, or the fields ``TokenBatch.from_padded/from_flat`` take)."""
        check_fields(fields)               # a misspelt field raises here, in every mode
        try:
            self._pending.append(as_token_batch(batch, fields))
        except BatchError:
            if self.strict:
                raise
            if self._rejected is None:   # the collector reports the first bad micro-batch
                self._rejected = dict(fields) if batch is None else {"batch": batch, **fields}

    def end_step(self, step: int) -> dict[str, float]:
        """Log everything added since the last call as ``step``; returns the collector's report."""
        pending, rejected = self._pending, self._rejected
        self._pending, self._rejected = [], None
        if rejected is not None:
            batch = rejected.pop("batch", None)
            return self.collector.log_step(step, batch, **rejected)
        if not pending:
            return {}
        try:
            batch = concat_batches(pending)
        except BatchError as exc:
            if self.strict:
                raise
            self.error_count += 1
            log.error("mismatch-monitor: step %d was not recorded: %s (%d step hook error(s) so far)",
                      step, exc, self.error_count)
            return {"mismatch/step_hook_errors": float(self.error_count)}
        self.last_batch = batch
        return self.collector.log_step(step, batch)

    def log(self, step: int, batch: TokenBatch | None = None, **fields: Any) -> dict[str, float]:
        """:meth:`add` one batch and :meth:`end_step` at once (loops without accumulation)."""
        self.add(batch, **fields)
        return self.end_step(step)
