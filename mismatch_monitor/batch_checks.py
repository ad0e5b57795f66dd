"""The checks of ``TokenBatch``'s fields (``batch.py`` states the policy for bad input).

Everything here raises :class:`BatchError` with a message that says what was expected and what
came; nothing here repairs a value. ``batch.py`` keeps the two layouts (padded, flat) and how
each becomes the flat one; this module keeps what every layout shares: the type checks, the
device check and the per-sequence fields (labels, versions, advantages) and per-token extras.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch


class BatchError(ValueError):
    """A batch that cannot be interpreted; the message says what was expected and what came."""


def shape_text(t: torch.Tensor | None) -> str:
    return "None" if t is None else f"{tuple(t.shape)}"


def check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise BatchError(f"expected {name} to be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise BatchError(f"expected {name} to have a floating dtype (bf16/fp16/fp32/fp64), got {t.dtype}")


def check_int(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise BatchError(f"expected {name} to be a torch.Tensor, got {type(t).__name__}")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise BatchError(f"expected {name} to have an integer dtype, got {t.dtype}")


def checked_offsets(seq_offsets: object, N: int, device: torch.device) -> torch.Tensor:
    """``seq_offsets`` as [B + 1] int64 on ``device``: from 0 to N, non-decreasing."""
    offsets = torch.as_tensor(seq_offsets, device=device)
    check_int("seq_offsets", offsets)
    offsets = offsets.to(torch.int64)
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise BatchError(f"expected seq_offsets of shape [B + 1], got {shape_text(offsets)}")
    if int(offsets[0]) != 0 or int(offsets[-1]) != N:
        raise BatchError(
            f"expected seq_offsets to start at 0 and end at N={N}, got {int(offsets[0])}..{int(offsets[-1])}")
    if bool((offsets.diff() < 0).any()):
        raise BatchError("expected non-decreasing seq_offsets")
    return offsets


def _clean_label(v: object) -> str | None:
    # None (or NaN) stays a missing label: stored as null, never as the string "None"
    return None if v is None or (isinstance(v, float) and v != v) else str(v)


def clean_labels(values: tuple) -> tuple[str | None, ...]:
    """Labels as strings or None; labels repeat, so each distinct value is converted once."""
    try:
        distinct = set(values)
    except TypeError:                                # unhashable values: one by one
        return tuple(_clean_label(v) for v in values)
    if all(type(v) is str for v in distinct):
        return values
    clean = {v: _clean_label(v) for v in distinct}
    return tuple(clean[v] for v in values)


def checked_fields(device: torch.device, B: int, *, labels: Mapping[str, Sequence[object]] | None,
                   policy_version: torch.Tensor | Sequence[int] | None, trainer_version: int | None,
                   advantages: torch.Tensor | Sequence[float] | None, turn_index: torch.Tensor | None,
                   trainer_experts: torch.Tensor | None, sampler_experts: torch.Tensor | None,
                   in_trainer_support: torch.Tensor | None, sampler_kept_logmass: torch.Tensor | None,
                   token_ids: torch.Tensor | None) -> dict[str, Any]:
    """The fields every layout shares, checked and normalised (labels as strings or None, ids as
    int64, ``in_trainer_support`` as bool), for a batch of ``B`` sequences on ``device``."""
    checked_labels: dict[str, tuple[str | None, ...]] = {}
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
        checked_labels[dim] = clean_labels(values)

    if turn_index is not None:
        check_int("turn_index", turn_index)
        turn_index = turn_index.to(torch.int64)
        if turn_index.numel() and int(turn_index.min()) < 0:
            raise BatchError(f"expected turn_index >= 0, got min {int(turn_index.min())}")
    if policy_version is not None:
        policy_version = torch.as_tensor(policy_version, device=device)
        check_int("policy_version", policy_version)
        if policy_version.shape != (B,):
            raise BatchError(f"expected policy_version of shape [{B}] (one per sequence), got {shape_text(policy_version)}")
        if trainer_version is None:
            raise BatchError("policy_version given without trainer_version (staleness = trainer_version - policy_version)")
        policy_version = policy_version.to(torch.int64)
        if B and int(policy_version.max()) > int(trainer_version):
            raise BatchError(
                f"expected policy_version <= trainer_version={int(trainer_version)}, got max "
                f"{int(policy_version.max())} (a sampler cannot be ahead of the trainer)")
    if advantages is not None:
        advantages = torch.as_tensor(advantages, device=device)
        check_float("advantages", advantages)
        if advantages.shape != (B,):
            raise BatchError(f"expected advantages of shape [{B}] (one per sequence), got {shape_text(advantages)}")
    if (trainer_experts is None) != (sampler_experts is None):
        raise BatchError("expected both trainer_experts and sampler_experts, or neither")
    if trainer_experts is not None:
        check_int("trainer_experts", trainer_experts)
        check_int("sampler_experts", sampler_experts)
        if trainer_experts.shape != sampler_experts.shape:
            raise BatchError(
                f"shape mismatch: trainer_experts {shape_text(trainer_experts)} vs sampler_experts "
                f"{shape_text(sampler_experts)}")
    if in_trainer_support is not None and in_trainer_support.dtype != torch.bool:
        if in_trainer_support.is_floating_point():
            raise BatchError(f"expected in_trainer_support to be bool, got {in_trainer_support.dtype}")
        in_trainer_support = in_trainer_support != 0
    if sampler_kept_logmass is not None:
        check_float("sampler_kept_logmass", sampler_kept_logmass)
    if token_ids is not None:
        check_int("token_ids", token_ids)
        token_ids = token_ids.to(torch.int64)
    return dict(labels=checked_labels, policy_version=policy_version,
                trainer_version=None if trainer_version is None else int(trainer_version),
                advantages=advantages, turn_index=turn_index, trainer_experts=trainer_experts,
                sampler_experts=sampler_experts, in_trainer_support=in_trainer_support,
                sampler_kept_logmass=sampler_kept_logmass, token_ids=token_ids)


def detached(t: object) -> object:
    """A tensor that requires grad as a detached view of the same memory; anything else as is."""
    return t.detach() if isinstance(t, torch.Tensor) and t.requires_grad else t


def same_device(**tensors: torch.Tensor | None) -> None:
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise BatchError(f"expected all tensors on one device, got {listing}")
