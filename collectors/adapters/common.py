"""What the framework adapters share: field access, labels, turns, per-sequence values, routing rows.

Conventions every adapter follows (stated once, here):

* **Tokens**: only the tokens a framework trains on (its loss/response mask) enter the batch;
  prompt, padding and tool/observation tokens never do.
* **Advantages**: the batch takes one advantage per sequence, the mean over its trained tokens.
  Outcome-level estimators (GRPO, RLOO, REINFORCE++) broadcast one value per sequence, so this is
  that value; for token-level estimators (GAE) it is the sequence's mean advantage.
* **Turns** (multi-turn agents, opt-in with ``turns=True``): a turn is one run of trained
  tokens; turn ``k`` holds the tokens of the ``k``-th run, counted from 0 (tool output between
  runs is not trained on).
* **Routing**: a token's routing decisions are those of the position that produced it (the
  hidden state one position earlier), for both sides, whatever layout the framework ships.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import torch

from mismatch_monitor.batch import BatchError, TokenBatch

Labels = Mapping[str, "str | Sequence[str]"]


def get(container: Any, key: str) -> Any:
    """``container[key]`` for mappings (dict, TensorDict), ``container.key`` otherwise; None if absent."""
    if isinstance(container, Mapping) or hasattr(container, "keys"):
        try:
            return container[key] if key in container.keys() else None
        except (KeyError, TypeError):
            return None
    return getattr(container, key, None)


def require(container: Any, key: str, framework: str, hint: str = "") -> Any:
    value = get(container, key)
    if value is None:
        if hasattr(container, "keys"):
            keys = sorted(map(str, container.keys()))
        else:
            keys = sorted(k for k, v in vars(container).items() if v is not None and not k.startswith("_"))
        raise BatchError(f"expected {framework} batch key {key!r}{hint}, got keys {keys}")
    return value


def tensor(value: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    return t if dtype is None else t.to(dtype)


def sequence_labels(labels: Labels | None, num_sequences: int, **per_sequence: Any) -> dict[str, list[str]]:
    """Labels per sequence: a string in ``labels`` applies to every sequence, a sequence is taken
    as is; ``per_sequence`` holds dims read from the framework's own fields (None = absent)."""
    out: dict[str, list[str]] = {}
    for dim, values in per_sequence.items():
        if values is not None:
            out[dim] = [str(v) for v in (values.tolist() if hasattr(values, "tolist") else values)]
    for dim, value in (labels or {}).items():
        out[dim] = [value] * num_sequences if isinstance(value, str) else [str(v) for v in value]
    return out


def turn_index(trained: torch.Tensor) -> torch.Tensor:
    """[B, T] turn of every token: 0 for the first run of trained tokens, 1 for the second, ..."""
    m = trained.bool()
    starts = m & ~torch.nn.functional.pad(m, (1, 0))[:, :-1]      # a run begins here
    return (starts.long().cumsum(1) - 1).clamp(min=0)


def sequence_mean(values: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """[B] mean of ``values`` [B, T] over each sequence's trained tokens (0 when it has none)."""
    w = trained.to(torch.float64)
    return (values.to(torch.float64) * w).sum(1) / w.sum(1).clamp(min=1.0)


def padded_batch(trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, *,
                 labels: dict[str, list[str]], turns: bool, advantages: Any,
                 policy_version: torch.Tensor | None, trainer_version: int | None,
                 **per_token: torch.Tensor | None) -> TokenBatch:
    """The padded TokenBatch every [B, T] adapter ends with: turns from runs of trained tokens,
    per-token advantages averaged over each sequence's trained tokens."""
    return TokenBatch.from_padded(
        trainer, sampler, mask,
        labels=labels,
        turn_index=turn_index(mask) if turns else None,
        policy_version=policy_version, trainer_version=trainer_version,
        advantages=None if advantages is None else sequence_mean(tensor(advantages), mask),
        **per_token,
    )


def producing_rows(experts: torch.Tensor, first_token: torch.Tensor | int, length: int) -> torch.Tensor:
    """Routing rows of a response window.

    experts: [B, S, L, K] ids per position of the full sequence; first_token: [B] (or one int)
    absolute position of response token 0; returns [B, length, L, K] where entry t holds the
    row of position ``first_token + t - 1``, the one whose hidden state produced token t.
    """
    B, S = experts.shape[:2]
    start = torch.as_tensor(first_token, dtype=torch.int64).expand(B)
    rows = (start[:, None] + torch.arange(length)[None, :] - 1).clamp(0, S - 1)   # [B, length]
    return torch.gather(experts, 1, rows[:, :, None, None].expand(-1, -1, *experts.shape[2:]))
