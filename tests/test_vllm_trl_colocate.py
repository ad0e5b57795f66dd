"""TRL's GRPOTrainer with vLLM in colocate mode, the integration attached, on the CPU.

A toy Qwen3 written to a directory with the character tokenizer (no download); TRL starts its own
in-process vLLM engine from it. TRL's colocate weight sync fails on the CPU, so
``fix_colocate_sync`` replaces it there with reload_weights + reset_prefix_cache. What is
checked: the fix applies (CPU); training runs; every optimizer step lands in the run with the
engine's own log-probs as the sampler side (pool ``vllm``), at the engine dtype's rounding level
against the fp32 trainer and not zero; the engine holds trained weights (synced, not the
checkpoint it started from).
Runtime: about 1 min.
"""

from __future__ import annotations

import os
import socket

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make install-vllm)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# before the first engine: in-process, one thread; the single-process "launcher" TRL asks for
for key, value in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0",
                   "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
                   "VLLM_CPU_KVCACHE_SPACE": "1"}.items():
    os.environ.setdefault(key, value)

import duckdb  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from mismatch_monitor.collectors.collector import MismatchCollector  # noqa: E402
from mismatch_monitor.collectors.trl import MismatchGRPOTrainer  # noqa: E402
from mismatch_monitor.collectors.trl_vllm import fix_colocate_sync  # noqa: E402
from mismatch_monitor.sim.policy import PolicyShape, build_model, model_config  # noqa: E402
from mismatch_monitor.sim.task import StringTask  # noqa: E402
from mismatch_monitor.sim.tokenizer import CharTokenizer  # noqa: E402
from mismatch_monitor.sim.vllm_checkpoint import write_model_dir  # noqa: E402

torch.set_num_threads(1)
STEPS = 3


def reward(completions, **kwargs):
    return [float(c.count("a")) - 0.1 * len(c) for c in completions]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl_vllm")
    tok = CharTokenizer("abcdefgh")
    config = model_config(PolicyShape(head_dim=32), tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id)
    torch.manual_seed(0)
    model = build_model(config)
    directory = write_model_dir(tmp / "model", config, tok, {k: v.detach() for k, v in model.state_dict().items()},
                                "fp32")
    episodes = StringTask().sample(16, torch.Generator().manual_seed(0), tok.alphabet)
    dataset = Dataset.from_dict({"prompt": [ep.prompt() for ep in episodes]})
    args = GRPOConfig(output_dir=str(tmp / "out"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=STEPS, logging_steps=1, report_to=[], use_cpu=True,
                      save_strategy="no", seed=0, learning_rate=5e-3, use_vllm=True, vllm_mode="colocate",
                      vllm_max_model_length=128, vllm_importance_sampling_correction=False)
    run_dir = tmp / "run"
    with MismatchCollector(run_dir) as collector:
        trainer = MismatchGRPOTrainer(model=str(directory), reward_funcs=reward, args=args, train_dataset=dataset,
                                      mismatch_collector=collector)
        applied = fix_colocate_sync(trainer)
        initial = trainer.model.lm_head.weight.detach().float().clone()
        trainer.train()
    return applied, run_dir, trainer, initial


def test_fix_applies_on_the_cpu(trained):
    applied, _, trainer, _ = trained
    assert applied
    assert trainer.state.global_step == STEPS


def _lm_head(model: torch.nn.Module) -> torch.Tensor:
    return model.lm_head.weight.detach().float().clone()


def test_the_engine_received_trained_weights(trained):
    _, _, trainer, initial = trained
    final = trainer.model.lm_head.weight.detach().float()
    engine = trainer.vllm_generation.llm.apply_model(_lm_head)[0][: final.shape[0]]   # vLLM pads the vocab
    # synced at the start of the last step: one update behind the trainer, far from the start
    assert (engine - initial).abs().max() > 0.5 * (final - initial).abs().max() > 0
    assert (engine - final).abs().max() < (initial - final).abs().max()


def test_every_step_is_logged_with_the_engines_logprobs(trained):
    _, run_dir, trainer, _ = trained
    # vLLM on the CPU runs an fp32 checkpoint in bf16 unless asked otherwise (TRL does not ask)
    dtype = trainer.vllm_generation.llm.llm_engine.vllm_config.model_config.dtype
    bound = 1e-4 if dtype == torch.float32 else 0.1
    files = sorted(str(p) for p in (run_dir / "tokens").glob("*.parquet"))
    rows = duckdb.connect().execute(
        "SELECT step, sum(n_tokens), sum(sum_k3) / sum(n_tokens), max(max_abs_lr) FROM read_parquet($f) "
        "WHERE pool = 'vllm' GROUP BY step ORDER BY step", {"f": files}).fetchall()
    assert [r[0] for r in rows] == list(range(1, STEPS + 1)) or [r[0] for r in rows] == list(range(STEPS))
    for step, tokens, k3, max_lr in rows:
        assert tokens > 0
        assert 0.0 < max_lr < bound, (step, dtype, max_lr)   # engine rounding, not stale weights
        assert k3 < bound ** 2, (step, dtype, k3)


def test_each_weight_push_and_outcome_is_in_the_run(trained):
    from mismatch_monitor import query
    from mismatch_monitor.query.events import run_events, run_outcomes

    _, run_dir, trainer, _ = trained
    con = query.connect()
    events = run_events(con, run_dir)
    # TRL pushes at the start of each step's generation (global_step g): sampled by step g + 1
    assert events[["step", "kind", "pool", "version"]].values.tolist() == [
        [g + 1, "weight_sync", "vllm", g] for g in range(STEPS)]
    outcomes = run_outcomes(con, run_dir)
    rewards = outcomes[outcomes["name"] == "reward"]
    logged = [h for h in trainer.state.log_history if "reward" in h]
    assert rewards[["step", "value"]].values.tolist() == [[h["step"], h["reward"]] for h in logged]
    assert rewards["step"].tolist() == query.steps_index(con, run_dir)["step"].tolist()
