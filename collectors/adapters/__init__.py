"""Framework batch adapters: each framework's own batch layout -> :class:`TokenBatch`.

Pure functions, one module per framework, each documenting the framework's key names and the
release range it targets. Feed the result to ``MismatchCollector.log_step`` or a ``StepHook``.

    from mismatch_monitor.collectors.adapters import verl_batch
    collector.log_step(step, verl_batch(batch, labels={"pool": "vllm-bf16"}))
"""

from .nemo_rl import nemo_rl_batch
from .openrlhf import openrlhf_batch
from .prime_rl import prime_rl_batch
from .slime import slime_batch
from .verl import verl_batch, verl_outcomes

__all__ = ["verl_batch", "verl_outcomes", "openrlhf_batch", "nemo_rl_batch", "slime_batch", "prime_rl_batch"]
