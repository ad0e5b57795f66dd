"""Bounds a pool declares about itself: the most updates its weights may lag by design.

A pool synced before every step samples with the trainer's weights (staleness 0); an
asynchronous pipeline ``k`` updates deep samples with weights up to ``k`` old. The pool's
``run.json`` metadata says so: ``MismatchCollector(pools={"async": {"max_staleness": 2}})``
(the simulator writes its pools' ``lag``). A pool seen with more staleness than it declares
has missed a sync: its pipeline stopped, a push did not apply (``log_event("weight_sync", ...,
applied=False)``, or a weight fingerprint that is not the version's), so
``MismatchSyncBehind`` fires at the first such step, without the history or the generic cap
of ``MismatchStalenessHigh``. A pool that declares nothing is judged by the cap only.

``mismatch_pool_bound{pool, metric}`` serves each declared bound to Prometheus (``metric`` is
the bounded metric's key without ``mismatch/``: ``staleness/max``), as the exporter serves the
expected levels; the rendered rule compares the pool's series with it.
"""

from __future__ import annotations

from typing import Any, Mapping

from prometheus_client.core import Metric

from .expected_series import gauge_family, level_label
from .label_text import label_text

POOL_BOUND = "mismatch_pool_bound"
# metric key -> the pool metadata field that bounds it
BOUNDS: dict[str, str] = {"mismatch/staleness/max": "max_staleness"}


def _is_bound(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_pool_bounds(pools: Mapping[str, Mapping[str, Any]] | None) -> None:
    """ValueError naming the pool for a declared bound that is not an integer >= 0."""
    for pool, meta in (pools or {}).items():
        for field in BOUNDS.values():
            if field not in meta:
                continue
            value = meta[field]
            if not _is_bound(value):
                raise ValueError(f"pool {pool!r}: expected {field} to be an integer >= 0 (the most updates its "
                                 f"weights may lag by design; 0 = synced before every step), got {value!r}")


def declared_bound(metric_key: str, meta: Mapping[str, Any] | None) -> float | None:
    """The bound a pool's metadata declares for ``metric_key`` (None: it declares none)."""
    field = BOUNDS.get(metric_key)
    value = meta.get(field) if field is not None and meta else None
    return None if isinstance(value, bool) or not isinstance(value, (int, float)) else float(value)


def pool_bound_samples(pools: Mapping[str, Mapping[str, Any]] | None) -> list[tuple[dict[str, str], float]]:
    """(labels, bound) of every pool and bounded metric it declares, sorted by pool."""
    out = []
    for pool in sorted(pools or {}):
        for key in BOUNDS:
            bound = declared_bound(key, (pools or {})[pool])
            if bound is not None:
                out.append(({"pool": label_text(str(pool)), "metric": level_label(key)}, bound))
    return out


def pool_bound_family(pools: Mapping[str, Mapping[str, Any]] | None) -> Metric:
    return gauge_family(POOL_BOUND, "a bound the pool declares in its metadata (max_staleness: the most updates "
                        "its weights may lag by design)", pool_bound_samples(pools))
