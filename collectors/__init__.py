"""What a user attaches to training: the collector and framework integrations.

The TRL integration lives in ``mismatch_monitor.collectors.trl`` and is imported on demand (it
pulls in transformers and trl).
"""

from .adapters import nemo_rl_batch, openrlhf_batch, prime_rl_batch, slime_batch, verl_batch
from .aliases import PEER_ALIASES, peer_view
from .collector import MismatchCollector, flatten_report
from .distributed import DistributedReducer
from .step_hook import StepHook, concat_batches

__all__ = ["MismatchCollector", "flatten_report", "StepHook", "concat_batches", "DistributedReducer",
           "PEER_ALIASES", "peer_view", "verl_batch", "openrlhf_batch", "nemo_rl_batch", "slime_batch",
           "prime_rl_batch"]
