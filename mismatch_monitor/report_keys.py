"""Names of slices: label values as text, and the flat report keys built from them.

Every label value (a string, or None where a batch gave no label) becomes a *label text*, one
definition used by the flat report (``wandb.log`` keys) and by the Prometheus exporter's label
values, so two different slices can never share a key or a series:

* ``None`` is ``%null``; the empty string is ``%empty``; the merged remainder beyond the label
  limit (``label_limits.py``) is ``%other``. A ``%`` followed by a lowercase letter is only ever
  one of these markers.
* any other string is itself, except that ``%``, ``/`` and characters that are not printable
  (controls, line breaks, lone surrogates) are written as ``%XX`` per UTF-8 byte, in uppercase
  hex: ``fp8`` stays ``fp8``, ``a/b`` is ``a%2Fb``, ``50%`` is ``50%25``, ``Grüße`` stays as is.

So the text is never empty (Prometheus reads ``pool=""`` as "no label", i.e. the fleet series)
and never contains ``/``, and :func:`parse_label_text` inverts it. Report keys:
``mismatch/k3_kl`` for the whole step, ``mismatch/pool=<label text>/k3_kl`` per pool; no metric
key starts with ``mismatch/pool``, so the two forms never meet (:func:`parse_report_key`).
"""

from __future__ import annotations

import math
import re
import warnings
from typing import TYPE_CHECKING

import numpy as np

from .config import MetricConfig
from .metrics import METRICS, GroupMetrics, report_by_label

if TYPE_CHECKING:
    from .engine import MismatchStats
    from .label_limits import LabelLimit

NULL_TEXT = "%null"     # a label that was not given
EMPTY_TEXT = "%empty"   # the empty string
OTHER_TEXT = "%other"   # every label value beyond the limit, merged
PREFIX = "mismatch/"
MERGED_KEY = "mismatch/pools_merged"   # how many pool values went into %other at this step
_MARKERS = {NULL_TEXT: None, EMPTY_TEXT: ""}
_ESCAPE = re.compile(r"%([0-9A-F]{2})")
if any(m.key.startswith(PREFIX + "pool") for m in METRICS) or MERGED_KEY in {m.key for m in METRICS}:
    raise AssertionError("a metric key starting with mismatch/pool would make report keys ambiguous")


class CardinalityWarning(UserWarning):
    """More label values in a step than the configured limit: the rest are merged into ``%other``."""


def _escape(ch: str) -> str:
    if ch != "%" and ch != "/" and ch.isprintable():
        return ch
    return "".join(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))


def label_text(value: str | None) -> str:
    """The label text of one label value (see the module docstring): injective, never empty."""
    if value is None:
        return NULL_TEXT
    if value == "":
        return EMPTY_TEXT
    value = str(value)
    if value.isprintable() and "%" not in value and "/" not in value:   # the common case, in C
        return value
    return "".join(_escape(ch) for ch in value)


def parse_label_text(text: str) -> str | None:
    """The label value a label text was made from; ValueError for ``%other`` or malformed text."""
    if text in _MARKERS:
        return _MARKERS[text]
    if text == OTHER_TEXT:
        raise ValueError("%other is the merged remainder of several label values, not one value")
    if "/" in text or re.search(r"%(?![0-9A-F]{2})", text):
        raise ValueError(f"not a label text: {text!r}")
    raw = bytearray()
    pos = 0
    for m in _ESCAPE.finditer(text):
        raw += text[pos:m.start()].encode("utf-8", "surrogatepass") + bytes([int(m.group(1), 16)])
        pos = m.end()
    raw += text[pos:].encode("utf-8", "surrogatepass")
    value = raw.decode("utf-8", "surrogatepass")
    if label_text(value) != text:   # e.g. an escape of a character that is written as itself
        raise ValueError(f"not a label text: {text!r}")
    return value


def report_key(metric_key: str, pool_text: str | None = None) -> str:
    """``mismatch/k3_kl`` (``pool_text`` None: the whole step) or ``mismatch/pool=fp8/k3_kl``."""
    if pool_text is None:
        return metric_key
    return f"{PREFIX}pool={pool_text}/{metric_key[len(PREFIX):]}"


def parse_report_key(key: str) -> tuple[str | None, str]:
    """(pool label text or None for the whole step, metric key) of a flat report key."""
    if not key.startswith(PREFIX):
        raise ValueError(f"not a report key: {key!r}")
    rest = key[len(PREFIX):]
    if not rest.startswith("pool="):
        return None, key
    text, sep, metric = rest[len("pool="):].partition("/")
    if not sep:
        raise ValueError(f"not a report key: {key!r}")
    return text, PREFIX + metric


def _rows(out: dict[str, float], metrics: GroupMetrics, texts: list[str | None], keep: np.ndarray) -> None:
    keys = list(metrics.values)
    table = np.column_stack([metrics.values[k] for k in keys])[keep].tolist()   # [groups, metrics]
    for text, row in zip((texts[i] for i in np.flatnonzero(keep)), table):
        out.update((report_key(k, text), v) for k, v in zip(keys, row) if not math.isnan(v))


def flatten_report(fleet: GroupMetrics, by_pool: GroupMetrics, stats: MismatchStats | None = None, *,
                   config: MetricConfig | None = None, limit: LabelLimit | None = None) -> dict[str, float]:
    """The flat report of one step: ``mismatch/k3_kl`` for the whole step and
    ``mismatch/pool=<label text>/k3_kl`` per pool; nulls omitted.

    Beyond ``limit.max_values`` pools, the pools with the most tokens keep their keys and the
    rest are merged exactly (from ``stats``, by each field's merge rule) into ``pool=%other``;
    ``mismatch/pools_merged`` says how many, and a :class:`CardinalityWarning` is issued.
    ``config`` is the one the statistics were computed with (the histogram's accuracy).
    """
    from .label_limits import LabelLimit, rest_of, top_values   # it imports this module

    limit = limit or LabelLimit()
    out: dict[str, float] = {}
    if len(fleet):
        _rows(out, fleet, [None], np.ones(1, dtype=bool))
    if not len(by_pool):
        return out
    texts: list[str | None] = [label_text(p) for p in by_pool.labels]
    keep = np.ones(len(texts), dtype=bool)
    if len(texts) > limit.max_values:
        kept = top_values(texts, by_pool.values["mismatch/n_tokens"], limit.max_values)
        keep = np.array([t in kept for t in texts])
        out[MERGED_KEY] = float((~keep).sum())
        if stats is None:
            warnings.warn("more pools in a step than LabelLimit.max_values and no statistics to merge "
                          "the rest: the pools with the fewest tokens are left out of the report",
                          CardinalityWarning, stacklevel=2)
        else:
            warnings.warn("more pools in a step than LabelLimit.max_values: the pools with the fewest "
                          "tokens are merged into pool=%other in the report (the store keeps each)",
                          CardinalityWarning, stacklevel=2)
            other, _ = report_by_label(rest_of(stats, "pool", kept), "pool", config)
            _rows(out, other, [OTHER_TEXT] * len(other), np.ones(len(other), dtype=bool))
    _rows(out, by_pool, texts, keep)
    return out

