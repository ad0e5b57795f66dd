"""TRL's training outcomes and weight syncs in the run (``MismatchGRPOTrainer`` adds both).

* **outcomes**: TRL's log lines (``on_log``) carry ``loss`` and ``grad_norm`` (transformers),
  ``reward``, ``entropy`` and each reward function's ``rewards/<name>/mean`` (TRL); they are
  stored as outcomes of the ``global_step`` they are logged at, the step the mismatch statistics
  of that optimizer step are logged under. With ``logging_steps=1`` each is that step's value;
  with ``logging_steps=N`` it is TRL's own mean over the steps since its last log line, stored at
  the step of the line (the run cannot split it back into steps). Evaluation lines
  (``eval_reward`` ...) are stored as ``eval_<name>``.
* **weight syncs**: TRL pushes the trainer's weights to vLLM when ``global_step`` moved since its
  last push (``_last_loaded_step``); each push is a ``weight_sync`` event of version
  ``global_step`` at step ``global_step + 1``: the first optimizer step whose batches it samples.
"""

from __future__ import annotations

from typing import Any, Mapping

from transformers import TrainerCallback

# TRL's log key -> outcome name; reward functions' means are added by :func:`trl_outcomes`
OUTCOME_KEYS: dict[str, str] = {"loss": "loss", "grad_norm": "grad_norm", "reward": "reward",
                                "entropy": "entropy"}
_REWARD_FN = ("rewards/", "/mean")   # rewards/<name>/mean -> reward/<name>


def trl_outcomes(logs: Mapping[str, Any]) -> dict[str, float]:
    """The outcomes of one TRL log line (train or ``eval_``), by outcome name."""
    out: dict[str, float] = {}
    for prefix in ("", "eval_"):
        for key, name in OUTCOME_KEYS.items():
            value = logs.get(prefix + key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[prefix + name] = float(value)
        head, tail = prefix + _REWARD_FN[0], _REWARD_FN[1]
        for key, value in logs.items():
            if key.startswith(head) and key.endswith(tail) and isinstance(value, (int, float)):
                out[f"{prefix}reward/{key[len(head):-len(tail)]}"] = float(value)
    return out


class TrainingOutcomes(TrainerCallback):
    """Stores each TRL log line's outcomes through ``collector.log_outcomes`` (a non-finite one,
    a loss or gradient norm that blew up, is counted and kept as a collector error)."""

    def __init__(self, collector: Any) -> None:
        self.collector = collector

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        values = trl_outcomes(logs or {})
        if values:
            self.collector.log_outcomes(int(state.global_step), values)


def record_weight_sync(collector: Any, trainer: Any, loaded_before: int | None, pool: str | None) -> None:
    """Record TRL's push to vLLM when ``_last_loaded_step`` moved during a generation."""
    loaded = getattr(trainer, "_last_loaded_step", None)
    if loaded is None or loaded == loaded_before or loaded < 0 or not hasattr(collector, "log_event"):
        return
    mode = getattr(getattr(trainer, "vllm_generation", None), "mode", None) or getattr(trainer.args, "vllm_mode", "")
    collector.log_event("weight_sync", step=int(loaded) + 1, pool=pool, version=int(loaded),
                        message=f"TRL pushed the trainer's weights of step {loaded} to vLLM ({mode})")
