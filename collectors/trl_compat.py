"""Which TRL the integration works with, checked when a trainer is built, not at step 1.

The integration overrides private methods of ``GRPOTrainer``; a TRL whose signatures differ would
fail at the first step with a ``TypeError`` deep inside training, or, worse, capture nothing.
:func:`check_trl` runs in the trainer's ``__init__`` and says what is supported instead.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from packaging.version import Version

log = logging.getLogger("mismatch_monitor")

# tested: TRL 1.16 (with transformers 5); a version outside this range is accepted only when the
# private methods the integration wraps still take the arguments it passes (then with a warning)
SUPPORTED_TRL = (Version("1.16"), Version("1.17"))
SUPPORTED_TEXT = "TRL >= 1.16, < 1.17 (tested with 1.16)"

# method -> the parameters the integration passes or reads
WRAPPED: dict[str, tuple[str, ...]] = {
    "_generate_single_turn": ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
    "_generate_and_score_completions": ("inputs",),
    "_get_per_token_logps_and_entropies": ("model", "input_ids", "attention_mask", "logits_to_keep"),
    "_compute_loss": ("model", "inputs"),
    "log": ("logs", "start_time"),
}


def signature_problems(trainer_class: type) -> list[str]:
    """What differs between ``trainer_class``'s wrapped methods and what the integration expects."""
    problems = []
    for name, wanted in WRAPPED.items():
        method = getattr(trainer_class, name, None)
        if method is None:
            problems.append(f"{name} is missing")
            continue
        have = list(inspect.signature(method).parameters)[1:]     # without self
        if tuple(have[:len(wanted)]) != wanted:
            problems.append(f"{name}({', '.join(have)}) where ({', '.join(wanted)}) is expected")
    return problems


def check_trl(version: str, trainer_class: type) -> None:
    """Raise ``RuntimeError`` for a TRL the integration cannot work with; warn for an untested
    one whose signatures still match."""
    problems = signature_problems(trainer_class)
    low, high = SUPPORTED_TRL
    in_range = low <= Version(version) < high
    if problems:
        raise RuntimeError(
            f"mismatch-monitor's TRL integration supports {SUPPORTED_TEXT}; TRL {version} is installed "
            f"and its GRPOTrainer differs: {'; '.join(problems)}. Install a supported TRL, or log steps "
            "yourself with MismatchCollector.log_step / StepHook")
    if not in_range:
        log.warning("mismatch-monitor: TRL %s is outside the tested %s; the wrapped GRPOTrainer methods "
                    "still match, so the integration is attached", version, SUPPORTED_TEXT)


def check_generation(args: Any, *, use_vllm: bool) -> None:
    """Refuse generation paths that give the monitor no sampler log-probs (it would log nothing)."""
    if not use_vllm and getattr(args, "use_transformers_continuous_batching", False):
        raise ValueError(
            "use_transformers_continuous_batching=True: transformers' generate_batch returns no "
            "log-probs and runs its own sampling loop, so the integration would log no step at all. "
            "Use the regular generation path (use_transformers_continuous_batching=False) or vLLM "
            "(use_vllm=True), whose log-probs TRL keeps")
