"""The input contract: one validated token batch.

A batch is the tokens of one trainer step (or one rank's share of it). Two layouts are
accepted and normalised to one flat layout:

* padded: ``[B, T]`` tensors plus a ``response_mask`` ``[B, T]`` (nonzero = response token);
* flat: ``[N]`` tensors plus either ``seq_offsets`` ``[B + 1]`` (cumulative lengths, sequences
  contiguous) or ``seq_ids`` ``[N]`` (sequence index of each token, any order).

Policy for bad input (documented once, here):

* Structural errors raise ``BatchError`` at construction, always: shapes that do not line up
  (the message shows both shapes), integer or bool log-probs, per-token tensors on different
  devices, a label list whose length is not the number of sequences, expert ids whose
  ``[L, K]`` differ. Per-sequence values (``seq_offsets``, ``policy_version``, ``advantages``)
  may be lists or tensors on any device; they are moved to the log-probs' device.
* Value errors are *data quality*, never raised here: non-finite log-probs and log-probs above
  ``MetricConfig.positive_logprob_tol`` are set aside by the engine (excluded from every
  statistic) and counted per slice in ``n_nonfinite`` / ``n_positive_logprob``.
* An empty batch (no response tokens) is valid and yields no cells: every metric is null.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from .batch_checks import (BatchError, check_float, check_int, checked_fields, checked_offsets, detached,
                           same_device, shape_text)
from .batch_layout import PaddedRows, repeat_ids

__all__ = ["STANDARD_DIMENSIONS", "BatchError", "TokenBatch"]

# The label dimensions every stored table carries (null when a batch does not give them).
STANDARD_DIMENSIONS: tuple[str, ...] = ("pool", "hardware", "precision", "engine", "env")


# the float fields a user's tensors may fill straight from a forward pass (and so require grad)
_FLOAT_FIELDS = ("trainer_logprobs", "sampler_logprobs", "advantages", "sampler_kept_logmass")


@dataclass(frozen=True)
class TokenBatch:
    """One step's tokens in the flat layout; build it with :meth:`from_padded` or :meth:`from_flat`.

    Attributes (N tokens, B sequences, L layers, K experts per token):
        trainer_logprobs, sampler_logprobs: ``[N]`` float, log pi and log mu of the sampled tokens.
        seq_index, position: ``[N]`` int64, each token's sequence (0..B-1) and position in its
            response (properties: with contiguous sequences computed when first asked, as the
            compiled pass reads ``seq_offsets``; :meth:`sequences_of`, :meth:`positions_of`).
        num_sequences: B.
        labels: dimension -> B strings (pool, hardware, precision, engine, env, or any other).
        turn_index: ``[N]`` int64 turn of each token (multi-turn agents) or None.
        policy_version: ``[B]`` int64 sampler policy version per sequence, with trainer_version.
        advantages: ``[B]`` float per-sequence advantage or None.
        trainer_experts, sampler_experts: ``[N, L, K]`` integer top-k expert ids or None.
        in_trainer_support: ``[N]`` bool, sampled token inside the trainer's top-p/top-k set.
        sampler_kept_logmass: ``[N]`` float, log of the kept mass S the sampler truncated to.
        token_ids: ``[N]`` int64 token ids (kept in exemplars) or None.
        seq_offsets: ``[B + 1]`` int64 when every sequence's tokens are contiguous and in order
            (the padded and offsets layouts), else None; lets exemplars read one sequence's tokens.
        position_index: ``[N]`` int64 positions when sequences are not contiguous (``seq_ids``
            layout), else None.
        seq_ids: ``[N]`` int64 as stored: given (``seq_ids`` layout), or None until ``seq_index``.
    """

    trainer_logprobs: torch.Tensor
    sampler_logprobs: torch.Tensor
    num_sequences: int
    labels: Mapping[str, tuple[str | None, ...]] = field(default_factory=dict)
    turn_index: torch.Tensor | None = None
    policy_version: torch.Tensor | None = None
    trainer_version: int | None = None
    advantages: torch.Tensor | None = None
    trainer_experts: torch.Tensor | None = None
    sampler_experts: torch.Tensor | None = None
    in_trainer_support: torch.Tensor | None = None
    sampler_kept_logmass: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None
    seq_offsets: torch.Tensor | None = None
    position_index: torch.Tensor | None = None
    seq_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # log-probs taken from the loss's forward require grad; the monitor only reads them, so
        # it keeps detached views (no copy) and never holds the autograd graph alive
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                object.__setattr__(self, name, value.detach())

    @property
    def seq_index(self) -> torch.Tensor:
        """``[N]`` int64 sequence of every token (built from ``seq_offsets`` once, when asked)."""
        if self.seq_ids is None:
            ids = repeat_ids(self.num_sequences, self.seq_offsets.diff(), self.num_tokens)
            object.__setattr__(self, "seq_ids", ids)
        return self.seq_ids

    def sequences_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """Sequences of the tokens at flat indices ``tokens`` (reads only those)."""
        if self.seq_ids is None and self.seq_offsets is not None:
            return torch.searchsorted(self.seq_offsets, tokens, right=True) - 1
        return self.seq_index[tokens]

    @property
    def position(self) -> torch.Tensor:
        """``[N]`` int64 position of every token within its response."""
        return self.positions_of(torch.arange(self.num_tokens, device=self.device))

    def positions_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """Positions of the tokens at flat indices ``tokens`` (reads only those)."""
        if self.position_index is not None:
            return self.position_index[tokens]
        if self.seq_offsets is None:
            raise BatchError("a batch needs seq_offsets or position_index to know positions")
        return tokens - self.seq_offsets[self.sequences_of(tokens)]

    @property
    def num_tokens(self) -> int:
        return int(self.trainer_logprobs.shape[0])

    @property
    def device(self) -> torch.device:
        return self.trainer_logprobs.device

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_padded(
        cls,
        trainer_logprobs: torch.Tensor,
        sampler_logprobs: torch.Tensor,
        response_mask: torch.Tensor,
        *,
        labels: Mapping[str, Sequence[str]] | None = None,
        turn_index: torch.Tensor | None = None,
        policy_version: torch.Tensor | Sequence[int] | None = None,
        trainer_version: int | None = None,
        advantages: torch.Tensor | Sequence[float] | None = None,
        trainer_experts: torch.Tensor | None = None,
        sampler_experts: torch.Tensor | None = None,
        in_trainer_support: torch.Tensor | None = None,
        sampler_kept_logmass: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> "TokenBatch":
        """Padded ``[B, T]`` tensors; ``response_mask`` selects the response tokens."""
        # detach before masking: the masked copies would otherwise join the autograd graph
        trainer_logprobs, sampler_logprobs = detached(trainer_logprobs), detached(sampler_logprobs)
        sampler_kept_logmass = detached(sampler_kept_logmass)
        check_float("trainer_logprobs", trainer_logprobs)
        check_float("sampler_logprobs", sampler_logprobs)
        if trainer_logprobs.dim() != 2:
            raise BatchError(f"expected padded trainer_logprobs of shape [B, T], got {shape_text(trainer_logprobs)}")
        if not isinstance(response_mask, torch.Tensor):
            raise BatchError(f"expected response_mask to be a torch.Tensor, got {type(response_mask).__name__}")
        for name, t in (("sampler_logprobs", sampler_logprobs), ("response_mask", response_mask)):
            if t.shape != trainer_logprobs.shape:
                raise BatchError(
                    f"shape mismatch: trainer_logprobs {shape_text(trainer_logprobs)} vs {name} {shape_text(t)}")
        same_device(trainer_logprobs=trainer_logprobs, sampler_logprobs=sampler_logprobs,
                     response_mask=response_mask, turn_index=turn_index,
                     trainer_experts=trainer_experts, sampler_experts=sampler_experts,
                     in_trainer_support=in_trainer_support,
                     sampler_kept_logmass=sampler_kept_logmass, token_ids=token_ids)
        B, T = trainer_logprobs.shape
        rows = PaddedRows(response_mask)   # row-major: tokens stay in sequence order

        def per_token(name: str, t: torch.Tensor | None, extra: int = 0) -> torch.Tensor | None:
            if t is None:
                return None
            if tuple(t.shape[:2]) != (B, T) or t.dim() != 2 + extra:
                want = "[B, T]" if extra == 0 else "[B, T, L, K]"
                raise BatchError(
                    f"shape mismatch: trainer_logprobs {shape_text(trainer_logprobs)} vs {name} "
                    f"{shape_text(t)} (expected {want})")
            return rows.select(t)

        return cls._build(
            trainer_logprobs=rows.select(trainer_logprobs),
            sampler_logprobs=rows.select(sampler_logprobs),
            num_sequences=B,
            seq_offsets=rows.offsets,
            labels=labels,
            turn_index=per_token("turn_index", turn_index),
            policy_version=policy_version,
            trainer_version=trainer_version,
            advantages=advantages,
            trainer_experts=per_token("trainer_experts", trainer_experts, 2),
            sampler_experts=per_token("sampler_experts", sampler_experts, 2),
            in_trainer_support=per_token("in_trainer_support", in_trainer_support),
            sampler_kept_logmass=per_token("sampler_kept_logmass", sampler_kept_logmass),
            token_ids=per_token("token_ids", token_ids),
        )

    @classmethod
    def from_flat(
        cls,
        trainer_logprobs: torch.Tensor,
        sampler_logprobs: torch.Tensor,
        *,
        seq_offsets: torch.Tensor | Sequence[int] | None = None,
        seq_ids: torch.Tensor | None = None,
        num_sequences: int | None = None,
        labels: Mapping[str, Sequence[str]] | None = None,
        turn_index: torch.Tensor | None = None,
        policy_version: torch.Tensor | Sequence[int] | None = None,
        trainer_version: int | None = None,
        advantages: torch.Tensor | Sequence[float] | None = None,
        trainer_experts: torch.Tensor | None = None,
        sampler_experts: torch.Tensor | None = None,
        in_trainer_support: torch.Tensor | None = None,
        sampler_kept_logmass: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> "TokenBatch":
        """Flat ``[N]`` tensors with ``seq_offsets`` ``[B + 1]`` or ``seq_ids`` ``[N]``."""
        check_float("trainer_logprobs", trainer_logprobs)
        check_float("sampler_logprobs", sampler_logprobs)
        if trainer_logprobs.dim() != 1:
            raise BatchError(f"expected flat trainer_logprobs of shape [N], got {shape_text(trainer_logprobs)}")
        if sampler_logprobs.shape != trainer_logprobs.shape:
            raise BatchError(
                f"shape mismatch: trainer_logprobs {shape_text(trainer_logprobs)} vs sampler_logprobs "
                f"{shape_text(sampler_logprobs)}")
        if (seq_offsets is None) == (seq_ids is None):
            raise BatchError("expected exactly one of seq_offsets [B + 1] or seq_ids [N]")
        # before any value is read: a tensor on another device (or 'meta') cannot be read here
        same_device(trainer_logprobs=trainer_logprobs, sampler_logprobs=sampler_logprobs,
                     seq_ids=seq_ids, turn_index=turn_index, trainer_experts=trainer_experts,
                     sampler_experts=sampler_experts, in_trainer_support=in_trainer_support,
                     sampler_kept_logmass=sampler_kept_logmass, token_ids=token_ids)
        device = trainer_logprobs.device
        N = trainer_logprobs.shape[0]
        if seq_offsets is not None:
            offsets = checked_offsets(seq_offsets, N, device)
            B = offsets.numel() - 1
            seq_index = None                     # contiguous sequences: built when asked
            position = None
        else:
            check_int("seq_ids", seq_ids)
            if seq_ids.shape != trainer_logprobs.shape:
                raise BatchError(
                    f"shape mismatch: trainer_logprobs {shape_text(trainer_logprobs)} vs seq_ids {shape_text(seq_ids)}")
            seq_index = seq_ids.to(torch.int64)
            if N and int(seq_index.min()) < 0:
                raise BatchError(f"expected seq_ids >= 0, got min {int(seq_index.min())}")
            top = int(seq_index.max()) + 1 if N else 0
            B = top if num_sequences is None else int(num_sequences)
            if B < top:
                raise BatchError(f"num_sequences={B} but seq_ids go up to {top - 1}")
            # position within the sequence, in the order tokens appear
            order = torch.sort(seq_index, stable=True).indices
            sorted_ids = seq_index[order]
            starts = torch.searchsorted(sorted_ids, sorted_ids, right=False)
            position = torch.empty_like(seq_index)
            position[order] = torch.arange(N, device=device) - starts

        def per_token(name: str, t: torch.Tensor | None, extra: int = 0) -> torch.Tensor | None:
            if t is None:
                return None
            if t.shape[:1] != (N,) or t.dim() != 1 + extra:
                want = "[N]" if extra == 0 else "[N, L, K]"
                raise BatchError(
                    f"shape mismatch: trainer_logprobs {shape_text(trainer_logprobs)} vs {name} "
                    f"{shape_text(t)} (expected {want})")
            return t

        return cls._build(
            trainer_logprobs=trainer_logprobs,
            sampler_logprobs=sampler_logprobs,
            seq_ids=seq_index,
            position_index=position,
            num_sequences=B,
            seq_offsets=offsets if seq_offsets is not None else None,
            labels=labels,
            turn_index=per_token("turn_index", turn_index),
            policy_version=policy_version,
            trainer_version=trainer_version,
            advantages=advantages,
            trainer_experts=per_token("trainer_experts", trainer_experts, 2),
            sampler_experts=per_token("sampler_experts", sampler_experts, 2),
            in_trainer_support=per_token("in_trainer_support", in_trainer_support),
            sampler_kept_logmass=per_token("sampler_kept_logmass", sampler_kept_logmass),
            token_ids=per_token("token_ids", token_ids),
        )

    # ------------------------------------------------------------------ shared validation
    @classmethod
    def _build(cls, *, labels, policy_version, trainer_version, advantages, turn_index,
               trainer_experts, sampler_experts, in_trainer_support, sampler_kept_logmass,
               token_ids, num_sequences, **core) -> "TokenBatch":
        B = int(num_sequences)
        checked = checked_fields(
            core["trainer_logprobs"].device, B, labels=labels, policy_version=policy_version,
            trainer_version=trainer_version, advantages=advantages, turn_index=turn_index,
            trainer_experts=trainer_experts, sampler_experts=sampler_experts,
            in_trainer_support=in_trainer_support, sampler_kept_logmass=sampler_kept_logmass,
            token_ids=token_ids)
        return cls(num_sequences=B, **checked, **core)
