"""The merge law, as properties: stats(A u B) == merge(stats(A), stats(B)).

Histograms, counts and extrema merge exactly; float sums to rounding (a different summation
order). Sequence-level tables need whole sequences, so splits are by sequence (ranks); token
tables are also checked under an arbitrary token split once the length bucket (which depends on
how many of a sequence's tokens a part holds) is merged away.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import MismatchStats, compute_stats, merge
from mismatch_monitor.engine.fields import TABLES, TOKEN_CELL_TABLES
from reference import Case, assert_tables_match, make_case

# every test runs with the compiled loops and with the torch ops (see conftest.py)
pytestmark = pytest.mark.usefixtures("each_kernel")

CONFIG = MetricConfig(chunk_tokens=1024)
# each example computes and merges several stats through pandas: fewer, richer examples
FEW = settings(max_examples=12)


def assert_stats_equal(a: MismatchStats, b: MismatchStats, tables=tuple(TABLES)) -> None:
    for name in tables:
        assert_tables_match(a[name], b[name], name, rtol=1e-12, atol=1e-12)


@st.composite
def cases(draw) -> Case:
    return make_case(
        draw(st.integers(0, 2**31 - 1)),
        num_sequences=draw(st.integers(2, 24)),
        max_len=draw(st.integers(2, 120)),
        dtype=draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16])),
        tail_fraction=draw(st.sampled_from([0.0, 1e-3, 0.05])),
        bad_fraction=draw(st.sampled_from([0.0, 0.02])),
        turns=draw(st.booleans()),
        routing=draw(st.sampled_from([None, (3, 2), (2, 9)])),
        id_dtype=draw(st.sampled_from([np.uint8, np.int64])),
        num_experts=24,
        support=draw(st.booleans()), kept=draw(st.booleans()), staleness=draw(st.booleans()),
        advantages=draw(st.booleans()), extra_dim=draw(st.booleans()),
        empty_sequences=draw(st.integers(0, 2)),
    )


@FEW
@given(case=cases(), ranks=st.integers(2, 4), data=st.data())
def test_split_by_sequences_across_ranks(case, ranks, data):
    owner = np.array(data.draw(st.lists(st.integers(0, ranks - 1), min_size=case.num_sequences,
                                        max_size=case.num_sequences)))
    parts = [compute_stats(case.select_sequences(np.nonzero(owner == r)[0]).batch(), CONFIG)
             for r in range(ranks)]
    whole = compute_stats(case.batch(), CONFIG)
    assert_stats_equal(merge(parts), whole)
    # order and grouping of the merge do not matter
    assert_stats_equal(merge([merge(parts[::-1][:1]), merge(parts[::-1][1:])]), whole)


@FEW
@given(case=cases(), split_seed=st.integers(0, 2**31 - 1), share=st.floats(0.0, 1.0))
def test_split_by_tokens_for_token_tables(case, split_seed, share):
    side = np.random.default_rng(split_seed).random(case.num_tokens) < share

    def part(keep: np.ndarray) -> MismatchStats:
        def sub(x):
            return None if x is None else x[keep]
        sub_case = replace(case, trainer=case.trainer[keep], sampler=case.sampler[keep], seq=case.seq[keep],
                           turn=sub(case.turn), trainer_experts=sub(case.trainer_experts),
                           sampler_experts=sub(case.sampler_experts), support=sub(case.support),
                           kept=sub(case.kept))
        return compute_stats(sub_case.batch("seq_ids"), CONFIG)

    whole = compute_stats(case.batch(), CONFIG)
    merged = merge([part(side), part(~side)])
    by = list(whole.dims) + ["turn_bucket"]
    assert_stats_equal(merged.marginal(by), whole.marginal(by), TOKEN_CELL_TABLES)


@FEW
@given(case=cases())
def test_merging_steps_adds_counts_and_keeps_extrema(case):
    s = compute_stats(case.batch(), CONFIG)
    twice = merge([s, s])
    for name, (_, fields) in TABLES.items():
        doubled = s[name].copy()
        for f in fields:
            if f.merge == "sum":
                doubled[f.name] = doubled[f.name] * 2
            elif f.merge == "logsumexp":                 # log(2 sum exp x) = log 2 + log sum exp x
                doubled[f.name] = doubled[f.name] + np.log(2.0)
        assert_tables_match(twice[name], doubled, name, rtol=0, atol=0)


@FEW
@given(case=cases())
def test_a_marginal_is_the_stats_of_the_coarser_labels(case):
    """Merging cells down to (pool, length, turn) equals computing with the pool label only."""
    full = compute_stats(case.batch(), CONFIG)
    pool_only = replace(case, labels={"pool": case.labels["pool"]})
    coarse = compute_stats(pool_only.batch(), CONFIG)
    for name in TABLES:
        keys = ["pool", "length_bucket"] + (["turn_bucket"] if name in TOKEN_CELL_TABLES else [])
        want = coarse.marginal(keys)[name]
        got = full.marginal(keys)[name]
        assert_tables_match(got, want, name, rtol=1e-12, atol=1e-12)


def test_merge_of_nothing_and_of_empty_stats_is_empty():
    assert merge([]).is_empty
    empty = MismatchStats.empty()
    s = compute_stats(make_case(5, num_sequences=6).batch(), CONFIG)
    assert merge([empty, empty]).is_empty
    assert_stats_equal(merge([empty, s]), merge([s]))
