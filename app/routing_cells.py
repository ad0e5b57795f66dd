"""Per-layer routing cells as observations: the store keeps a (step, layer) row only where some
token flipped there, so a layer that routed tokens without a flip has no row. Here such a cell
becomes an observation of 0 flips; only a step bin where no token carried expert ids stays null
("no observation")."""

from __future__ import annotations

import numpy as np
import pandas as pd


def with_zero_flips(layers: pd.DataFrame, routed: pd.DataFrame) -> pd.DataFrame:
    """``layers`` (step, layer, n_flips, ...) completed to every (step bin with routed tokens,
    layer seen in ``layers``) pair; ``routed`` holds n_routed_tokens per step bin. The store does
    not record a layer count, so a layer that never flipped in the steps shown is not known."""
    if not len(layers):
        return layers
    keep = [c for c in ("step", "step_last", "wall_time") if c in routed.columns]
    bins = routed.loc[routed["n_routed_tokens"].fillna(0) > 0, keep + ["n_routed_tokens"]]
    grid = bins.merge(pd.DataFrame({"layer": np.sort(layers["layer"].unique())}), how="cross")
    flips = layers[["step", "layer", "n_flips"]]
    full = grid.merge(flips, on=["step", "layer"], how="left")
    full["n_flips"] = full["n_flips"].fillna(0).astype("int64")
    full["flip_rate"] = full["n_flips"] / full["n_routed_tokens"]
    return full.sort_values(["step", "layer"]).reset_index(drop=True)
