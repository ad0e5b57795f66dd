"""TRL without vLLM: the sampler side is the distribution transformers actually sampled from.

transformers applies a caller's logits processors before its own warpers (temperature, top-k,
top-p, min-p), so a capture passed to ``generate`` would read the raw distribution. Checked
on a real tiny ``GRPOTrainer`` (fp32, CPU):

* T = 0.7: TRL's trainer scores ``logits / T`` too, so |lr| must be at rounding level (reading
  the raw distribution gives a mean |lr| of about 0.06);
* top_k = 5: the sampler renormalises over the 5 kept tokens, so every captured log mu must
  equal log pi - log S, with S the kept mass recomputed here from the model (learning rate 0, so
  the weights are the sampler's), and every stored lr is <= 0: the "log S" fingerprint.

Also: continuous batching (no log-probs) and an unsupported TRL are refused when the trainer is
built. Runtime: ~60-80 s on a 2-core machine.
"""

from __future__ import annotations

import logging

import pytest
import torch

from mismatch_monitor.collectors import trl_compat
from mismatch_monitor.collectors.collector import MismatchCollector
from mismatch_monitor.collectors.trl import SAMPLER_KEY, MismatchGRPOTrainer
from test_trl_grpo import model, read, tokenizer, train  # noqa: F401  (one tiny setup for TRL tests)


def test_temperature_is_captured_after_the_warper(tmp_path):
    trainer, _ = train(tmp_path, integrated=True, steps=2, temperature=0.7)
    rows = read(tmp_path / "run", "sum(sum_abs_lr) / sum(n_tokens), max(max_abs_lr), sum(n_tokens)")
    assert len(rows) == 2
    for _, mean_abs, max_abs, n in rows:
        assert n > 0 and mean_abs < 1e-6 and max_abs < 1e-4            # rounding, not 0.06
    assert float(trainer.mismatch_hook.last_batch.sampler_logprobs.min()) < -1.0


def test_top_k_truncation_shows_its_log_s_fingerprint(tmp_path):
    K = 5
    trainer, _ = train(tmp_path, integrated=True, steps=2, top_k=K, learning_rate=0.0)
    for _, max_lr, mean_lr in read(tmp_path / "run", "max(max_lr), sum(sum_lr) / sum(n_tokens)"):
        assert max_lr < 1e-5 and mean_lr < -0.3          # lr = log S <= 0 on every token
    net = trainer.model.eval()
    checked = 0
    for micro in trainer._buffered_inputs:               # the last generation's micro-batches
        ids = torch.cat([micro["prompt_ids"], micro["completion_ids"]], dim=1)
        mask = torch.cat([micro["prompt_mask"], micro["completion_mask"]], dim=1)
        P, C = micro["prompt_ids"].shape[1], micro["completion_ids"].shape[1]
        with torch.no_grad():
            logits = net(input_ids=ids, attention_mask=mask).logits[:, P - 1:P - 1 + C].double()  # [B, C, V]
        logp = torch.log_softmax(logits, dim=-1)
        token = micro["completion_ids"]
        pi = logp.gather(-1, token[..., None])[..., 0]
        log_s = torch.logsumexp(logp.topk(K, dim=-1).values, dim=-1)      # log of the kept mass
        in_top = (logp.topk(K, dim=-1).indices == token[..., None]).any(-1)
        keep = micro["completion_mask"].bool()
        assert in_top[keep].all()                          # top-k sampled only kept tokens
        mu = micro[SAMPLER_KEY].double()
        err = (mu - (pi - log_s))[keep].abs()
        assert float(err.max()) < 1e-4, float(err.max())
        assert float((-log_s[keep]).min()) > 0.05          # truncation really renormalised
        checked += int(keep.sum())
    assert checked > 0


def test_continuous_batching_is_refused_at_attach_time(tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=1, report_to=[], bf16=False, use_cpu=True,
                      save_strategy="no", use_transformers_continuous_batching=True)
    collector = MismatchCollector(tmp_path / "run")
    with pytest.raises(ValueError, match="use_transformers_continuous_batching=True.*log no step"):
        MismatchGRPOTrainer(model=model(), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                            args=args, train_dataset=Dataset.from_dict({"prompt": ["w1 w2"] * 4}),
                            processing_class=tokenizer(), mismatch_collector=collector)
    collector.close()


def test_trl_versions_are_checked_with_the_supported_range_named(caplog):
    from trl import GRPOTrainer

    assert trl_compat.signature_problems(GRPOTrainer) == []     # the installed TRL matches
    with caplog.at_level(logging.WARNING, logger="mismatch_monitor"):
        trl_compat.check_trl("1.99.0", GRPOTrainer)
    assert any("outside the tested TRL >= 1.16, < 1.17" in r.getMessage() for r in caplog.records)

    class Changed(GRPOTrainer):
        def _generate_single_turn(self, prompts, num_generations):     # a TRL with another signature
            raise AssertionError

    with pytest.raises(RuntimeError, match=r"supports TRL >= 1.16, < 1.17.*_generate_single_turn\(prompts, "
                                           r"num_generations\)"):
        trl_compat.check_trl("1.20.0", Changed)
