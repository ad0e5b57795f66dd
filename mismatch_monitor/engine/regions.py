"""Regions of lr: every band, cap and 0 cut the line, so each threshold count is a sum of
regions, and the joint (lowprob bucket, region) code of every token."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import MetricConfig
from .routing import flat_nonzero


def ppo_band(config: MetricConfig) -> tuple[float, float]:
    """(1 - eps, 1 + eps) of the PPO ratio clip: one definition for the regions and the count."""
    return (1.0 - config.ppo_clip_eps, 1.0 + config.ppo_clip_eps)


@dataclass(frozen=True)
class Regions:
    """lr thresholds of every band and cap, and 0; region i holds lr in (b[i-1], b[i]].

    Each region holds lr of one sign. Regions are stored in *slot* order: slot 0 is the region
    just below 0, slot 1 the one just above (where nearly all tokens fall), then the others.
    """

    boundaries: tuple[float, ...]

    @classmethod
    def from_config(cls, config: MetricConfig) -> "Regions":
        c = config.tis_cap
        points = {0.0, math.log(1.0 / c), math.log(c), *(math.log(v) for v in config.icepop_band),
                  *(math.log(v) for v in config.extreme_band), *(math.log(v) for v in ppo_band(config))}
        return cls(tuple(sorted(points)))

    @property
    def num_regions(self) -> int:
        return len(self.boundaries) + 1

    @property
    def zero(self) -> int:
        """Region (b[z-1], 0]."""
        return self.boundaries.index(0.0)

    def slots(self) -> list[int]:
        """Slot of every region (region order)."""
        z = self.zero
        others = [r for r in range(self.num_regions) if r not in (z, z + 1)]
        slot = {z: 0, z + 1: 1, **{r: i + 2 for i, r in enumerate(others)}}
        return [slot[r] for r in range(self.num_regions)]

    def at_most(self, value: float) -> int:
        """Regions r <= this hold exactly the lr <= log(value)."""
        return self.boundaries.index(math.log(value))

    def negative(self) -> list[bool]:
        """Whether each region holds lr <= 0 (else lr > 0)."""
        return [r <= self.zero for r in range(self.num_regions)]


@dataclass(frozen=True)
class JointCoder:
    """Computes ``lowprob_bucket * R + slot`` of every token (the low part of the joint index)."""

    log_edges: tuple[float, ...]       # log of MetricConfig.lowprob_edges
    log_edge_tensor: torch.Tensor      # the same, [NL - 1] float64
    R: int
    outlier_abs: float                 # lr in slot 0 or 1 has |lr| < this
    region_bounds: torch.Tensor        # [R - 1] float64
    slot_of_region: torch.Tensor       # [R] int64

    @classmethod
    def build(cls, config: MetricConfig, device: torch.device) -> "JointCoder":
        regions = Regions.from_config(config)
        b, z = regions.boundaries, regions.zero
        log_edges = tuple(math.log(e) for e in config.lowprob_edges)
        return cls(log_edges=log_edges,
                   log_edge_tensor=torch.tensor(log_edges, dtype=torch.float64, device=device),
                   R=regions.num_regions, outlier_abs=min(-b[z - 1], b[z + 1]),
                   region_bounds=torch.tensor(b, dtype=torch.float64, device=device),
                   slot_of_region=torch.tensor(regions.slots(), dtype=torch.int64, device=device))

    def code(self, lr: torch.Tensor, abs_lr: torch.Tensor, s: torch.Tensor, *, sync_free: bool = False
             ) -> torch.Tensor:
        """[n] int64 from lr, |lr| and the sampler log-prob s (float64).

        ``torch.bucketize`` costs ~20 ns a token; counting edges with byte adds costs a few, and
        only the rare lr outside the central regions need a binary search for their slot. Finding
        those waits for their count: with ``sync_free`` (a GPU) every token is searched instead."""
        R = self.R
        if (len(self.log_edges) + 1) * R <= 256:
            code = (lr > 0).view(torch.uint8)                           # slot 0 or 1
            for edge in self.log_edges:
                code.add_((s >= edge).view(torch.uint8), alpha=R)       # bucket = edges <= log p
            code = code.to(torch.int64)
        else:
            code = torch.bucketize(s, self.log_edge_tensor, right=True).mul_(R).add_((lr > 0).to(torch.int64))
        if sync_free:
            slot = self.slot_of_region[torch.bucketize(lr, self.region_bounds, right=False)]
            outside = abs_lr >= self.outlier_abs
            return code.add_(torch.where(outside, slot - (lr > 0).to(torch.int64), 0))
        # |lr| >= the nearer central bound flags every lr outside the central slots, and a few inside
        out = flat_nonzero(abs_lr >= self.outlier_abs)
        if out.numel():
            lo = lr[out]
            slot = self.slot_of_region[torch.bucketize(lo, self.region_bounds, right=False)]
            code[out] += slot - (lo > 0).to(torch.int64)
        return code
