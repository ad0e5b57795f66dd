"""Every column of every engine table against the independent float64 reference (tests/reference.py).

Inputs are heavy-tailed (most |lr| ~ 1e-3, a 0.1% tail with |lr| in [1, 5]), sliced by three
pools x two hardware x an extra label x length and turn buckets, in every float dtype, in the
three layouts, with and without invalid tokens, in one chunk and in many.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.engine.fields import TABLES
from reference import assert_tables_match, make_case, reference_tables

# every test runs with the compiled loops and with the torch ops (see conftest.py)
pytestmark = pytest.mark.usefixtures("each_kernel")

CONFIG = MetricConfig()


def check_all_tables(case, config=CONFIG, layout="offsets", **kwargs):
    got = compute_stats(case.batch(layout), config, **kwargs)
    want = reference_tables(case, config)
    for name in TABLES:
        assert_tables_match(got[name], want[name], name)
    return got


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_every_table_matches_reference_in_every_dtype(dtype):
    case = make_case(11, num_sequences=60, dtype=dtype, tail_fraction=5e-3, bad_fraction=0.003,
                     equal_fraction=0.05)
    got = check_all_tables(case)
    # the case is rich enough to exercise every table and several cells of each
    for name in TABLES:
        assert len(got[name]) > 3, name
    tokens = got["tokens"]
    assert tokens["pool"].nunique() == 3 and tokens["length_bucket"].nunique() >= 3
    assert tokens["turn_bucket"].nunique() >= 3
    assert (tokens["n_nonfinite"] > 0).any() and (tokens["n_positive_logprob"] > 0).any()
    assert (tokens["n_clip_high"] > 0).any() and (tokens["n_extreme"] > 0).any()
    assert 0 < tokens["n_lr_zero"].sum() < tokens["n_tokens"].sum()


def test_heavy_tail_dominates_but_does_not_break_sums():
    # a larger batch with the mixture: the tail carries almost all of sum |lr|^2
    case = make_case(12, num_sequences=300, max_len=600, routing=None)
    got = check_all_tables(case)
    t = got["tokens"]
    assert t["n_tokens"].sum() > 20_000 and t["max_abs_lr"].max() > 1.0
    # the tail holds ~0.1% of the tokens but most of sum lr^2
    small = case.num_tokens * 1e-6 * 4     # 4 sigma^2 per token bounds the bulk's share
    assert t["sum_lr2"].sum() > 10 * small


def test_without_optional_inputs_keys_are_null_and_counts_zero():
    case = make_case(13, turns=False, routing=None, support=False, kept=False, staleness=False,
                     advantages=False, extra_dim=False)
    got = check_all_tables(case)
    t = got["tokens"]
    assert t["turn_bucket"].isna().all() and t["precision"].isna().all()
    assert (t[["n_routed_tokens", "n_support_known", "n_kept_logmass"]] == 0).all().all()
    assert len(got["routing_layers"]) == 0 and len(got["staleness"]) == 0
    assert got["sequences"]["max_staleness"].isna().all()


def test_many_chunks_and_two_workers_match_reference():
    config = MetricConfig(chunk_tokens=1024)
    case = make_case(14, num_sequences=90, bad_fraction=0.01)
    assert case.num_tokens > 5 * 1024
    check_all_tables(case, config, layout="seq_ids")
    check_all_tables(case, config, layout="padded", workers=2)


def test_overflow_and_zero_bins_follow_the_config():
    # |lr| above hist_max goes to the overflow bin; below hist_min to the zero bin
    config = MetricConfig(hist_min=1e-3, hist_max=2.0)
    case = make_case(15, tail_fraction=0.05)
    got = check_all_tables(case, config)
    bins = got["abs_hist"]["bin"]
    assert (bins == 0).any() and (bins == bins.max()).any()


def test_nondefault_thresholds_match_reference():
    config = MetricConfig(tis_cap=1.5, icepop_band=(0.8, 1.25), extreme_band=(0.5, 2.0),
                          lowprob_edges=(0.05, 0.3), length_edges=(8, 64, 100),
                          turn_edges=(3, 5), seq_product_band=(0.9, 1.1),
                          seq_geometric_band=(0.999, 1.001), seq_mult_error_threshold=1.01,
                          neg_adv_delta=0.0, staleness_max=3)
    case = make_case(16, tail_fraction=0.01, base_scale=0.05)
    check_all_tables(case, config)


@pytest.mark.parametrize("eps", [0.05, 0.2, 0.5])
def test_ppo_clip_band_counts_match_reference(eps):
    # |lr| ~ 0.2: a good share of tokens on either side of the band's ends, which for eps = 0.5
    # coincide with the default IcePop band's lower end (0.5) and lie inside the TIS cap's regions
    config = MetricConfig(ppo_clip_eps=eps)
    case = make_case(17, base_scale=0.2, tail_fraction=0.0, bad_fraction=0.005)
    tokens = check_all_tables(case, config)["tokens"]
    outside, n = int(tokens["n_outside_ppo_clip"].sum()), int(tokens["n_tokens"].sum())
    assert 10 < outside < 0.9 * n


@pytest.mark.parametrize("eps", [0.0, 1.0, -0.1, float("nan"), "0.2"])
def test_ppo_clip_eps_is_validated_up_front(eps):
    with pytest.raises(ValueError, match=r"expected 0 < ppo_clip_eps < 1 .*got"):
        MetricConfig(ppo_clip_eps=eps)


def _assert_same_stats(a, b, *, exact: bool):
    for name in TABLES:
        assert_tables_match(a[name], b[name], name, rtol=0 if exact else 1e-12,
                            atol=0 if exact else 1e-12)


def test_layouts_give_the_same_statistics():
    case = make_case(17, num_sequences=50, bad_fraction=0.005)
    offsets = compute_stats(case.batch("offsets"))
    # padded keeps the token order: identical, bit for bit
    _assert_same_stats(compute_stats(case.batch("padded")), offsets, exact=True)
    # shuffled tokens with sequence ids: same integers and extrema, sums to rounding
    _assert_same_stats(compute_stats(case.batch("seq_ids", permutation_seed=3)), offsets, exact=False)


def test_only_nonempty_cells_are_stored():
    case = make_case(18, num_sequences=30, empty_sequences=4)
    got = compute_stats(case.batch("padded"))
    t = got["tokens"]
    n_any = t["n_tokens"] + t["n_nonfinite"] + t["n_positive_logprob"]
    assert (n_any > 0).all()
    assert (got["sequences"]["n_sequences"] > 0).all()
    for name in ("abs_hist", "lowprob", "seq_hist", "staleness"):
        assert (got[name]["count" if "count" in got[name] else "n_tokens"] > 0).all(), name
    # the empty sequences appear nowhere
    lengths = np.bincount(case.seq, minlength=case.num_sequences)
    assert int(got["sequences"]["n_sequences"].sum()) == int((lengths > 0).sum())


def test_token_cells_partition_the_tokens():
    case = make_case(19, bad_fraction=0.01)
    got = compute_stats(case.batch())
    t = got["tokens"]
    assert int((t["n_tokens"] + t["n_nonfinite"] + t["n_positive_logprob"]).sum()) == case.num_tokens
    keys = [c for c in t.columns if c in got["abs_hist"].columns and c != "count"]
    per_cell = t[t["n_tokens"] > 0].groupby(keys, dropna=False)["n_tokens"].sum()
    for name, col in (("abs_hist", "count"), ("lowprob", "n_tokens")):
        summed = got[name].groupby(keys, dropna=False)[col].sum()
        assert summed.index.equals(per_cell.index), name
        np.testing.assert_array_equal(summed.to_numpy(), per_cell.to_numpy(), err_msg=name)
