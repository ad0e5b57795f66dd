"""TRL for real: a tiny causal LM from a config, a locally built tokenizer, GRPO steps on CPU.

What is checked: the integration writes one Parquet step per optimizer step with every trained
completion token (counted independently from TRL's own logged completion lengths); fp32
generation and scoring agree to float rounding (an off-by-one in the capture would show as
|lr| of order 1); a one-sided fp32 LM head shows real mismatch; losses are bit-identical with and without
the integration; TRL's mismatch scalars are forwarded when logged. Runtime: ~25 s (mostly the
imports and five short trainings on one thread).
"""

from __future__ import annotations

import math

import duckdb
import pytest
import torch

from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from mismatch_monitor.collectors.collector import MismatchCollector
from mismatch_monitor import query
from mismatch_monitor.collectors.trl import (SAMPLER_KEY, VERSION_KEY, MismatchGRPOTrainer,
                                             TRLMismatchScalars, trl_batch_fields)
from mismatch_monitor.collectors.trl_outcomes import trl_outcomes
from mismatch_monitor.query.events import run_events, run_outcomes
from mismatch_monitor.config import MetricConfig

torch.set_num_threads(1)
WORDS = [f"w{i}" for i in range(40)]
VOCAB = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}


def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=True))


def reward(completions, **kwargs):
    return [float(c.count("w7")) - 0.1 * len(c.split()) for c in completions]


def train(tmp_path, *, integrated: bool, bf16: bool = False, steps: int = 4, **extra):
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                      gradient_accumulation_steps=2, max_completion_length=8, max_steps=steps,
                      logging_steps=1, report_to=[], bf16=bf16, use_cpu=True, save_strategy="no",
                      seed=0, **{"learning_rate": 1e-2, **extra})
    dataset = Dataset.from_dict({"prompt": [" ".join(WORDS[i:i + 3]) for i in range(16)]})
    common = dict(model=model(), reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer())
    if not integrated:
        trainer = GRPOTrainer(**common)
        trainer.train()
        return trainer, None
    collector = MismatchCollector(tmp_path / "run", config=MetricConfig(), flush_every_steps=2)
    trainer = MismatchGRPOTrainer(**common, mismatch_collector=collector, mismatch_labels={"hardware": "cpu"})
    forwarded: list = []
    trainer.add_callback(TRLMismatchScalars(lambda step, values: forwarded.append((step, values))))
    trainer.train()
    collector.close()
    return trainer, forwarded


def read(run_dir, sql_tail: str):
    files = sorted(str(p) for p in (run_dir / "tokens").glob("*.parquet"))
    return duckdb.connect().execute(f"SELECT step, {sql_tail} FROM read_parquet($f) GROUP BY step ORDER BY step",
                                    {"f": files}).fetchall()


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl_fp32")
    trainer, forwarded = train(tmp, integrated=True)
    return tmp, trainer, forwarded


def test_one_parquet_step_per_optimizer_step_with_every_trained_token(fp32_run):
    tmp, trainer, _ = fp32_run
    rows = read(tmp / "run", "sum(n_tokens), sum(n_nonfinite), min(pool), min(precision), min(hardware)")
    assert [r[0] for r in rows] == [1, 2, 3, 4]
    logged = {h["step"]: h for h in trainer.state.log_history if "completions/mean_length" in h}
    for step, n_tokens, n_nonfinite, pool, precision, hardware in rows:
        # TRL's own count: 8 completions per optimizer step (2 micro-batches of 4)
        assert n_tokens == round(logged[step]["completions/mean_length"] * 8)
        assert n_nonfinite == 0 and (pool, precision, hardware) == ("transformers", "fp32", "cpu")
        assert logged[step]["mismatch/n_tokens"] == n_tokens          # the report rides on TRL's logs


def test_fp32_generation_and_scoring_agree_to_rounding(fp32_run):
    tmp, trainer, _ = fp32_run
    batch = trainer.mismatch_hook.last_batch
    lr = (batch.trainer_logprobs.double() - batch.sampler_logprobs.double()).abs()
    assert 0 < float(lr.max()) < 1e-4                                   # cached decode vs full forward
    assert float(batch.sampler_logprobs.min()) < -1.0                    # real log-probs, not zeros
    for step, k3, max_abs, stale in read(tmp / "run", "sum(sum_k3) / sum(n_tokens), max(max_abs_lr), 0"):
        assert 0 <= k3 < 1e-8 and max_abs < 1e-4
    steps = [h for h in trainer.state.log_history if "mismatch/staleness/max" in h]
    assert steps and all(h["mismatch/staleness/max"] == 0 for h in steps)   # on-policy: same weights


def test_one_sided_fp32_lm_head_shows_real_mismatch(tmp_path, fp32_run):
    """bf16 autocast with ``cast_lm_head_to_fp32``: TRL's fused scoring head runs in fp32, while
    generation's head stays under bf16 autocast, a real precision mismatch of the LM head."""
    trainer, _ = train(tmp_path, integrated=True, bf16=True, steps=2, cast_lm_head_to_fp32=True)
    bf16 = trainer.mismatch_hook.last_batch
    fp32 = fp32_run[1].mismatch_hook.last_batch

    def max_abs(b):
        return float((b.trainer_logprobs.double() - b.sampler_logprobs.double()).abs().max())
    assert max_abs(bf16) > 100 * max_abs(fp32)
    assert set(bf16.labels["precision"]) == {"bf16"}


def test_losses_are_unchanged_by_the_integration(tmp_path, fp32_run):
    plain, _ = train(tmp_path / "plain", integrated=False)
    keys = ("loss", "grad_norm", "reward", "entropy")

    def losses(trainer):
        return [{k: h[k] for k in keys} for h in trainer.state.log_history if "loss" in h]
    assert losses(plain) == losses(fp32_run[1]) and len(losses(plain)) == 4
    # the captured sampler log-probs travel under our key, never under the one TRL's loss reads
    buffered = fp32_run[1]._buffered_inputs[0]
    assert SAMPLER_KEY in buffered and "sampling_per_token_logps" not in buffered


def test_trl_scalars_are_forwarded_when_trl_logs_them(fp32_run):
    _, _, forwarded = fp32_run
    assert forwarded == []                    # without vLLM, TRL computes no mismatch scalar
    sink: list = []
    cb = TRLMismatchScalars(lambda step, values: sink.append((step, values)))
    logs = {"loss": 0.1, "sampling/sampling_logp_difference/mean": 0.02,
            "sampling/sampling_logp_difference/max": 0.9, "eval_sampling/importance_sampling_ratio/mean": 1.01}
    cb.on_log(None, type("S", (), {"global_step": 7})(), None, logs=logs)
    assert sink == [(7, {"trl/sampling/sampling_logp_difference/mean": 0.02,
                         "trl/sampling/sampling_logp_difference/max": 0.9,
                         "trl/eval_sampling/importance_sampling_ratio/mean": 1.01})]


def test_trl_outcomes_are_stored_per_step_beside_the_statistics(fp32_run):
    tmp, trainer, _ = fp32_run
    con = query.connect()
    outcomes = run_outcomes(con, tmp / "run")
    stored = {(step, name): value for step, name, value in outcomes[["step", "name", "value"]].itertuples(index=False)}
    logged = [h for h in trainer.state.log_history if "loss" in h]     # what TRL logged, one line per step
    assert [h["step"] for h in logged] == [1, 2, 3, 4]
    for h in logged:
        for name in ("loss", "grad_norm", "reward", "entropy"):
            assert stored[(h["step"], name)] == h[name], (h["step"], name)
        assert stored[(h["step"], "reward/reward")] == h["rewards/reward/mean"]
    assert len(stored) == 4 * 5 and outcomes["pool"].isna().all()
    assert sorted({step for step, _ in stored}) == query.steps_index(con, tmp / "run")["step"].tolist()
    assert len(run_events(con, tmp / "run")) == 0              # without vLLM nothing is pushed


def test_trl_log_lines_as_outcomes():
    logs = {"loss": 0.5, "grad_norm": 2.0, "reward": 1.25, "entropy": 0.75, "learning_rate": 1e-3,
            "rewards/accuracy/mean": 0.5, "rewards/accuracy/std": 0.1, "eval_reward": 0.9,
            "eval_rewards/format/mean": 1.0, "mismatch/k3_kl": 0.01, "epoch": 1}
    assert trl_outcomes(logs) == {"loss": 0.5, "grad_norm": 2.0, "reward": 1.25, "entropy": 0.75,
                                  "reward/accuracy": 0.5, "eval_reward": 0.9, "eval_reward/format": 1.0}


def test_batch_fields_of_a_multi_turn_micro_batch():
    """tool tokens are excluded, turns follow runs of model tokens, old log-probs mean staleness 0."""
    B, T = 2, 6
    completion_mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    tool_mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 0, 1, 0, 1, 1]])
    inputs = {"completion_mask": completion_mask, "tool_mask": tool_mask, "completion_ids": torch.arange(12).view(B, T),
              "advantages": torch.tensor([0.5, -1.0]), SAMPLER_KEY: torch.full((B, T), -2.0),
              VERSION_KEY: torch.tensor([3, 3]), "old_per_token_logps": torch.full((B, T), -1.5)}
    fields = trl_batch_fields(inputs, torch.zeros(B, T), labels={"pool": "p"}, trainer_version=5)
    mask = fields["response_mask"]
    assert mask.tolist() == [[1, 1, 0, 0, 1, 0], [1, 0, 1, 0, 1, 1]]
    assert fields["turn_index"][mask].tolist() == [0, 0, 1, 0, 1, 2, 2]
    assert fields["trainer_version"] == 3 and float(fields["trainer_logprobs"][0, 0]) == -1.5
    del inputs["old_per_token_logps"]
    fields = trl_batch_fields(inputs, torch.zeros(B, T), labels={"pool": "p"}, trainer_version=5)
    assert fields["trainer_version"] == 5 and float(fields["trainer_logprobs"][0, 0]) == 0.0
    assert math.isclose(float(fields["advantages"][1]), -1.0)
