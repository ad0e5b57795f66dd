"""Colours: one per pool name, the same on every page and in every run; a sequential palette for
quantiles (ordered values, never pool colours).

A name's colour is a hash of its label text into :data:`PALETTE`, so it does not depend on which
other pools a figure or a run has. Two names of one figure that hash to the same slot are told
apart deterministically: in label order, a later one takes the next free slot.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

from plotly.colors import qualitative, sample_colorscale

NO_POOL_COLOR = "#7f7f7f"
# 19 distinct hues, the Plotly default first so a one-pool chart looks like plotly's; D3's grey is
# left out: it is the colour of the rows without a pool, which no named pool may share
PALETTE: tuple[str, ...] = tuple(c for c in (*qualitative.Plotly, *qualitative.D3)
                                 if c.lower() != NO_POOL_COLOR)


def slot(name: str) -> int:
    """The palette slot a label text hashes to (stable across processes: not Python's hash)."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=4).digest()
    return int.from_bytes(digest, "big") % len(PALETTE)


def assign(names: Iterable[str], no_pool: str | None = None) -> dict[str, str]:
    """Label text -> colour for the names of one figure: each its hashed slot, a collision
    resolved by the next free slot in label order (slots are reused past 19 names)."""
    taken: set[int] = set()
    out: dict[str, str] = {}
    for name in sorted(set(names)):
        if name == no_pool:
            out[name] = NO_POOL_COLOR
            continue
        s = slot(name)
        for k in range(len(PALETTE)):
            if (s + k) % len(PALETTE) not in taken:
                s = (s + k) % len(PALETTE)
                break
        taken.add(s)
        out[name] = PALETTE[s]
    return out


def sequential(n: int, scale: str = "Viridis") -> list[str]:
    """``n`` ordered colours (low to high) of a sequential scale, its pale end left out so that
    the last one stays visible on white."""
    if n <= 0:
        return []
    if n == 1:
        return sample_colorscale(scale, [0.0])
    return sample_colorscale(scale, [0.85 * i / (n - 1) for i in range(n)])
