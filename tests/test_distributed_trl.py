"""TRL on two processes (gloo on CPU, as ``torchrun --nproc-per-node 2`` would start them).

Each process builds its collector the plain way, ``MismatchCollector(run_dir)``, *before* the
trainer's arguments bring the process group up; the trainer then wires the reduction in: rank 0
alone writes, and every stored step holds every rank's tokens (counted here, per rank, from the
batches each rank logged). Runtime: 2-4 min on a 2-core machine (two processes import TRL and
train two steps).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch.multiprocessing as mp

from mismatch_monitor import query


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, run_dir: str, out_dir: str) -> None:
    # what a launcher sets; accelerate (through GRPOConfig) starts the gloo group from it
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    from datasets import Dataset
    from trl import GRPOConfig

    from mismatch_monitor.collectors import MismatchCollector
    from mismatch_monitor.collectors.trl import MismatchGRPOTrainer
    from test_trl_grpo import WORDS, model, reward, tokenizer

    torch.set_num_threads(1)
    collector = MismatchCollector(run_dir, flush_every_steps=1)   # before the group is up
    logged: dict[int, int] = {}
    log_step = collector.log_step

    def counting(step, batch=None, **fields):                     # this rank's tokens per step
        logged[step] = logged.get(step, 0) + int(batch.num_tokens)
        return log_step(step, batch, **fields)

    collector.log_step = counting
    args = GRPOConfig(output_dir=str(Path(out_dir) / f"out{rank}"), per_device_train_batch_size=4,
                      num_generations=4, gradient_accumulation_steps=2, max_completion_length=8, max_steps=2,
                      logging_steps=1, report_to=[], bf16=False, use_cpu=True, save_strategy="no", seed=0,
                      learning_rate=1e-2)
    dataset = Dataset.from_dict({"prompt": [" ".join(WORDS[i:i + 3]) for i in range(16)]})
    trainer = MismatchGRPOTrainer(model=model(), reward_funcs=reward, args=args, train_dataset=dataset,
                                  processing_class=tokenizer(), mismatch_collector=collector)
    trainer.train()
    collector.close()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "logged": logged, "writer": collector.writer is not None,
        "world": collector.reducer.world_size if collector.reducer is not None else 1,
        "errors": collector.error_count}))


def test_two_trl_processes_store_every_rank_tokens_once(tmp_path):
    run, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    mp.start_processes(_worker, args=(_free_port(), str(run), str(out)), nprocs=2, start_method="spawn",
                       join=True)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["writer"] for r in ranks] == [True, False] and [r["world"] for r in ranks] == [2, 2]
    assert [r["errors"] for r in ranks] == [0, 0]
    steps = sorted(int(s) for s in ranks[0]["logged"])
    assert steps == [1, 2] and sorted(int(s) for s in ranks[1]["logged"]) == steps
    idx = query.steps_index(query.connect(), run)
    assert idx["step"].tolist() == steps
    for step, n_tokens in zip(idx["step"], idx["n_tokens"]):
        per_rank = [r["logged"][str(step)] for r in ranks]
        assert min(per_rank) > 0 and n_tokens == sum(per_rank), (step, n_tokens, per_rank)
    assert not (run / "errors").exists() or query.collector_errors(query.connect(), run).empty
