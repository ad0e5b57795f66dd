"""TRL GRPO step time with and without the mismatch integration, on CPU, one torch thread.

    python benchmarks/bench_trl.py [--steps 12] [--hidden 32 128] [--completion 16]

The same tiny Llama (built from a config), tokenizer, data and seed are trained three ways:
``GRPOTrainer`` (plain); ``MismatchGRPOTrainer`` logging into a sink that only counts tokens
(capture: the logits processor, the trainer-side capture and micro-batch concatenation); and
``MismatchGRPOTrainer`` with a real collector (default flushing: every 100 steps or 10 s). A step
is timed from one ``on_step_end`` to the next, so it includes generation, scoring, the update
and our end-of-step logging; the first two steps are warm-up. Printed: median step times and
their ratios to plain, measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback
from transformers.utils import logging as hf_logging
from trl import GRPOConfig, GRPOTrainer

from mismatch_monitor.collectors.collector import MismatchCollector
from mismatch_monitor.collectors.trl import MismatchGRPOTrainer

WORDS = [f"w{i}" for i in range(200)]
VOCAB = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}


class CountingSink:
    """Receives each step's batch and only counts its tokens: isolates the capture's cost."""

    strict = False

    def __init__(self) -> None:
        self.tokens = 0

    def log_step(self, step, batch=None, **fields):
        self.tokens += batch.num_tokens
        return {}


class StepClock(TrainerCallback):
    def __init__(self) -> None:
        self.ends: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.ends.append(time.perf_counter())


def run(mode: str, hidden: int, steps: int, completion: int, tmp: Path) -> list[float]:
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=0, eos_token_id=1, bos_token_id=None, tie_word_embeddings=True))
    args = GRPOConfig(output_dir=str(tmp / "out"), per_device_train_batch_size=8, num_generations=8,
                      gradient_accumulation_steps=2, max_completion_length=completion, max_steps=steps,
                      logging_steps=1, report_to=[], bf16=False, use_cpu=True, save_strategy="no", seed=0,
                      disable_tqdm=True)
    dataset = Dataset.from_dict({"prompt": [" ".join(WORDS[i:i + 4]) for i in range(64)]})
    common = dict(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                  args=args, train_dataset=dataset, processing_class=tokenizer)
    clock = StepClock()
    collector = None
    if mode == "plain":
        trainer = GRPOTrainer(**common)
    elif mode == "capture":
        trainer = MismatchGRPOTrainer(**common, mismatch_collector=CountingSink())
    else:
        collector = MismatchCollector(tmp / "run")
        trainer = MismatchGRPOTrainer(**common, mismatch_collector=collector)
    for quiet in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(quiet)
    trainer.add_callback(clock)
    trainer.train()
    if collector is not None:
        collector.close()
    return [b - a for a, b in zip(clock.ends[1:], clock.ends[2:])]    # drop two warm-up steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--hidden", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--completion", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    hf_logging.set_verbosity_error()
    print(f"GRPO on CPU, 1 thread: 16 completions of <= {args.completion} tokens per step "
          f"(2 micro-batches of 8); median over {args.steps - 2} steps")
    print(f"{'hidden':>7} {'plain s/step':>13} {'capture s/step':>15} {'ratio':>6} "
          f"{'collector s/step':>17} {'ratio':>6}")
    for hidden in args.hidden:
        with tempfile.TemporaryDirectory() as d:
            t = {mode: statistics.median(run(mode, hidden, args.steps, args.completion, Path(d) / mode))
                 for mode in ("plain", "capture", "collector")}
        print(f"{hidden:>7} {t['plain']:>13.4f} {t['capture']:>15.4f} {t['capture'] / t['plain']:>6.2f} "
              f"{t['collector']:>17.4f} {t['collector'] / t['plain']:>6.2f}")


if __name__ == "__main__":
    main()
