"""Multi-rank reduction with real torch.distributed (gloo, 2 processes on 127.0.0.1).

The law under test: the writer rank's merged view equals one process on the concatenated data.
Integer columns, minima and maxima must match exactly; float64 sums to summation-order
rounding (the bound stated in collectors/distributed.py). Runtime: ~15 s (two process spawns).
"""

from __future__ import annotations

import os
import pickle
import socket
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.collectors.distributed import DistributedReducer
from mismatch_monitor.collectors.step_hook import concat_batches
from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats
from mismatch_monitor.engine.fields import TABLES
from mismatch_monitor.engine.stats import key_columns
from mismatch_monitor.exemplars import tail_exemplars
from mismatch_monitor.metrics import report

torch.set_num_threads(1)
WORLD = 2
STEPS = 3
K = 5
CONFIG = MetricConfig(length_edges=(4, 8, 16), turn_edges=(1, 2))


def make_batch(seed: int, num_seqs: int, *, extra_label: bool = False) -> TokenBatch:
    """A padded batch with heavy tails, NaNs, two pools, turns, routing, staleness, advantages."""
    g = torch.Generator().manual_seed(seed)
    T, L, Kx = 24, 3, 2
    lengths = torch.randint(1, T + 1, (num_seqs,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    mu = -torch.rand(num_seqs, T, generator=g, dtype=torch.float64) * 6
    noise = torch.randn(num_seqs, T, generator=g, dtype=torch.float64) * 0.05
    spikes = (torch.rand(num_seqs, T, generator=g) < 0.03) * torch.randn(num_seqs, T, generator=g) * 3
    pi = (mu + noise + spikes).clamp(max=0.0)
    if num_seqs:
        pi[0, 0] = float("nan")                              # a data-quality token
    experts_s = torch.randint(0, 8, (num_seqs, T, L, Kx), generator=g)
    experts_t = experts_s.clone()
    flip = torch.rand(num_seqs, T, L, generator=g) < 0.1
    experts_t[..., 0] = torch.where(flip, (experts_s[..., 0] + 1) % 8, experts_s[..., 0])
    labels = {"pool": [("fp8" if i % 3 == 0 else "bf16") for i in range(num_seqs)],
              "hardware": [("h100" if i % 2 else "b200") for i in range(num_seqs)]}
    if extra_label:
        labels["env"] = [f"env{i % 2}" for i in range(num_seqs)]
    return TokenBatch.from_padded(
        pi.float(), mu.float(), mask, labels=labels,
        turn_index=(torch.arange(T)[None, :].expand(num_seqs, T) // 7).contiguous(),
        policy_version=torch.randint(5, 11, (num_seqs,), generator=g), trainer_version=10,
        advantages=torch.randn(num_seqs, generator=g),
        trainer_experts=experts_t, sampler_experts=experts_s,
        token_ids=torch.randint(0, 100, (num_seqs, T), generator=g))


def shard(step: int, rank: int) -> TokenBatch:
    # rank 1 holds more sequences than rank 0, and on the last step none at all
    sizes = {0: 6, 1: 0 if step == STEPS - 1 else 9}
    return make_batch(1000 * step + rank, sizes[rank])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        from mismatch_monitor.collectors.collector import MismatchCollector

        # 1) the reducer alone, writer-only and all-ranks
        results = {}
        for all_ranks in (False, True):
            reducer = DistributedReducer(exemplars_k=K, all_ranks=all_ranks)
            batch = shard(0, rank)
            stats = compute_stats(batch, CONFIG)
            merged, exemplars = reducer(stats, tail_exemplars(batch, K, CONFIG))
            results[all_ranks] = (reducer.is_writer, merged.tables, exemplars)
        # 2) the real collector: only the writer creates the run store
        reducer = DistributedReducer(exemplars_k=K)
        run_dir = Path(out_dir) / f"run_rank{rank}"    # a real job passes one path everywhere
        with MismatchCollector(run_dir, config=CONFIG, reducer=reducer, exemplars_k=K,
                               flush_every_steps=2) as collector:
            reports = [collector.log_step(step, shard(step, rank)) for step in range(STEPS)]
        with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
            pickle.dump({"results": results, "reports": reports}, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    mp.spawn(_worker, args=(free_port(), str(out)), nprocs=WORLD, join=True)
    ranks = [pickle.loads((out / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]
    return out, ranks


def sort_table(df: pd.DataFrame, table: str, dims) -> pd.DataFrame:
    keys = [k for k in key_columns(table, dims) if k in df.columns]
    return df.sort_values(keys, kind="stable", na_position="first").reset_index(drop=True)


def assert_tables_equal(got: dict, want: dict, dims) -> None:
    for table, (_, fields) in TABLES.items():
        g, w = sort_table(got[table], table, dims), sort_table(want[table], table, dims)
        assert len(g) == len(w), table
        keys = [k for k in key_columns(table, dims) if k in w.columns]
        pd.testing.assert_frame_equal(g[keys], w[keys], check_dtype=False)
        for f in fields:
            if f.dtype == "int64" or f.merge in ("min", "max"):   # exact
                np.testing.assert_array_equal(g[f.name].to_numpy(), w[f.name].to_numpy(),
                                              err_msg=f"{table}.{f.name}")
            else:   # float64 sums: summation order only
                assert_sums_close(g[f.name], w[f.name], f"{table}.{f.name}")


def assert_sums_close(got, want, what: str) -> None:
    """Summation-order rounding: |error| <= n * eps * sum|x|; 1e-12 of the largest cell covers it."""
    a, b = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    scale = np.nanmax(np.abs(b)) if b.size and np.isfinite(b).any() else 0.0
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12 * scale, equal_nan=True, err_msg=what)


def test_writer_view_equals_single_process(spawned):
    _, ranks = spawned
    single = compute_stats(concat_batches([shard(0, 0), shard(0, 1)]), CONFIG)
    writer, tables, _ = ranks[0]["results"][False]
    assert writer and not ranks[1]["results"][False][0]
    assert_tables_equal(tables, single.tables, single.dims)
    # the non-writer got its own share back, not the global view
    local = compute_stats(shard(0, 1), CONFIG)
    assert int(ranks[1]["results"][False][1]["tokens"]["n_tokens"].sum()) == int(local["tokens"]["n_tokens"].sum())


def test_all_ranks_view_is_global_everywhere(spawned):
    _, ranks = spawned
    single = compute_stats(concat_batches([shard(0, 0), shard(0, 1)]), CONFIG)
    for r in range(WORLD):
        assert_tables_equal(ranks[r]["results"][True][1], single.tables, single.dims)


def test_exemplars_are_the_global_top_k(spawned):
    _, ranks = spawned
    full = concat_batches([shard(0, 0), shard(0, 1)])
    want = tail_exemplars(full, K, CONFIG)
    got = ranks[0]["results"][False][2]
    for table, col in (("exemplar_tokens", "abs_log_ratio"), ("exemplar_sequences", "seq_max_abs_log_ratio")):
        np.testing.assert_array_equal(np.sort(got[table][col].to_numpy()), np.sort(want[table][col].to_numpy()))
    # an independent float64 reference for the token tail: the K largest valid |lr|
    lr = (full.trainer_logprobs.double() - full.sampler_logprobs.double()).numpy()
    top = np.sort(np.abs(lr[np.isfinite(lr)]))[-K:]
    np.testing.assert_array_equal(np.sort(got["exemplar_tokens"]["abs_log_ratio"].to_numpy()), top)
    # each exemplar names its rank: (rank, seq_index, position) finds the token in that rank's shard
    for _, row in got["exemplar_tokens"].iterrows():
        part = shard(0, int(row["rank"]))
        at = (part.seq_index == row["seq_index"]) & (part.position == row["position"])
        assert float(part.trainer_logprobs[at].double()) == row["trainer_logprob"]


def test_collector_writes_once_and_matches_single_process_store(spawned, tmp_path):
    out, ranks = spawned
    from mismatch_monitor.collectors.collector import MismatchCollector

    single_dir = tmp_path / "single"
    with MismatchCollector(single_dir, config=CONFIG, exemplars_k=K, flush_every_steps=2) as c:
        single_reports = [c.log_step(s, concat_batches([shard(s, 0), shard(s, 1)])) for s in range(STEPS)]
    multi_dir = out / "run_rank0"
    assert (multi_dir / "run.json").exists()
    assert not (out / "run_rank1").exists()          # only the writer rank touches the store
    # the writer's report is the global one
    for got, want in zip(ranks[0]["reports"], single_reports):
        assert got.keys() == want.keys()
        np.testing.assert_allclose([got[k] for k in want], [want[k] for k in want], rtol=1e-12)
    con = duckdb.connect()
    for table, (_, fields) in TABLES.items():
        files = {}
        for name, d in (("multi", multi_dir), ("single", single_dir)):
            paths = sorted(str(p) for p in (d / table).glob("*.parquet"))
            files[name] = con.execute(
                "SELECT * EXCLUDE (write_id, file_id) FROM read_parquet($f, union_by_name=true)",
                {"f": paths}).df() if paths else None
        if files["single"] is None:
            assert files["multi"] is None
            continue
        dims = [c for c in ("pool", "hardware", "precision", "engine", "env") if c in files["single"].columns]
        keys = ["step"] + key_columns(table, dims)
        g = files["multi"].sort_values(keys, na_position="first").reset_index(drop=True)
        w = files["single"].sort_values(keys, na_position="first").reset_index(drop=True)
        assert len(g) == len(w), table
        pd.testing.assert_frame_equal(g[keys], w[keys], check_dtype=False)
        for f in fields:
            if f.dtype == "int64" or f.merge in ("min", "max"):
                np.testing.assert_array_equal(g[f.name].to_numpy(np.float64), w[f.name].to_numpy(np.float64),
                                              err_msg=f"{table}.{f.name}")
            else:
                assert_sums_close(g[f.name], w[f.name], f"{table}.{f.name}")


def test_merged_report_against_float64_reference(spawned):
    """k3, max |lr| and ESS of the writer's view against numpy on the concatenated tokens."""
    _, ranks = spawned
    from mismatch_monitor.engine import MismatchStats

    tables = ranks[0]["results"][False][1]
    got = report(MismatchStats(tables, ("pool", "hardware", "precision", "engine", "env")), (), CONFIG)
    full = concat_batches([shard(0, 0), shard(0, 1)])
    lr = (full.trainer_logprobs.double() - full.sampler_logprobs.double()).numpy()
    lr = lr[np.isfinite(lr)]
    rho = np.exp(lr)
    assert got["mismatch/n_tokens"].iloc[0] == lr.size
    np.testing.assert_allclose(got["mismatch/k3_kl"].iloc[0], np.mean(rho - 1 - lr), rtol=1e-9)
    assert got["mismatch/abs_log_ratio/max"].iloc[0] == np.max(np.abs(lr))
    np.testing.assert_allclose(got["mismatch/ess"].iloc[0], rho.sum() ** 2 / (lr.size * (rho ** 2).sum()), rtol=1e-12)


def test_reducer_needs_an_initialised_group():
    with pytest.raises(RuntimeError, match="expected torch.distributed to be initialised"):
        DistributedReducer()
