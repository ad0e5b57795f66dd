"""Tail exemplars against a brute-force float64 reference, in every layout, merged across parts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats_with_sequences
from mismatch_monitor.exemplars import merge_exemplars, tail_exemplars

from synthetic import make_batch


def _reference(batch: TokenBatch, k: int) -> tuple[list[float], list[float]]:
    t = batch.trainer_logprobs.double().numpy()
    s = batch.sampler_logprobs.double().numpy()
    lr = t - s
    ok = np.isfinite(lr) & (t <= 1e-3) & (s <= 1e-3)
    seq = batch.seq_index.numpy()
    worst_tokens = sorted(np.abs(lr[ok]).tolist(), reverse=True)[:k]
    per_seq = {}
    for i in np.nonzero(ok)[0]:                       # a plain loop: the reference, not the engine
        per_seq[seq[i]] = max(per_seq.get(seq[i], 0.0), abs(lr[i]))
    worst_seqs = sorted(per_seq.values(), reverse=True)[:k]
    return worst_tokens, worst_seqs


def _flat_shuffled(b: TokenBatch, seed: int = 0) -> TokenBatch:
    perm = torch.randperm(b.num_tokens, generator=torch.Generator().manual_seed(seed))
    return TokenBatch.from_flat(b.trainer_logprobs[perm], b.sampler_logprobs[perm], seq_ids=b.seq_index[perm],
                                num_sequences=b.num_sequences, labels=b.labels,
                                advantages=b.advantages, token_ids=b.token_ids[perm])


@pytest.mark.parametrize("k", [1, 5, 40])
def test_worst_tokens_and_sequences_match_reference(k):
    batch = make_batch(2, sequences=30, max_len=50)
    t = batch.trainer_logprobs.clone()
    t[3] = float("nan")                                  # set aside, never an exemplar
    batch = TokenBatch.from_flat(t, batch.sampler_logprobs, seq_offsets=batch.seq_offsets,
                                 labels=batch.labels, token_ids=batch.token_ids)
    want_tokens, want_seqs = _reference(batch, k)
    _, per_seq = compute_stats_with_sequences(batch)
    for ex, in_order in ((tail_exemplars(batch, k), True),
                         (tail_exemplars(batch, k, MetricConfig(), per_seq), True),
                         (tail_exemplars(_flat_shuffled(batch), k), False)):
        np.testing.assert_array_equal(ex["exemplar_tokens"]["abs_log_ratio"].to_numpy(), want_tokens)
        np.testing.assert_array_equal(ex["exemplar_sequences"]["seq_max_abs_log_ratio"].to_numpy(), want_seqs)
        if not in_order:   # shuffled tokens: positions count in order of appearance
            continue
        tok = ex["exemplar_tokens"]
        t64 = batch.trainer_logprobs.double().numpy()
        # each exemplar's identity is right: its seq_index and position find the same token
        for seq, pos, lp in zip(tok["seq_index"], tok["position"], tok["trainer_logprob"]):
            start = int(batch.seq_offsets[seq])
            assert t64[start + pos] == lp


def test_sequence_exemplars_carry_sums_and_labels():
    batch = make_batch(4)
    ex = tail_exemplars(batch, 3)["exemplar_sequences"]
    lr = (batch.trainer_logprobs.double() - batch.sampler_logprobs.double()).numpy()
    for _, row in ex.iterrows():
        mine = lr[batch.seq_index.numpy() == row["seq_index"]]
        assert row["seq_log_ratio"] == pytest.approx(mine.sum(), rel=1e-12)
        assert row["length"] == len(mine) and row["pool"] == batch.labels["pool"][row["seq_index"]]
        assert row["advantage"] == pytest.approx(float(batch.advantages[row["seq_index"]]))


def test_merge_keeps_the_global_top_k():
    a, b = make_batch(1), make_batch(2, scale=0.05)
    merged = merge_exemplars([tail_exemplars(a, 6), tail_exemplars(b, 6)], 6)
    both = sorted(_reference(a, 6)[0] + _reference(b, 6)[0], reverse=True)[:6]
    np.testing.assert_array_equal(merged["exemplar_tokens"]["abs_log_ratio"].to_numpy(), both)


def test_empty_and_zero_k():
    batch = make_batch(0)
    assert all(len(df) == 0 for df in tail_exemplars(batch, 0).values())
    empty = TokenBatch.from_padded(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    assert all(len(df) == 0 for df in tail_exemplars(empty, 5).values())
