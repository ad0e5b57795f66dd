"""Wall-clock durations of repeated calls, shared by the benchmark scripts."""

from __future__ import annotations

import time
from typing import Callable


def durations(fn: Callable[[], object], repeat: int) -> list[float]:
    """Seconds each of ``repeat`` calls of ``fn`` took, in order."""
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out
