"""The input contract and its bad-input policy (see the docstring of mismatch_monitor/batch.py):
structural errors raise BatchError with both sides in the message; bad values are set aside and
counted per slice, never allowed to poison a statistic; an empty batch is valid and reports null."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from mismatch_monitor import metrics
from mismatch_monitor.batch import BatchError, TokenBatch
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats

B, T = 3, 5


def padded(**overrides):
    g = torch.Generator().manual_seed(0)
    s = -torch.rand(B, T, generator=g, dtype=torch.float64) - 0.1
    kwargs = dict(trainer_logprobs=s + 1e-3 * torch.randn(B, T, generator=g, dtype=torch.float64),
                  sampler_logprobs=s, response_mask=torch.ones(B, T, dtype=torch.bool),
                  labels={"pool": ["a", "b", "a"]})
    kwargs.update(overrides)
    return kwargs


def flat(n=8, **overrides):
    s = -torch.linspace(0.1, 2.0, n, dtype=torch.float64)
    kwargs = dict(trainer_logprobs=s + 1e-3, sampler_logprobs=s, seq_offsets=[0, 3, n])
    kwargs.update(overrides)
    return kwargs


# ----------------------------------------------------------------------------- structural errors

@pytest.mark.parametrize("name, bad", [
    ("sampler_logprobs", torch.zeros(B, T - 1)),
    ("response_mask", torch.ones(B + 1, T, dtype=torch.bool)),
    ("turn_index", torch.zeros(B, T + 2, dtype=torch.int64)),
    ("in_trainer_support", torch.ones(B, 1, dtype=torch.bool)),
    ("sampler_kept_logmass", torch.zeros(T, B)),
    ("trainer_experts", torch.zeros(B, T, 2, dtype=torch.uint8)),
])
def test_padded_shape_mismatch_shows_both_shapes(name, bad):
    kwargs = padded(**{name: bad})
    if name == "trainer_experts":
        kwargs["sampler_experts"] = bad
    with pytest.raises(BatchError) as err:
        TokenBatch.from_padded(**kwargs)
    assert str((B, T)) in str(err.value) and str(tuple(bad.shape)) in str(err.value)


def test_flat_shape_mismatches_show_both_shapes():
    with pytest.raises(BatchError, match=r"\(8,\).*\(7,\)"):
        TokenBatch.from_flat(**flat(sampler_logprobs=torch.zeros(7, dtype=torch.float64)))
    with pytest.raises(BatchError, match=r"\(8,\).*\(9,\)"):
        TokenBatch.from_flat(**flat(seq_offsets=None, seq_ids=torch.zeros(9, dtype=torch.int64)))
    with pytest.raises(BatchError, match=r"\(8,\).*\(8, 2\)"):
        TokenBatch.from_flat(**flat(turn_index=torch.zeros(8, 2, dtype=torch.int64)))
    with pytest.raises(BatchError, match=r"trainer_experts \(8, 4, 2\) vs sampler_experts \(8, 4, 3\)"):
        TokenBatch.from_flat(**flat(trainer_experts=torch.zeros(8, 4, 2, dtype=torch.uint8),
                                    sampler_experts=torch.zeros(8, 4, 3, dtype=torch.uint8)))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_integer_or_bool_logprobs_are_rejected(dtype):
    with pytest.raises(BatchError, match=f"floating dtype.*{dtype}"):
        TokenBatch.from_padded(**padded(trainer_logprobs=torch.zeros(B, T, dtype=dtype)))
    with pytest.raises(BatchError, match="floating dtype"):
        TokenBatch.from_flat(**flat(sampler_logprobs=torch.zeros(8, dtype=dtype)))


def test_other_wrong_dtypes_are_rejected():
    with pytest.raises(BatchError, match="integer dtype"):
        TokenBatch.from_flat(**flat(turn_index=torch.zeros(8)))
    with pytest.raises(BatchError, match="integer dtype"):
        TokenBatch.from_flat(**flat(trainer_experts=torch.zeros(8, 2, 2), sampler_experts=torch.zeros(8, 2, 2)))
    with pytest.raises(BatchError, match="in_trainer_support to be bool"):
        TokenBatch.from_flat(**flat(in_trainer_support=torch.ones(8)))
    with pytest.raises(BatchError, match="integer dtype"):
        TokenBatch.from_flat(**flat(seq_offsets=torch.tensor([0.0, 3.0, 8.0])))
    # an integer support mask is read as nonzero = inside
    b = TokenBatch.from_flat(**flat(in_trainer_support=torch.tensor([1, 0, 2, 1, 1, 1, 0, 1])))
    assert b.in_trainer_support.dtype == torch.bool and int((~b.in_trainer_support).sum()) == 2


def test_label_lists_must_have_one_entry_per_sequence():
    with pytest.raises(BatchError, match=r"labels\['pool'\].*one entry per sequence \(3\), got 2"):
        TokenBatch.from_padded(**padded(labels={"pool": ["a", "b"]}))
    with pytest.raises(BatchError, match="got one string"):
        TokenBatch.from_padded(**padded(labels={"pool": "abc"}))
    with pytest.raises(BatchError, match="reserved"):
        TokenBatch.from_padded(**padded(labels={"length_bucket": ["a", "b", "c"]}))
    with pytest.raises(BatchError, match="identifiers"):
        TokenBatch.from_padded(**padded(labels={"bad name": ["a", "b", "c"]}))


def test_tensors_on_different_devices_are_rejected_before_any_read():
    # 'meta' tensors have no data: the check must come before anything reads a value
    meta = torch.empty(B, T, dtype=torch.float64, device="meta")
    with pytest.raises(BatchError, match="one device.*meta"):
        TokenBatch.from_padded(**padded(sampler_logprobs=meta))
    with pytest.raises(BatchError, match="one device.*meta"):
        TokenBatch.from_flat(**flat(seq_offsets=None, seq_ids=torch.zeros(8, dtype=torch.int64, device="meta")))
    with pytest.raises(BatchError, match="one device.*meta"):
        TokenBatch.from_flat(**flat(turn_index=torch.zeros(8, dtype=torch.int64, device="meta")))


def test_sequence_structure_errors():
    with pytest.raises(BatchError, match="start at 0 and end at N=8"):
        TokenBatch.from_flat(**flat(seq_offsets=[0, 3, 7]))
    with pytest.raises(BatchError, match="non-decreasing"):
        TokenBatch.from_flat(**flat(seq_offsets=[0, 5, 3, 8]))
    with pytest.raises(BatchError, match="exactly one of"):
        TokenBatch.from_flat(**flat(seq_ids=torch.zeros(8, dtype=torch.int64)))
    with pytest.raises(BatchError, match="seq_ids >= 0"):
        TokenBatch.from_flat(**flat(seq_offsets=None, seq_ids=torch.full((8,), -1)))
    with pytest.raises(BatchError, match="num_sequences=1"):
        TokenBatch.from_flat(**flat(seq_offsets=None, seq_ids=torch.arange(8) % 2, num_sequences=1))
    with pytest.raises(BatchError, match="without trainer_version"):
        TokenBatch.from_padded(**padded(policy_version=[1, 2, 3]))
    with pytest.raises(BatchError, match="cannot be ahead"):
        TokenBatch.from_padded(**padded(policy_version=[1, 5, 3], trainer_version=4))
    with pytest.raises(BatchError, match="one per sequence"):
        TokenBatch.from_padded(**padded(advantages=[1.0, 2.0]))
    with pytest.raises(BatchError, match="both trainer_experts and sampler_experts"):
        TokenBatch.from_padded(**padded(trainer_experts=torch.zeros(B, T, 2, 2, dtype=torch.uint8)))


# ----------------------------------------------------------------------------- layouts

def test_padded_layout_keeps_only_masked_tokens_in_order():
    kw = padded()
    mask = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.int64)
    b = TokenBatch.from_padded(**{**kw, "response_mask": mask})
    assert b.num_tokens == 5 and b.num_sequences == 3
    assert b.seq_index.tolist() == [0, 0, 1, 1, 1]
    assert b.position.tolist() == [0, 1, 0, 1, 2]
    torch.testing.assert_close(b.trainer_logprobs, kw["trainer_logprobs"][mask.bool()])


def test_flat_offsets_positions_of_a_few_tokens_match_every_position():
    b = TokenBatch.from_flat(**flat(n=7, seq_offsets=[0, 3, 3, 7]))
    assert b.position.tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert b.positions_of(torch.tensor([6, 0, 4])).tolist() == [3, 0, 1]


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_contiguous_sequences_build_no_per_token_ids_unless_asked(kernel):
    # the compiled pass reads the offsets, so the [N] ids are not built for it; the torch
    # pass and a few tokens' lookups still get the right sequences
    mask = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    s = -torch.rand(4, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64) - 0.1
    b = TokenBatch.from_padded(s + 1e-3, s, mask, labels={"pool": ["a", "b", "a", "c"]})
    assert b.seq_ids is None
    stats = compute_stats(b, MetricConfig(kernel=kernel))
    assert (b.seq_ids is None) == (kernel == "native")
    assert int(stats.tables["tokens"]["n_tokens"].sum()) == 6
    assert b.sequences_of(torch.tensor([5, 0, 2, 4])).tolist() == [3, 0, 1, 1]
    assert b.seq_ids is None or kernel == "torch"
    assert b.seq_index.tolist() == [0, 0, 1, 1, 1, 3]
    assert b.positions_of(torch.tensor([5, 4])).tolist() == [0, 2]


def test_flat_seq_ids_in_any_order_get_positions_by_appearance():
    ids = torch.tensor([1, 0, 1, 2, 0, 1])
    b = TokenBatch.from_flat(**flat(n=6, seq_offsets=None, seq_ids=ids, num_sequences=4))
    assert b.num_sequences == 4
    assert b.position.tolist() == [0, 0, 1, 0, 1, 2]


# ----------------------------------------------------------------------------- bad values

def _stats_and_report(batch, by=("pool",)):
    stats = compute_stats(batch, MetricConfig())
    return stats, metrics.report(stats, by=list(by)).set_index(list(by))


def test_nonfinite_logprobs_are_counted_and_set_aside():
    g = torch.Generator().manual_seed(1)
    s = -torch.rand(4, 50, generator=g, dtype=torch.float64) - 0.05
    t = s + 1e-3 * torch.randn(4, 50, generator=g, dtype=torch.float64)
    labels = {"pool": ["a", "a", "b", "b"]}
    clean = TokenBatch.from_padded(t, s, torch.ones(4, 50, dtype=torch.bool), labels=labels)
    t_bad, s_bad = t.clone(), s.clone()
    t_bad[0, 3], s_bad[0, 7], t_bad[1, 9], s_bad[1, 10] = float("nan"), float("-inf"), float("inf"), float("nan")
    both = s_bad.clone()
    both[0, 12], t_bad[0, 12] = float("-inf"), float("-inf")        # -inf - -inf is NaN
    bad = TokenBatch.from_padded(t_bad, both, torch.ones(4, 50, dtype=torch.bool), labels=labels)
    _, r_clean = _stats_and_report(clean)
    stats, r_bad = _stats_and_report(bad)
    assert r_bad.loc["a", "mismatch/data_quality/nonfinite_tokens"] == 5
    assert r_bad.loc["b", "mismatch/data_quality/nonfinite_tokens"] == 0
    assert r_bad.loc["a", "mismatch/n_tokens"] == r_clean.loc["a", "mismatch/n_tokens"] - 5
    # every statistic of pool a that the clean batch has stays finite (the rest are null in both:
    # e.g. no token of p < 0.1 for the sharpness contrast); pool b is bit-for-bit the clean one
    finite_keys = [m.key for m in metrics.METRICS if not m.key.startswith("mismatch/kept")
                   and "support" not in m.key and "routing" not in m.key and "staleness" not in m.key
                   and "neg_adv" not in m.key]
    clean_a = np.isfinite(r_clean.loc["a", finite_keys].to_numpy(np.float64))
    assert clean_a.sum() > len(finite_keys) - 5
    np.testing.assert_array_equal(np.isfinite(r_bad.loc["a", finite_keys].to_numpy(np.float64)), clean_a)
    np.testing.assert_array_equal(r_bad.loc["b", finite_keys].to_numpy(np.float64),
                                  r_clean.loc["b", finite_keys].to_numpy(np.float64))


def test_positive_logprobs_are_counted_and_set_aside():
    s = torch.full((1, 6), -0.5, dtype=torch.float64)
    t = s + 1e-3
    t[0, 1] = 0.2                     # probability > 1: invalid
    s[0, 4] = 5e-4                    # within the tolerance (1e-3): valid
    stats, report = _stats_and_report(TokenBatch.from_padded(t, s, torch.ones(1, 6, dtype=torch.bool),
                                                             labels={"pool": ["a"]}))
    assert report.loc["a", "mismatch/data_quality/positive_logprob_tokens"] == 1
    assert report.loc["a", "mismatch/n_tokens"] == 5
    assert report.loc["a", "mismatch/log_ratio/max"] < 0.6


def test_empty_mask_gives_empty_stats_and_null_metrics():
    kw = padded(response_mask=torch.zeros(B, T, dtype=torch.bool))
    b = TokenBatch.from_padded(**kw)
    assert b.num_tokens == 0 and b.num_sequences == B
    stats = compute_stats(b)
    assert stats.is_empty and all(len(df) == 0 for df in stats.tables.values())
    report = metrics.report(stats, by=["pool"])
    values = report[[m.key for m in metrics.METRICS]].to_numpy(np.float64)
    assert values.size == 0 or np.isnan(values).all()


def test_all_cells_empty_of_valid_tokens():
    t = torch.full((2, 4), float("nan"), dtype=torch.float64)
    s = torch.full((2, 4), -1.0, dtype=torch.float64)
    stats = compute_stats(TokenBatch.from_padded(t, s, torch.ones(2, 4, dtype=torch.bool),
                                                 labels={"pool": ["a", "b"]}))
    assert stats.is_empty
    assert stats["tokens"]["n_nonfinite"].sum() == 8 and (stats["tokens"]["n_tokens"] == 0).all()
    assert len(stats["sequences"]) == 0 and len(stats["abs_hist"]) == 0
    report = metrics.report(stats, by=["pool"]).set_index("pool")
    assert report["mismatch/k3_kl"].isna().all() and report["mismatch/ess"].isna().all()
    assert (report["mismatch/data_quality/nonfinite_tokens"] == 4).all()


# ----------------------------------------------------------------------------- padded == flat

def _flat_from_rows(values, mask):
    """The masked slots of each row in order, concatenated, with each row's start: written as a
    loop over rows, not as the mask select ``from_padded`` does."""
    rows = [values[b][mask[b]] for b in range(mask.shape[0])]
    lengths = [int(m.sum()) for m in mask]
    return torch.cat(rows), [0, *np.cumsum(lengths).tolist()]


@pytest.mark.parametrize("layout", ["scattered", "runs", "runs_but_one"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_padded_and_flat_layouts_give_identical_tokens_and_statistics(dtype, layout):
    g = torch.Generator().manual_seed(7)
    Bp, Tp = 6, 40
    if layout == "scattered":
        mask = torch.rand(Bp, Tp, generator=g) < 0.5    # non-contiguous rows
    else:                                               # each row one run of slots (copied run by run)
        mask = torch.zeros(Bp, Tp, dtype=torch.bool)
        mask[0, :7] = True                              # from the first slot
        mask[3, 31:] = True                             # to the last slot
        mask[5, 12:13] = True                           # a single token
        if layout == "runs_but_one":
            mask[5, 20] = True                          # one row of two runs: every row is masked
    mask[1] = False                                     # an empty row
    mask[2] = True                                      # a row with every slot a token
    mask[4, :] = False
    mask[4, 5:17] = True                                # one contiguous response
    s = -torch.rand(Bp, Tp, generator=g, dtype=torch.float64) * 4 - 0.01
    t = s + 0.05 * torch.randn(Bp, Tp, generator=g, dtype=torch.float64)
    trainer, sampler = t.to(dtype), s.to(dtype)
    turn = torch.arange(Tp).expand(Bp, Tp) // 9
    support = torch.rand(Bp, Tp, generator=g) < 0.9
    experts_t = torch.randint(0, 8, (Bp, Tp, 2, 3), generator=g)
    experts_s = torch.randint(0, 8, (Bp, Tp, 2, 3), generator=g)
    tokens = torch.randint(0, 1000, (Bp, Tp), generator=g)
    labels = {"pool": ["a", "b", "a", "c", "b", "a"]}
    common = dict(labels=labels, policy_version=[3, 2, 3, 1, 3, 3], trainer_version=3,
                  advantages=torch.linspace(-1, 1, Bp))
    per_token = dict(turn_index=turn, in_trainer_support=support, trainer_experts=experts_t,
                     sampler_experts=experts_s, token_ids=tokens)
    # an integer mask takes the same path as a bool one; any non-zero value is a token
    int_mask = mask.to(torch.int32) * torch.where(torch.arange(Tp) % 3 == 0, -3, 2)
    p = TokenBatch.from_padded(trainer, sampler, int_mask, **common, **per_token)
    flat_t, offsets = _flat_from_rows(trainer, mask)
    f = TokenBatch.from_flat(flat_t, _flat_from_rows(sampler, mask)[0], seq_offsets=offsets, **common,
                             **{k: _flat_from_rows(v, mask)[0] for k, v in per_token.items()})
    assert p.seq_offsets.tolist() == offsets and p.seq_index.dtype == torch.int64
    for name in ("trainer_logprobs", "sampler_logprobs", "seq_index", "turn_index", "in_trainer_support",
                 "trainer_experts", "sampler_experts", "token_ids"):
        a, b = getattr(p, name), getattr(f, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert torch.equal(p.position, f.position)
    sp, sf = compute_stats(p, MetricConfig()), compute_stats(f, MetricConfig())
    assert sp.tables.keys() == sf.tables.keys()
    for table in sp.tables:
        pd.testing.assert_frame_equal(sp[table], sf[table], check_exact=True)


def test_odd_label_values_become_cells_by_their_text_and_nulls_one_cell():
    # None and NaN are one null cell; "" and non-ASCII text are values; numbers are their text
    t = torch.tensor([-1.0, -2.0, -0.5, -0.1, -3.0, -1.0, -0.2, -0.3])
    b = TokenBatch.from_flat(t + 0.01, t, seq_offsets=[0, 2, 4, 6, 7, 8],
                             labels={"pool": ["é", None, "", float("nan"), 7]})
    tokens = compute_stats(b, MetricConfig()).tables["tokens"]
    per_pool = tokens.groupby("pool", dropna=False)["n_tokens"].sum()
    assert {k: v for k, v in per_pool.items() if not pd.isna(k)} == {"": 2, "7": 1, "é": 2}
    assert per_pool.index.isna().sum() == 1 and int(per_pool[per_pool.index.isna()].iloc[0]) == 3
    assert str(tokens["pool"].dtype) == "string"
