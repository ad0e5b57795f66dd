"""What a user attaches to training: the collector and framework integrations."""

from .collector import MismatchCollector, flatten_report

__all__ = ["MismatchCollector", "flatten_report"]
