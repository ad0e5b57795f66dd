"""Supervised warm start: a few hundred teacher-forced steps on reference dialogues.

RL for language models starts from a pretrained model, never from random weights; the toy
does the same, so that GRPO has a policy with non-trivial reward to improve and the sampler
sees the peaked next-token distributions under which rounding matters.
"""

from __future__ import annotations

import torch

from .task import StringTask
from .tokenizer import CharTokenizer


def demonstration_batch(task: StringTask, tokenizer: CharTokenizer, n: int,
                        generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` reference dialogues, right-padded: ids ``[n, T]`` and answer mask ``[n, T]``."""
    pairs = [task.demonstration(ep, tokenizer) for ep in task.sample(n, generator, tokenizer.alphabet)]
    T = max(len(ids) for ids, _ in pairs)
    ids = torch.full((n, T), tokenizer.pad_id, dtype=torch.int64)
    mask = torch.zeros((n, T), dtype=torch.bool)
    for i, (row, answer) in enumerate(pairs):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(answer)] = torch.tensor(answer, dtype=torch.bool)
    return ids, mask


def warm_start(model: torch.nn.Module, task: StringTask, tokenizer: CharTokenizer, *, steps: int,
               batch_size: int, learning_rate: float, generator: torch.Generator) -> float:
    """Train ``model`` in place by cross-entropy on answer tokens; returns the last loss."""
    if steps == 0:
        return float("nan")
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1.0 - k / steps)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        ids, mask = demonstration_batch(task, tokenizer, batch_size, generator)
        logits = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_id).long()).logits
        # position p predicts token p + 1
        loss = torch.nn.functional.cross_entropy(logits[:, :-1][mask[:, 1:]].float(), ids[:, 1:][mask[:, 1:]])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    model.eval()
    return float(loss.detach())
