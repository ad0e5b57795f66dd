"""Expected (healthy) mismatch levels per sampler precision and engine, shipped as data.

A pool is described as "x times its expected level" instead of by a bare number: a bf16 pool and
an FP8 pool are healthy at different k3 KL, tail and extreme-band levels. The levels are rows of
``expected_levels.csv`` (in the package, installed with the wheel): ``metric, precision, engine,
healthy, source``. ``source`` is a published figure the project cites or ``measured: <how>``
(the command that measured it from one of the project's own runs, read with the query layer).
The file is checked when this module is imported; a bad row is an error naming the row.

Where a run says a pool's precision and engine: ``run.json`` ``pools`` maps each pool name to its
metadata, ``{"precision": ..., "engine": ..., "hardware": ...}``, as given to
``MismatchCollector(pools=...)`` or written by the simulator (``sim/pools.py``
``PoolSpec.metadata``: ``engine`` is e.g. ``vllm``, ``vllm/top_p0.9`` or ``transformers/sdpa``).
:func:`expected_for_pool` reads exactly those two fields. Lookups compare normalised names:
lower case, ``bfloat16``/``float16``/``float32`` as ``bf16``/``fp16``/``fp32``, and the engine's
family (its name before any ``/`` or space: ``vllm 0.11`` and ``vllm/top_p0.9`` are ``vllm``). A
precision with a variant (``fp8_e4m3``) falls back to its family's row (``fp8``) when it has none
of its own, and a family (``fp8``) takes the row of its one variant (``fp8_e4m3``) when there is
exactly one. No row: None (unknown, never a guess).

Measured rows describe the project's own runs (a tiny policy, CPU engines): they make the sample
runs readable and fix the scale of each format against the others; a fleet of real models
measures its own levels with ``python -m mismatch_monitor.measure_levels RUN_DIR --pools ...``
(``measure_levels.py``) and ships them the same way.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from importlib import resources
from typing import Iterable, Mapping

from .metrics import METRIC_BY_KEY

DATA_FILE = "expected_levels.csv"
COLUMNS = ("metric", "precision", "engine", "healthy", "source")
# the metrics a level is shipped for: healthy k3 KL, tail of |log rho|, extreme-band share
LEVEL_METRICS = ("mismatch/k3_kl", "mismatch/abs_log_ratio/p99", "mismatch/extreme_fraction")
_PRECISION_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


@dataclass(frozen=True)
class ExpectedLevel:
    metric: str        # a metric key (mismatch/k3_kl, ...)
    precision: str     # the sampler's precision, normalised (bf16, fp8_e4m3, int4, ...)
    engine: str        # the engine family (vllm, transformers, ...)
    healthy: float     # the metric's level on a healthy pool of this kind (> 0)
    source: str        # a citation, or "measured: <how>"


def normalise_precision(precision: str) -> str:
    text = precision.strip().lower()
    return _PRECISION_ALIASES.get(text, text)


def normalise_engine(engine: str) -> str:
    """The engine's family: its name before any ``/`` or whitespace, lower case."""
    return re.split(r"[/\s]", engine.strip().lower(), maxsplit=1)[0]


def parse_levels(lines: Iterable[str], where: str = DATA_FILE) -> tuple[ExpectedLevel, ...]:
    """The rows of a levels file (CSV with a header of ``COLUMNS``); ValueError naming the row
    (its line number and text) for a row that is not one."""
    reader = csv.reader(lines)
    header = next(reader, None)
    if header is None or tuple(h.strip() for h in header) != COLUMNS:
        raise ValueError(f"{where}: expected the header {','.join(COLUMNS)}, got {header!r}")
    levels: list[ExpectedLevel] = []
    seen: dict[tuple[str, str, str], int] = {}
    for row in reader:
        line = reader.line_num
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != len(COLUMNS):
            raise ValueError(f"{where} line {line}: expected {len(COLUMNS)} fields, got {len(row)}: {row!r}")
        metric, precision, engine, healthy_text, source = (c.strip() for c in row)
        if metric not in METRIC_BY_KEY:
            raise ValueError(f"{where} line {line}: unknown metric {metric!r}; expected a key of "
                             "mismatch_monitor.metrics.METRICS")
        if not precision or not engine:
            raise ValueError(f"{where} line {line}: expected a precision and an engine, got {row!r}")
        try:
            healthy = float(healthy_text)
        except ValueError:
            raise ValueError(f"{where} line {line}: expected a number for healthy, got {healthy_text!r}") from None
        if not (math.isfinite(healthy) and healthy > 0):
            raise ValueError(f"{where} line {line}: expected a finite healthy level > 0, got {healthy_text!r}")
        if not source:
            raise ValueError(f"{where} line {line}: expected a source (a citation or 'measured: <how>')")
        key = (metric, normalise_precision(precision), normalise_engine(engine))
        if key in seen:
            raise ValueError(f"{where} line {line}: {key} has a row already (line {seen[key]})")
        seen[key] = line
        levels.append(ExpectedLevel(metric, key[1], key[2], healthy, source))
    return tuple(levels)


def load_levels() -> tuple[ExpectedLevel, ...]:
    """The packaged levels (``expected_levels.csv`` beside this module)."""
    text = resources.files("mismatch_monitor").joinpath(DATA_FILE).read_text(encoding="utf-8")
    return parse_levels(text.splitlines(), DATA_FILE)


LEVELS: tuple[ExpectedLevel, ...] = load_levels()
_BY_KEY: dict[tuple[str, str, str], ExpectedLevel] = {(x.metric, x.precision, x.engine): x for x in LEVELS}


def expected_level(metric_key: str, precision: str | None, engine: str | None) -> ExpectedLevel | None:
    """The healthy level of ``metric_key`` for a pool of this precision and engine (None: no row,
    or the pool does not say its precision or engine)."""
    if precision is None or engine is None:
        return None
    p, e = normalise_precision(precision), normalise_engine(engine)
    found = _BY_KEY.get((metric_key, p, e))
    if found is None and "_" in p:               # a variant (fp8_e5m2) takes its family's own row (fp8)
        found = _BY_KEY.get((metric_key, p.split("_", 1)[0], e))
    if found is None and "_" not in p:           # a family (fp8) takes its one variant's row (fp8_e4m3)
        variants = [x for (m, q, f), x in _BY_KEY.items() if m == metric_key and f == e and q.split("_", 1)[0] == p]
        found = variants[0] if len(variants) == 1 else None
    return found


def expected_for_pool(metric_key: str, pool: Mapping[str, object] | None) -> ExpectedLevel | None:
    """:func:`expected_level` for a pool's ``run.json`` metadata (its ``precision`` and ``engine``)."""
    if not pool:
        return None
    precision, engine = pool.get("precision"), pool.get("engine")
    return expected_level(metric_key, precision if isinstance(precision, str) else None,
                          engine if isinstance(engine, str) else None)


def times_expected(value: float | None, level: ExpectedLevel | None) -> float | None:
    """``value`` as a multiple of the healthy level (None for no value, a non-finite one, or no level)."""
    if value is None or level is None:
        return None
    value = float(value)
    if not math.isfinite(value):
        return None
    return value / level.healthy
