"""MoE routing flips: a (token, layer) flips when its top-k expert *set* differs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.engine.routing import routing_counts, routing_flips
from reference import assert_tables_match, make_case, reference_tables
from reference import routing_flips as reference_flips

# every test runs with the compiled loops and with the torch ops (see conftest.py)
pytestmark = pytest.mark.usefixtures("each_kernel")


def test_permuted_top_k_is_not_a_flip():
    te = torch.tensor([[[3, 7, 1, 9]], [[0, 1, 2, 3]]], dtype=torch.uint8)     # [2 tokens, 1 layer, K=4]
    se = torch.tensor([[[9, 1, 7, 3]], [[3, 2, 1, 0]]], dtype=torch.uint8)
    assert not routing_flips(te, se).any()


def test_a_single_differing_expert_is_a_flip():
    te = torch.tensor([[[3, 7, 1, 9], [4, 5, 6, 8]]], dtype=torch.uint8)      # [1 token, 2 layers, 4]
    se = torch.tensor([[[3, 7, 1, 10], [8, 6, 5, 4]]], dtype=torch.uint8)
    assert routing_flips(te, se).tolist() == [[True, False]]


@pytest.mark.parametrize("k", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64])
def test_flips_match_python_sets_for_every_k_and_dtype(k, dtype):
    rng = np.random.default_rng(k)
    n, layers, experts = 400, 3, 64 if dtype != torch.uint8 else 200
    te = np.argsort(rng.random((n * layers, experts)), axis=1)[:, :k]
    se = te.copy()
    perm = rng.random(n * layers) < 0.4
    se[perm] = rng.permuted(se[perm], axis=1)                     # reordered: same set
    flip = np.nonzero(rng.random(n * layers) < 0.2)[0]
    for r in flip:                                                 # one expert swapped out
        se[r, rng.integers(0, k)] = rng.choice(np.setdiff1d(np.arange(experts), te[r]))
    te, se = te.reshape(n, layers, k), se.reshape(n, layers, k)
    got = routing_flips(torch.from_numpy(te).to(dtype), torch.from_numpy(se).to(dtype)).numpy()
    np.testing.assert_array_equal(got, reference_flips(te, se))
    assert got.sum() == len(flip)


def test_uint8_word_path_and_integer_path_agree():
    case = make_case(21, routing=(4, 8), num_experts=32)
    te = torch.from_numpy(case.trainer_experts)
    se = torch.from_numpy(case.sampler_experts)
    np.testing.assert_array_equal(routing_flips(te, se).numpy(),
                                  routing_flips(te.to(torch.int64), se.to(torch.int64)).numpy())


@given(seed=st.integers(0, 2**31 - 1), layers=st.integers(1, 6), k=st.integers(1, 10),
       chunk=st.sampled_from([1, 7, 1000]))
def test_per_cell_and_layer_counts_are_exact(seed, layers, k, chunk):
    rng = np.random.default_rng(seed)
    n, experts = int(rng.integers(1, 300)), 24
    te = np.argsort(rng.random((n, layers, experts)), axis=2)[..., :k].astype(np.uint8)
    se = te.copy()
    mask = rng.random((n, layers)) < 0.3
    se[mask] = np.roll(se[mask], 1, axis=-1)                       # a rotation: same set
    swap = rng.random((n, layers)) < 0.15
    se[swap, 0] = (se[swap, 0].astype(int) + rng.integers(1, experts, swap.sum())) % experts
    cell = rng.integers(0, 5, n)
    routed, any_flip, per_layer, L = routing_counts(torch.from_numpy(te), torch.from_numpy(se),
                                                    torch.from_numpy(cell), 5, chunk)
    want = reference_flips(te, se)                                  # [n, L]
    assert L == layers
    np.testing.assert_array_equal(routed.numpy(), np.bincount(cell, minlength=5))
    for c in range(5):
        np.testing.assert_array_equal(per_layer[c].numpy(), want[cell == c].sum(0))
        assert int(any_flip[c]) == int(want[cell == c].any(1).sum())


def test_routing_columns_and_layer_table_match_reference():
    config = MetricConfig(chunk_tokens=1024)
    for k, id_dtype in ((2, np.uint8), (8, np.uint8), (12, np.int64)):
        case = make_case(22 + k, num_sequences=50, routing=(5, k), num_experts=40, id_dtype=id_dtype)
        got = compute_stats(case.batch("padded"), config)
        want = reference_tables(case, config)
        assert_tables_match(got["tokens"], want["tokens"], "tokens")
        assert_tables_match(got["routing_layers"], want["routing_layers"], "routing_layers")
        assert got["routing_layers"]["n_flips"].sum() == got["tokens"]["n_routing_flips"].sum() > 0
