"""A short fingerprint of a set of named weight tensors, to tell which weights a pool holds.

A weight sync that "succeeds" can still leave a sampler on the wrong weights: a stale buffer
sent again, the reference model pushed instead of the policy, a resume that loaded an old
checkpoint. The trainer fingerprints each version it pushes; the receiving side fingerprints
the tensors it loaded (``fingerprinted`` wraps the iterator a ``load_weights`` /
``reload_weights`` call consumes); ``MismatchCollector.log_event("weight_sync", ...,
fingerprint=received, trainer_fingerprint=sent)`` compares them at the sync step, before a
single token was sampled on those weights (``collectors/fingerprints.py`` says what is done
with a difference).

The fingerprint is SHA-256 over, per tensor in name order, its name, dtype, shape and the bytes
of ``sample`` of its elements (the flattened tensor at ``sample`` evenly spaced positions, all
of them when it has no more; ``sample=None``: every element). Both sides must fingerprint the
same form (the same dtype and names: what goes over the wire), since a bf16 copy of fp32 weights
is a different set of numbers. What it can miss, stated: two weight sets that differ only at
positions it does not read (with the default 4,096 positions per tensor, a change confined to a
few rows of a large matrix can fall between them; an optimizer step or a different checkpoint
changes nearly every element, so it cannot). Cost: one gather of at most ``sample`` elements per
tensor and one copy of them to the host (about 1 ms per 100 tensors here).
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Iterator, Mapping

import torch

SAMPLE = 4096
PREFIX = "sha256:"


def _tensor_digest(name: str, tensor: torch.Tensor, sample: int | None) -> bytes:
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    if sample is not None and n > sample:
        positions = torch.arange(sample, dtype=torch.int64, device=flat.device) * n // sample
        flat = flat.index_select(0, positions)
    data = flat.contiguous().cpu()
    if data.dtype == torch.bool:
        data = data.to(torch.uint8)
    raw = data.view(torch.uint8) if data.numel() else data.to(torch.uint8)
    head = f"{name}\0{str(tensor.dtype).removeprefix('torch.')}\0{tuple(tensor.shape)}\0".encode()
    return hashlib.sha256(head + raw.numpy().tobytes()).digest()


class Fingerprint:
    """Accumulates tensors in any order; :meth:`hexdigest` is the same for the same named set."""

    def __init__(self, sample: int | None = SAMPLE) -> None:
        if sample is not None and not (isinstance(sample, int) and sample >= 1):
            raise ValueError(f"expected sample to be an integer >= 1 or None (every element), got {sample!r}")
        self.sample = sample
        self._digests: dict[str, bytes] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if not isinstance(name, str):
            raise TypeError(f"expected a tensor name (str), got {type(name).__name__} {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor for {name!r}, got {type(tensor).__name__}")
        if name in self._digests:
            raise ValueError(f"tensor {name!r} given twice: a fingerprint names each tensor once")
        self._digests[name] = _tensor_digest(name, tensor, self.sample)

    def hexdigest(self) -> str:
        if not self._digests:
            raise ValueError("no tensors were fingerprinted")
        whole = hashlib.sha256()
        for name in sorted(self._digests):
            whole.update(self._digests[name])
        return PREFIX + whole.hexdigest()


def weights_fingerprint(weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                        sample: int | None = SAMPLE) -> str:
    """The fingerprint of a state dict or of ``(name, tensor)`` pairs (order does not matter)."""
    pairs = weights.items() if isinstance(weights, Mapping) else weights
    fp = Fingerprint(sample)
    for name, tensor in pairs:
        fp.add(name, tensor)
    return fp.hexdigest()


def fingerprinted(weights: Iterable[tuple[str, torch.Tensor]], into: Fingerprint) -> Iterator[tuple[str, torch.Tensor]]:
    """The same ``(name, tensor)`` pairs, each added to ``into`` as it passes (the receiving side
    of a sync: wrap the iterator the engine's weight loader consumes, then ``into.hexdigest()``)."""
    for name, tensor in weights:
        into.add(name, tensor)
        yield name, tensor
