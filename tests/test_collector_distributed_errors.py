"""A rank whose batch is rejected still joins the reduction: no rank waits, nothing is lost,
and the writer records why that rank's share is missing. A rank that skips a ``log_step`` is
never merged into another step.

Two gloo processes on 127.0.0.1 per test. Runtime: ~30-50 s each on a 2-core machine.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mismatch_monitor import query
from mismatch_monitor.collectors import DistributedReducer, MismatchCollector
from mismatch_monitor.engine import compute_stats

from synthetic import make_batch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, run_dir: str, out_dir: str, steps_of: dict | None = None) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=__import__("datetime").timedelta(seconds=60))
    try:
        reducer = DistributedReducer(exemplars_k=4)
        with MismatchCollector(run_dir, reducer=reducer, exemplars_k=4, flush_every_steps=1,
                               alert_evaluator=None) as mc:
            for step in (steps_of or {}).get(rank, range(3)):
                if rank == 1 and step == 1:
                    t = -torch.rand(3, 5)
                    report = mc.log_step(step, trainer_logprobs=t, sampler_logprobs=t[:, :4],
                                         response_mask=torch.ones(3, 5))
                else:
                    report = mc.log_step(step, make_batch(step, seed=rank))
                Path(out_dir, f"r{rank}s{step}").write_text(str(report["mismatch/collector_errors"]))
    finally:
        dist.destroy_process_group()


def test_rejected_batch_on_one_rank_neither_hangs_nor_loses_the_others(tmp_path):
    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    mp.start_processes(_worker, args=(_free_port(), str(run), str(out)), nprocs=2,
                       start_method="spawn", join=True)
    # the writer counts rank 1's rejected share too, and keeps its text
    assert (out / "r1s1").read_text() == "1.0" and (out / "r0s1").read_text() == "1.0"
    con = query.connect()
    errors = query.collector_errors(con, run)
    assert errors["step"].tolist() == [1] and errors["kind"].tolist() == ["BatchError"]
    assert errors["where"][0] == "rank 1: step 1: this rank's batch was left out"
    assert "shape mismatch: trainer_logprobs (3, 5) vs sampler_logprobs (3, 4)" in errors["message"][0]
    idx = query.steps_index(con, run)
    assert idx["step"].tolist() == [0, 1, 2]
    tokens = dict(zip(idx["step"], idx["n_tokens"]))
    one = lambda step, seed: int(compute_stats(make_batch(step, seed=seed))["tokens"]["n_tokens"].sum())  # noqa: E731
    assert tokens[0] == one(0, 0) + one(0, 1)
    assert tokens[1] == one(1, 0)                      # rank 0's share of step 1 is kept
    assert tokens[2] == one(2, 0) + one(2, 1)
    assert idx["collector_errors"].tolist() == [0, 1, 1]


def test_a_rank_that_skips_a_step_is_refused_not_merged_into_another(tmp_path):
    """Rank 1 skips step 1 (and logs a step 3 so that the collectives pair up): its steps 2 and
    3 meet rank 0's steps 1 and 2 and are refused; nothing of one step lands in another."""
    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    mp.start_processes(_worker, args=(_free_port(), str(run), str(out), {0: [0, 1, 2], 1: [0, 2, 3]}),
                       nprocs=2, start_method="spawn", join=True)
    con = query.connect()
    idx = query.steps_index(con, run)
    one = lambda step, seed: int(compute_stats(make_batch(step, seed=seed))["tokens"]["n_tokens"].sum())  # noqa: E731
    assert idx["step"].tolist() == [0, 1, 2]
    assert idx["n_tokens"].tolist() == [one(0, 0) + one(0, 1), one(1, 0), one(2, 0)]
    errors = query.collector_errors(con, run).sort_values("wall_time")
    assert errors["kind"].tolist() == ["StepMismatch", "StepMismatch"]
    assert errors["step"].tolist() == [2, 3]           # the step each refused shard carried
    assert "rank 1 sent step 2 while the writer merges step 1" in errors["message"].iloc[0]
    assert (out / "r0s2").read_text() == "2.0"
