"""The token pass's accumulators (dense per-cell and per-sequence running totals), the
bad-input policy per token, and one copy of many tensors to the host.

A pass on a GPU leaves every total on the device; the tables are assembled on the host from
all of them. ``packed_copy`` brings them over as one block of bytes (one device-to-host copy,
one wait per step) instead of a copy, and a wait, per array.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# float64 sums per joint bin, in this order
JOINT_SUMS = ("lr", "lr2", "k3", "exp_abs", "rho2")
# float64 probability-space sums per cell, in this order (p = exp(log-prob), dp = p_T - p_S computed
# as p_S * expm1(lr): no cancellation); sum p_T, p_T^2 and p_T p_S follow from them exactly
PSUM_ROWS = ("ps", "dp", "ps2", "psdp", "dp2", "abs_dp")


@dataclass
class TokenAccumulators:
    """Dense accumulators for C token cells (+1 dump) and B sequences (+1 dump)."""

    joint_n: torch.Tensor       # [(C + 1) * NL * R] int64, J = (cell * NL + lowprob) * R + slot
    joint_sums: torch.Tensor    # [len(JOINT_SUMS), (C + 1) * NL * R] float64
    abs_hist: torch.Tensor      # [(C + 1) * NB] int64 (int32 from the compiled pass, fewer than 2^31 tokens)
    min_lr: torch.Tensor        # [C + 1] float64
    max_lr: torch.Tensor        # [C + 1] float64
    n_nonfinite: torch.Tensor   # [C + 1] int64
    n_positive: torch.Tensor    # [C + 1] int64
    n_lr_zero: torch.Tensor     # [C + 1] int64 valid tokens with lr == 0 exactly (equal log-probs)
    p_sums: torch.Tensor        # [len(PSUM_ROWS), C + 1] float64
    max_abs_dp: torch.Tensor    # [C + 1] float64 largest |p_T - p_S| (0 while empty)
    n_support_known: torch.Tensor
    n_support_mismatch: torch.Tensor
    n_kept: torch.Tensor
    sum_kept: torch.Tensor
    seq_invalid: torch.Tensor   # [B + 1] int64 invalid tokens per sequence
    seq_sum_lr: torch.Tensor    # [B + 1] float64
    seq_sum_exp_abs: torch.Tensor
    seq_max_abs: torch.Tensor

    @classmethod
    def zeros(cls, C: int, B: int, J: int, NB: int, device: torch.device,
              hist_dtype: torch.dtype = torch.int64) -> "TokenAccumulators":
        f64, i64 = torch.float64, torch.int64
        z = lambda n, dt=i64: torch.zeros(n, dtype=dt, device=device)  # noqa: E731
        return cls(
            joint_n=z(J), joint_sums=torch.zeros(len(JOINT_SUMS), J, dtype=f64, device=device),
            abs_hist=z((C + 1) * NB, hist_dtype),
            min_lr=torch.full((C + 1,), math.inf, dtype=f64, device=device),
            max_lr=torch.full((C + 1,), -math.inf, dtype=f64, device=device),
            n_nonfinite=z(C + 1), n_positive=z(C + 1), n_lr_zero=z(C + 1),
            p_sums=torch.zeros(len(PSUM_ROWS), C + 1, dtype=f64, device=device), max_abs_dp=z(C + 1, f64),
            n_support_known=z(C + 1),
            n_support_mismatch=z(C + 1), n_kept=z(C + 1), sum_kept=z(C + 1, f64),
            seq_invalid=z(B + 1), seq_sum_lr=z(B + 1, f64), seq_sum_exp_abs=z(B + 1, f64),
            seq_max_abs=z(B + 1, f64),
        )

    def sum_rows(self) -> dict[str, torch.Tensor]:
        """The rows of ``joint_sums`` by name (``JOINT_SUMS``)."""
        return dict(zip(JOINT_SUMS, self.joint_sums))

    def merge_(self, other: "TokenAccumulators") -> None:
        for name, value in vars(self).items():
            o = getattr(other, name)
            if name == "min_lr":
                torch.minimum(value, o, out=value)
            elif name in ("max_lr", "seq_max_abs", "max_abs_dp"):
                torch.maximum(value, o, out=value)
            else:
                value += o


def packed_copy(tensors: list[torch.Tensor], device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """``tensors`` (any dtypes and shapes, on one device) copied to ``device`` in one transfer:
    their bytes side by side in one buffer, copied once, then viewed back as each tensor."""
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    # each piece starts at a multiple of 8 bytes, so that it can be viewed as its dtype again
    pads = [(-f.numel()) % 8 for f in flat]
    pieces = []
    for f, pad in zip(flat, pads):
        pieces += [f, f.new_zeros(pad)] if pad else [f]
    block = torch.cat(pieces).to(device)
    out, at = [], 0
    for t, f, pad in zip(tensors, flat, pads):
        out.append(block[at:at + f.numel()].view(t.dtype).reshape(t.shape))
        at += f.numel() + pad
    return out


def token_validity(t: torch.Tensor, s: torch.Tensor, tol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The bad-input policy per token: (finite on both sides, a finite log-prob above ``tol``).
    A token is valid when finite and not positive; every other one is set aside and counted."""
    finite = torch.isfinite(t) & torch.isfinite(s)
    return finite, finite & ((t > tol) | (s > tol))
