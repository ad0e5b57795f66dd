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

import numpy as np
import torch

# The label dimensions every stored table carries (null when a batch does not give them).
STANDARD_DIMENSIONS: tuple[str, ...] = ("pool", "hardware", "precision", "engine", "env")


# the float fields a user's tensors may fill straight from a forward pass (and so require grad)
_FLOAT_FIELDS = ("trainer_logprobs", "sampler_logprobs", "advantages", "sampler_kept_logmass")


class BatchError(ValueError):
    """A batch that cannot be interpreted; the message says what was expected and what came."""


def _shape(t: torch.Tensor | None) -> str:
    return "None" if t is None else f"{tuple(t.shape)}"


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise BatchError(f"expected {name} to be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise BatchError(f"expected {name} to have a floating dtype (bf16/fp16/fp32/fp64), got {t.dtype}")


def _check_int(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise BatchError(f"expected {name} to be a torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise BatchError(f"expected {name} to have an integer dtype, got {t.dtype}")


def _clean_label(v: object) -> str | None:
    # None (or NaN) stays a missing label: stored as null, never as the string "None"
    return None if v is None or (isinstance(v, float) and v != v) else str(v)


def _clean_labels(values: tuple) -> tuple[str | None, ...]:
    """Labels as strings or None; labels repeat, so each distinct value is converted once."""
    try:
        distinct = set(values)
    except TypeError:                                # unhashable values: one by one
        return tuple(_clean_label(v) for v in values)
    if all(type(v) is str for v in distinct):
        return values
    clean = {v: _clean_label(v) for v in distinct}
    return tuple(clean[v] for v in values)


def _repeat_ids(B: int, lengths: torch.Tensor) -> torch.Tensor:
    """[N] int64: sequence b repeated lengths[b] times. On the CPU numpy's ``repeat`` is ~2x
    faster than ``torch.repeat_interleave`` (8M tokens: 30 ms against 59)."""
    if lengths.device.type == "cpu":
        return torch.from_numpy(np.repeat(np.arange(B, dtype=np.int64), lengths.numpy()))
    return torch.repeat_interleave(torch.arange(B, device=lengths.device), lengths)


@dataclass(frozen=True)
class TokenBatch:
    """One step's tokens in the flat layout; build it with :meth:`from_padded` or :meth:`from_flat`.

    Attributes (N tokens, B sequences, L layers, K experts per token):
        trainer_logprobs, sampler_logprobs: ``[N]`` float, log pi and log mu of the sampled tokens.
        seq_index: ``[N]`` int64, the sequence each token belongs to (0..B-1).
        position: ``[N]`` int64, the token's position within its response (a property: with
            contiguous sequences it is computed when asked; :meth:`positions_of` for a few tokens).
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
    """

    trainer_logprobs: torch.Tensor
    sampler_logprobs: torch.Tensor
    seq_index: torch.Tensor
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

    def __post_init__(self) -> None:
        # log-probs taken from the loss's forward require grad; the monitor only reads them, so
        # it keeps detached views (no copy) and never holds the autograd graph alive
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                object.__setattr__(self, name, value.detach())

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
        return tokens - self.seq_offsets[self.seq_index[tokens]]

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
        trainer_logprobs, sampler_logprobs = _detached(trainer_logprobs), _detached(sampler_logprobs)
        sampler_kept_logmass = _detached(sampler_kept_logmass)
        _check_float("trainer_logprobs", trainer_logprobs)
        _check_float("sampler_logprobs", sampler_logprobs)
        if trainer_logprobs.dim() != 2:
            raise BatchError(f"expected padded trainer_logprobs of shape [B, T], got {_shape(trainer_logprobs)}")
        if not isinstance(response_mask, torch.Tensor):
            raise BatchError(f"expected response_mask to be a torch.Tensor, got {type(response_mask).__name__}")
        for name, t in (("sampler_logprobs", sampler_logprobs), ("response_mask", response_mask)):
            if t.shape != trainer_logprobs.shape:
                raise BatchError(
                    f"shape mismatch: trainer_logprobs {_shape(trainer_logprobs)} vs {name} {_shape(t)}")
        _same_device(trainer_logprobs=trainer_logprobs, sampler_logprobs=sampler_logprobs,
                     response_mask=response_mask, turn_index=turn_index,
                     trainer_experts=trainer_experts, sampler_experts=sampler_experts,
                     in_trainer_support=in_trainer_support,
                     sampler_kept_logmass=sampler_kept_logmass, token_ids=token_ids)
        mask = response_mask if response_mask.dtype == torch.bool else response_mask != 0
        B, T = trainer_logprobs.shape
        rows = mask.nonzero(as_tuple=True)[0]  # row-major: tokens stay in sequence order

        def per_token(name: str, t: torch.Tensor | None, extra: int = 0) -> torch.Tensor | None:
            if t is None:
                return None
            if tuple(t.shape[:2]) != (B, T) or t.dim() != 2 + extra:
                want = "[B, T]" if extra == 0 else "[B, T, L, K]"
                raise BatchError(
                    f"shape mismatch: trainer_logprobs {_shape(trainer_logprobs)} vs {name} "
                    f"{_shape(t)} (expected {want})")
            return t[mask]

        return cls._build(
            trainer_logprobs=trainer_logprobs[mask],
            sampler_logprobs=sampler_logprobs[mask],
            seq_index=rows.to(torch.int64),
            num_sequences=B,
            seq_offsets=torch.cat([mask.new_zeros(1, dtype=torch.int64), mask.sum(1).cumsum(0)]),
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
        _check_float("trainer_logprobs", trainer_logprobs)
        _check_float("sampler_logprobs", sampler_logprobs)
        if trainer_logprobs.dim() != 1:
            raise BatchError(f"expected flat trainer_logprobs of shape [N], got {_shape(trainer_logprobs)}")
        if sampler_logprobs.shape != trainer_logprobs.shape:
            raise BatchError(
                f"shape mismatch: trainer_logprobs {_shape(trainer_logprobs)} vs sampler_logprobs "
                f"{_shape(sampler_logprobs)}")
        if (seq_offsets is None) == (seq_ids is None):
            raise BatchError("expected exactly one of seq_offsets [B + 1] or seq_ids [N]")
        # before any value is read: a tensor on another device (or 'meta') cannot be read here
        _same_device(trainer_logprobs=trainer_logprobs, sampler_logprobs=sampler_logprobs,
                     seq_ids=seq_ids, turn_index=turn_index, trainer_experts=trainer_experts,
                     sampler_experts=sampler_experts, in_trainer_support=in_trainer_support,
                     sampler_kept_logmass=sampler_kept_logmass, token_ids=token_ids)
        device = trainer_logprobs.device
        N = trainer_logprobs.shape[0]
        if seq_offsets is not None:
            offsets = torch.as_tensor(seq_offsets, device=device)
            _check_int("seq_offsets", offsets)
            offsets = offsets.to(torch.int64)
            if offsets.dim() != 1 or offsets.numel() < 1:
                raise BatchError(f"expected seq_offsets of shape [B + 1], got {_shape(offsets)}")
            if int(offsets[0]) != 0 or int(offsets[-1]) != N:
                raise BatchError(
                    f"expected seq_offsets to start at 0 and end at N={N}, got "
                    f"{int(offsets[0])}..{int(offsets[-1])}")
            lengths = offsets.diff()
            if bool((lengths < 0).any()):
                raise BatchError("expected non-decreasing seq_offsets")
            B = offsets.numel() - 1
            seq_index = _repeat_ids(B, lengths)
            position = None                      # contiguous sequences: computed when asked
        else:
            _check_int("seq_ids", seq_ids)
            if seq_ids.shape != trainer_logprobs.shape:
                raise BatchError(
                    f"shape mismatch: trainer_logprobs {_shape(trainer_logprobs)} vs seq_ids {_shape(seq_ids)}")
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
                    f"shape mismatch: trainer_logprobs {_shape(trainer_logprobs)} vs {name} "
                    f"{_shape(t)} (expected {want})")
            return t

        return cls._build(
            trainer_logprobs=trainer_logprobs,
            sampler_logprobs=sampler_logprobs,
            seq_index=seq_index,
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
        device = core["trainer_logprobs"].device
        B = int(num_sequences)
        clean_labels: dict[str, tuple[str | None, ...]] = {}
        for dim, values in (labels or {}).items():
            if not isinstance(dim, str) or not dim.isidentifier():
                raise BatchError(f"expected label dimension names to be identifiers, got {dim!r}")
            if dim in ("length_bucket", "turn_bucket", "step"):
                raise BatchError(f"label dimension {dim!r} is reserved")
            if isinstance(values, str):
                raise BatchError(f"expected labels[{dim!r}] to be a list of {B} strings, got one string")
            values = tuple(values)
            if len(values) != B:
                raise BatchError(f"expected labels[{dim!r}] to have one entry per sequence ({B}), got {len(values)}")
            clean_labels[dim] = _clean_labels(values)

        if turn_index is not None:
            _check_int("turn_index", turn_index)
            turn_index = turn_index.to(torch.int64)
            if turn_index.numel() and int(turn_index.min()) < 0:
                raise BatchError(f"expected turn_index >= 0, got min {int(turn_index.min())}")
        if policy_version is not None:
            policy_version = torch.as_tensor(policy_version, device=device)
            _check_int("policy_version", policy_version)
            if policy_version.shape != (B,):
                raise BatchError(f"expected policy_version of shape [{B}] (one per sequence), got {_shape(policy_version)}")
            if trainer_version is None:
                raise BatchError("policy_version given without trainer_version (staleness = trainer_version - policy_version)")
            policy_version = policy_version.to(torch.int64)
            if B and int(policy_version.max()) > int(trainer_version):
                raise BatchError(
                    f"expected policy_version <= trainer_version={int(trainer_version)}, got max "
                    f"{int(policy_version.max())} (a sampler cannot be ahead of the trainer)")
        if advantages is not None:
            advantages = torch.as_tensor(advantages, device=device)
            _check_float("advantages", advantages)
            if advantages.shape != (B,):
                raise BatchError(f"expected advantages of shape [{B}] (one per sequence), got {_shape(advantages)}")
        if (trainer_experts is None) != (sampler_experts is None):
            raise BatchError("expected both trainer_experts and sampler_experts, or neither")
        if trainer_experts is not None:
            _check_int("trainer_experts", trainer_experts)
            _check_int("sampler_experts", sampler_experts)
            if trainer_experts.shape != sampler_experts.shape:
                raise BatchError(
                    f"shape mismatch: trainer_experts {_shape(trainer_experts)} vs sampler_experts "
                    f"{_shape(sampler_experts)}")
        if in_trainer_support is not None and in_trainer_support.dtype != torch.bool:
            if in_trainer_support.is_floating_point():
                raise BatchError(f"expected in_trainer_support to be bool, got {in_trainer_support.dtype}")
            in_trainer_support = in_trainer_support != 0
        if sampler_kept_logmass is not None:
            _check_float("sampler_kept_logmass", sampler_kept_logmass)
        if token_ids is not None:
            _check_int("token_ids", token_ids)
            token_ids = token_ids.to(torch.int64)
        return cls(labels=clean_labels, policy_version=policy_version,
                   trainer_version=None if trainer_version is None else int(trainer_version),
                   advantages=advantages, turn_index=turn_index, trainer_experts=trainer_experts,
                   sampler_experts=sampler_experts, in_trainer_support=in_trainer_support,
                   sampler_kept_logmass=sampler_kept_logmass, token_ids=token_ids,
                   num_sequences=B, **core)


def _detached(t: object) -> object:
    """A tensor that requires grad as a detached view of the same memory; anything else as is."""
    return t.detach() if isinstance(t, torch.Tensor) and t.requires_grad else t


def _same_device(**tensors: torch.Tensor | None) -> None:
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise BatchError(f"expected all tensors on one device, got {listing}")
