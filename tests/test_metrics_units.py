"""Each metric's unit and display format come from its one declaration."""

from __future__ import annotations

import math

import pytest

from mismatch_monitor.metrics import METRICS, format_of, unit_of


@pytest.mark.parametrize("key", [m.key for m in METRICS])
def test_every_metric_has_a_unit_and_a_format_that_formats_a_float(key):
    assert unit_of(key) in {"nats", "share", "ratio", "count", "steps", "log-ratio"}
    format(0.125, format_of(key))       # a spec that does not take a float raises here
    format(math.nan, format_of(key))


def test_shares_read_as_percent_and_counts_without_decimals():
    assert unit_of("mismatch/clip_high_fraction") == "share"
    assert format(0.0123, format_of("mismatch/clip_high_fraction")) == "1.230%"
    assert unit_of("mismatch/n_tokens") == "count"
    assert format(12345.0, format_of("mismatch/n_tokens")) == "12,345"
    assert unit_of("mismatch/k3_kl") == "nats"
    assert unit_of("mismatch/ess") == "ratio"


def test_unknown_key_raises():
    with pytest.raises(KeyError):
        unit_of("mismatch/no_such_metric")
    with pytest.raises(KeyError):
        format_of("mismatch/no_such_metric")
