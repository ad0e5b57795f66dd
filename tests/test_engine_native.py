"""The compiled per-token loops (engine/_native.c) against the torch ops and the definitions.

Every engine test already runs with both kernels against the float64 reference (the
``each_kernel`` fixture); these tests pin down what only the compiled loops do: histogram bins
read off the upper edges, the Taylor series for small lr, the choice of kernel, and the routing
loop for every id width and top-k.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats, native
from mismatch_monitor.engine.histogram import LogBins
from mismatch_monitor.engine.ranges import sequence_ranges, split_by_cell
from mismatch_monitor.engine.routing import routing_counts, sorting_network
from mismatch_monitor.engine.regions import JointCoder
from mismatch_monitor.engine.token_pass import TokenAccumulators
from reference import assert_tables_match, make_case, routing_flips as reference_flips

NATIVE, TORCH = MetricConfig(kernel="native"), MetricConfig(kernel="torch")


@pytest.fixture(autouse=True)
def _built():
    assert native.available(), "the compiled extension mismatch_monitor.engine._native was not built"


def exact_batch(lr: np.ndarray) -> TokenBatch:
    """One sequence of float64 tokens whose t - s is exactly ``lr``: one side's log-prob is 0,
    the other's -|lr|."""
    t = np.where(lr > 0, 0.0, lr)
    s = np.where(lr > 0, -lr, 0.0)
    assert np.array_equal(t - s, lr)
    return TokenBatch.from_flat(torch.from_numpy(t), torch.from_numpy(s), seq_offsets=[0, len(lr)],
                                labels={"pool": ["a"]})


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_both_kernels_agree_on_a_rich_batch(dtype):
    # invalid tokens, turns, support information, kept log-mass and expert ids, in many chunks
    case = make_case(5, num_sequences=80, dtype=dtype, tail_fraction=5e-3, bad_fraction=0.01)
    batch = case.batch("offsets")
    for config in (MetricConfig(), MetricConfig(chunk_tokens=1024)):
        got = compute_stats(batch, replace(config, kernel="native"), workers=2)
        want = compute_stats(batch, replace(config, kernel="torch"))
        for name in ("tokens", "abs_hist", "lowprob", "routing_layers", "sequences", "seq_hist", "staleness"):
            assert_tables_match(got[name], want[name], name, rtol=1e-12, atol=1e-13)


def test_histogram_bins_are_read_off_the_upper_edges():
    # |lr| exactly on an upper edge belongs to that bin; one ulp above, to the next
    bins = LogBins.from_config(NATIVE)
    upper = bins.upper_edges()
    rng = np.random.default_rng(0)
    picks = upper[rng.choice(np.arange(1, bins.num_bins - 2), 300, replace=False)]
    values = np.concatenate([picks, np.nextafter(picks, np.inf), np.nextafter(picks, 0),
                             [0.0, upper[0], np.nextafter(upper[0], np.inf), upper[-2],
                              np.nextafter(upper[-2], np.inf), 900.0]])
    lr = np.where(np.arange(len(values)) % 2 == 0, values, -values)   # both signs
    got = compute_stats(exact_batch(lr), NATIVE)["abs_hist"]
    want = np.bincount(np.searchsorted(upper, values, side="left"), minlength=bins.num_bins)
    counts = np.zeros(bins.num_bins, dtype=np.int64)
    counts[got["bin"].to_numpy()] = got["count"].to_numpy()
    np.testing.assert_array_equal(counts, want)
    # and the torch ops, which compute ceil(log_gamma |lr|), agree away from the edges
    middle = picks * math.sqrt(bins.gamma)
    np.testing.assert_array_equal(np.searchsorted(upper, middle), bins.index(torch.from_numpy(middle)).numpy())


def test_taylor_series_for_small_lr_is_as_exact_as_float64_allows():
    # k3 = rho - 1 - lr and exp|lr| for |lr| below the series' range, against math.expm1 on
    # each token (exact to an ulp); sums must agree to a few ulp of the largest term
    lr = np.concatenate([np.geomspace(1e-12, native.POLY_MAX * 0.999, 400),
                         -np.geomspace(1e-12, native.POLY_MAX * 0.999, 400), [native.POLY_MAX, 0.5, -2.0]])
    tokens = compute_stats(exact_batch(lr), NATIVE)["tokens"]
    k3 = sum(math.expm1(x) - x for x in lr)
    k3_terms = [abs(math.expm1(x) - x) for x in lr]
    assert abs(tokens["sum_k3"].sum() - k3) <= 1e-15 * sum(k3_terms) + 1e-300
    e_abs = sum(math.exp(abs(x)) for x in lr)
    assert abs(tokens["sum_exp_abs_lr"].sum() - e_abs) <= 1e-15 * e_abs
    rho2 = sum(math.exp(2 * x) for x in lr)
    assert abs(tokens["sum_rho2"].sum() - rho2) <= 1e-14 * rho2


def test_one_token_per_chunk_boundary_and_empty_ranges():
    # a block of the compiled loop is 256 tokens: lengths around it, and a chunk of exactly it
    for n in (1, 255, 256, 257, 1025):
        case = make_case(n, num_sequences=1, max_len=n + 1, dtype=torch.float32)
        batch = case.batch("offsets")
        got = compute_stats(batch, replace(NATIVE, chunk_tokens=1024))
        want = compute_stats(batch, TORCH)
        for name in ("tokens", "abs_hist", "lowprob", "sequences"):
            assert_tables_match(got[name], want[name], name, rtol=1e-12, atol=1e-13)


def test_kernel_is_validated_and_native_fails_clearly_when_not_built(monkeypatch):
    with pytest.raises(ValueError, match="kernel"):
        MetricConfig(kernel="fast")
    batch = make_case(1, num_sequences=3).batch("offsets")
    monkeypatch.setattr(native, "library", lambda: None)
    with pytest.raises(RuntimeError, match="not built"):
        compute_stats(batch, NATIVE)
    # auto falls back to the torch ops, and so do the statistics
    assert_tables_match(compute_stats(batch, MetricConfig())["tokens"], compute_stats(batch, TORCH)["tokens"],
                        "tokens")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
@pytest.mark.parametrize("k", [1, 3, 8, 9])
def test_routing_loop_matches_the_reference_for_every_width_and_top_k(dtype, k):
    rng = np.random.default_rng(k)
    n, L, experts = 400, 5, 12
    te = np.stack([np.stack([rng.permutation(experts)[:k] for _ in range(L)]) for _ in range(n)])
    se = te.copy()
    for tok in range(0, n, 3):                                  # reorder: not a flip
        se[tok, tok % L] = se[tok, tok % L][::-1]
    for tok in range(0, n, 7):                                  # one expert outside: a flip
        row = se[tok, (tok + 1) % L]
        row[0] = next(e for e in range(experts) if e not in row)
    dup = rng.random((n, L)) < 0.05                             # repeated ids: multisets count
    se[dup, 0] = se[dup, -1]
    cell = torch.from_numpy(rng.integers(0, 6, n))
    t, s = torch.from_numpy(te).to(dtype), torch.from_numpy(se).to(dtype)
    routed, any_flip, per_layer, _ = routing_counts(t, s, cell, 6, 1 << 18, compiled=True)
    flips = reference_flips(te, se)                             # [n, L] bool
    want = np.zeros((6, L), dtype=np.int64)
    np.add.at(want, cell.numpy(), flips.astype(np.int64))
    np.testing.assert_array_equal(per_layer.numpy(), want)
    np.testing.assert_array_equal(any_flip.numpy(), np.bincount(cell.numpy()[flips.any(1)], minlength=6))
    np.testing.assert_array_equal(routed.numpy(), np.bincount(cell.numpy(), minlength=6))
    assert flips.any() and not flips.all()


def test_routing_network_sorts_every_top8_byte_row():
    # the 16-lane byte network of the top-8 path, on rows with many ties: both kernels compare
    # the sorted ids (with repeated ids, [0, 0, 1] and [0, 1, 1] differ), as numpy's sort does
    rng = np.random.default_rng(3)
    te = rng.integers(0, 4, (5000, 1, 8)).astype(np.uint8)     # many ties
    se = np.stack([rng.permutation(row) for row in te[:, 0]])[:, None, :]
    change = rng.random(5000) < 0.3
    se[change, 0, rng.integers(0, 8, change.sum())] = rng.integers(0, 4, change.sum())
    cell = torch.zeros(5000, dtype=torch.int64)
    _, _, per_layer, _ = routing_counts(torch.from_numpy(te), torch.from_numpy(se), cell, 1, 1 << 18,
                                        compiled=True)
    sorted_differ = (np.sort(te, -1) != np.sort(se, -1)).any(-1)
    assert int(per_layer.sum()) == int(sorted_differ.sum()) > 0
    _, _, torch_layer, _ = routing_counts(torch.from_numpy(te), torch.from_numpy(se), cell, 1, 1 << 18)
    assert torch.equal(per_layer, torch_layer)
    assert len(sorting_network(8)) == 19


def test_batches_past_32_bit_counts_take_the_torch_ops():
    # the compiled pass counts histogram bins in 32 bits: a batch that could overflow them is
    # routed to the torch ops, and kernel="native" says why instead of overflowing
    cpu = torch.device("cpu")
    assert native.use_native(MetricConfig(), cpu, native.MAX_TOKENS)
    assert not native.use_native(MetricConfig(), cpu, native.MAX_TOKENS + 1)
    with pytest.raises(ValueError, match="tokens a batch"):
        native.use_native(NATIVE, cpu, native.MAX_TOKENS + 1)
    assert not native.use_native(TORCH, cpu, 10)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_nonzero_rows_match_numpy(dtype):
    rng = np.random.default_rng(7)
    for rows, width, density in ((700, 100, 0.0), (700, 100, 0.3), (1001, 200, 0.9), (10, 10, 0.5), (70_000, 1, 1.0)):
        values = (rng.random(rows * width) < density).astype(dtype) * rng.integers(-3, 4, rows * width).astype(dtype)
        values[-1] = 0                                   # the last write is past the count
        idx = np.flatnonzero(values)
        row, col, val = native.nonzero_rows(values, width)
        np.testing.assert_array_equal(row, idx // width)
        np.testing.assert_array_equal(col, idx % width)
        np.testing.assert_array_equal(val, values[idx])
        assert row.dtype == col.dtype == val.dtype == np.int64


def test_ids_out_of_range_raise_instead_of_reading_past_the_arrays():
    # a batch built without TokenBatch's checks: the compiled pass refuses it (an error the
    # collector catches) instead of reading memory past its tables
    import dataclasses

    batch = make_case(2, num_sequences=5).batch("seq_ids")         # ids read token by token
    offsets = make_case(2, num_sequences=5).batch("offsets")
    for bad in (dataclasses.replace(batch, seq_ids=batch.seq_index.clone().fill_(batch.num_sequences)),
                dataclasses.replace(offsets, turn_index=offsets.turn_index.clone().fill_(-3))):
        with pytest.raises(IndexError, match="out of range|expected seq_index"):
            compute_stats(bad, NATIVE)
    # a negative id stops at the sequence lengths' bincount, before any pass
    with pytest.raises(RuntimeError, match="non-negative"):
        compute_stats(dataclasses.replace(batch, seq_ids=batch.seq_index.clone().fill_(-1)), NATIVE)
    # the compiled pass's own check of ids it reads per token (tokens in batch order), past
    # the engine's other uses of the ids
    batch = make_case(2, num_sequences=5).batch("seq_ids")
    coder = JointCoder.build(NATIVE, torch.device("cpu"))
    kernel = native.TokenKernel.build(NATIVE, coder, LogBins.from_config(NATIVE), 1, 0, batch.num_sequences, 1)
    J = 2 * (len(NATIVE.lowprob_edges) + 1) * coder.R         # (1 cell + the dump) x lowprob x regions
    acc = TokenAccumulators.zeros(1, batch.num_sequences, J, LogBins.from_config(NATIVE).num_bins,
                                  torch.device("cpu"), torch.int32)
    bad = batch.seq_index.clone()
    bad[-1] = batch.num_sequences
    ranges = sequence_ranges(0, batch.num_tokens, None, np.zeros(batch.num_sequences, dtype=np.int64))
    with pytest.raises(IndexError, match="expected seq_index"):
        kernel.run(ranges, batch.trainer_logprobs, batch.sampler_logprobs, bad, None,
                   torch.zeros(batch.num_sequences, dtype=torch.int64), None, acc)


@pytest.mark.parametrize("alpha", [0.05, 1e-3, 1e-4, 1e-5])
def test_fine_histograms_bin_as_the_edges_say_or_take_the_torch_ops(alpha):
    # the compiled lookup steps at most once past an edge: fine accuracies need narrower keys,
    # and past the lookup's size the engine runs the torch ops (kernel="native" says why)
    config = MetricConfig(hist_relative_accuracy=alpha)
    batch = make_case(3, num_sequences=40).batch("offsets")
    assert_tables_match(compute_stats(batch, config)["abs_hist"],
                        compute_stats(batch, replace(config, kernel="torch"))["abs_hist"], "abs_hist")
    compiled = native.use_native(config, torch.device("cpu"))
    assert compiled == (alpha >= 1e-4)
    if not compiled:
        with pytest.raises(ValueError, match="histogram lookup"):
            compute_stats(batch, replace(config, kernel="native"))


def test_sequence_ranges_cover_each_token_once_grouped_by_sequence_cell():
    rng = np.random.default_rng(3)
    for _ in range(50):
        lengths = rng.integers(0, 6, rng.integers(1, 30))          # empty sequences too
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        N = int(offsets[-1])
        if N == 0:
            continue
        seq_cell = rng.integers(0, 4, len(lengths))
        start = int(rng.integers(0, N))
        stop = int(rng.integers(start + 1, N + 1))
        ranges = sequence_ranges(start, stop, offsets, seq_cell)
        covered = np.concatenate([np.arange(a, b) for a, b, _ in ranges])
        np.testing.assert_array_equal(np.sort(covered), np.arange(start, stop))
        for a, b, q in ranges:                                     # inside its own sequence
            assert offsets[q] <= a < b <= offsets[q + 1]
        cells = seq_cell[ranges[:, 2]]
        assert (np.diff(cells) >= 0).all()                         # one cell after the other
        for c in np.unique(cells):                                 # batch order inside a cell
            assert (np.diff(ranges[cells == c, 2]) > 0).all()
    assert sequence_ranges(3, 9, None, seq_cell).tolist() == [[3, 9, -1]]


@pytest.mark.parametrize("workers", [1, 2])
def test_grouped_and_batch_order_passes_agree(workers):
    # with offsets the compiled pass takes sequences grouped by cell; with shuffled sequence
    # ids it takes tokens in batch order: the same statistics, to rounding
    case = make_case(9, num_sequences=120, dtype=torch.float32, tail_fraction=5e-3, bad_fraction=0.01)
    config = replace(NATIVE, chunk_tokens=2048)
    grouped = compute_stats(case.batch("offsets"), config, workers=workers)
    in_order = compute_stats(case.batch("seq_ids"), config, workers=workers)
    for name in ("tokens", "abs_hist", "lowprob", "routing_layers", "sequences", "seq_hist", "staleness"):
        assert_tables_match(grouped[name], in_order[name], name, rtol=1e-12, atol=1e-13)


def test_split_by_cell_cuts_at_cell_boundaries_or_declines():
    offsets = np.arange(0, 101, 10)                               # ten sequences of ten tokens
    cells = np.array([0, 0, 1, 1, 1, 2, 2, 3, 3, 3])
    ranges = sequence_ranges(0, 100, offsets, cells)
    parts = split_by_cell(ranges, cells, 2)
    assert [int((p[:, 1] - p[:, 0]).sum()) for p in parts] == [50, 50]
    assert not set(cells[parts[0][:, 2]]) & set(cells[parts[1][:, 2]])   # no cell in both
    assert split_by_cell(ranges, cells, 3) is None          # 20/50/30 is not within 5%
    assert split_by_cell(ranges, np.zeros(10, dtype=np.int64), 2) is None   # one cell
    in_order = sequence_ranges(0, 100, None, cells)
    assert split_by_cell(in_order, cells, 2) is None        # ids read per token


@pytest.mark.parametrize("workers", [2, 3])
def test_workers_share_tokens_when_cells_do_not_split(workers):
    # one pool, one length bucket: a single sequence cell, so the workers take token shares
    # (a sequence may be cut between two of them) into their own accumulators, merged
    case = make_case(4, num_sequences=30, max_len=4000, dtype=torch.float32, tail_fraction=5e-3,
                     bad_fraction=0.01, extra_dim=False)
    case = replace(case, labels={"pool": ["a"] * case.num_sequences})
    batch = case.batch("offsets")
    config = replace(NATIVE, chunk_tokens=1024, length_edges=(1 << 20,))
    seq_cell = np.zeros(batch.num_sequences, dtype=np.int64)
    assert split_by_cell(sequence_ranges(0, batch.num_tokens, batch.seq_offsets.numpy(), seq_cell),
                                seq_cell, workers) is None
    got = compute_stats(batch, config, workers=workers)
    want = compute_stats(batch, replace(config, kernel="torch"))
    for name in ("tokens", "abs_hist", "lowprob", "routing_layers", "sequences", "seq_hist", "staleness"):
        assert_tables_match(got[name], want[name], name, rtol=1e-12, atol=1e-13)
