"""TRL's vLLM colocate mode on a CPU: the weight sync that works there.

TRL's colocate sync calls ``load_weights`` on the engine's model through
``llm_engine.model_executor.driver_worker.model_runner``; vLLM's CPU worker has no such path and
loading weights after start-up does not work on the CPU, so the first sync of a GRPO run fails.
:func:`fix_colocate_sync` replaces that one method, on the CPU only, with the sync vLLM supports
there: ``collective_rpc("reload_weights", kwargs={"weights_iterator": ...})`` over the same named
parameters TRL would send (TRL's own iterator, so PEFT / FSDP name handling is kept), then
``reset_prefix_cache()``. Elsewhere TRL's sync is left alone.

    trainer = MismatchGRPOTrainer(..., args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...))
    fix_colocate_sync(trainer)          # True where it was applied
"""

from __future__ import annotations

from typing import Any


def needs_reload_sync(trainer: Any) -> bool:
    """Whether ``trainer`` syncs a colocated vLLM engine running on the CPU."""
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None or getattr(generation, "mode", None) != "colocate":
        return False
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def fix_colocate_sync(trainer: Any) -> bool:
    """Replace TRL's colocate weight sync with reload_weights + reset_prefix_cache where it fails
    (a CPU engine); returns whether it did."""
    if not needs_reload_sync(trainer):
        return False
    generation = trainer.vllm_generation

    def sync_weights() -> None:
        weights = ((name, param.detach()) for name, param in generation._iter_named_params())
        generation.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        generation.llm.reset_prefix_cache()

    generation.sync_weights = sync_weights
    return True
