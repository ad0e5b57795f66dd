"""Multi-rank training: one exact global view, written by one rank.

Each rank computes the sufficient statistics of its own share of the step (whole sequences:
a rank never holds part of a sequence), and :class:`DistributedReducer` gathers them to the
writer rank, which merges them as :func:`mismatch_monitor.engine.merge` does: counts, sums and
histogram bins add, minima and maxima take the min and max. Only the writer rank creates the
run store; give it the Prometheus exporter as well (``reducer.is_writer``).

    dist.init_process_group("nccl")                      # or gloo
    reducer = DistributedReducer(exemplars_k=16)
    collector = MismatchCollector(run_dir, reducer=reducer, exemplars_k=16,
                                  exporter=exporter if reducer.is_writer else None)

Exactness: integer columns (token and sequence counts, histogram bins, flip counts), minima and
maxima of the merged view equal those of one process on the concatenated data exactly; float64
sums equal them up to summation order, a relative difference of at most about
``(ranks + 1) * 2**-53`` times the sum of absolute values. Quantiles read from the merged
histograms are therefore exact reproductions of the single-process ones.

Every shard carries its step and, when the rank's batch was rejected, that error's class and
text. The writer merges only shards of its own step: a rank that skipped a ``log_step`` (its
shard is of another step) is refused loudly, never merged into the wrong step, and every shard
left out (refused here, or rejected on its own rank) is returned by :meth:`take_rejections` for
the collector to count and to record in the run's ``errors`` table.

Exemplars are the global top K (largest |lr| tokens, largest max |lr| sequences). Their
``seq_index`` is the sequence's index within the batch of the rank in their ``rank`` column.

The statistics travel packed (``rank_payload.py``: numpy columns, each table's cells once with
their labels as codes into a label dictionary), one ``gather_object`` per step; packing is all a
rank does besides the collective. The writer merges the W shards with one concatenation and one
group-by per table (``rank_merge.py``), equal bit for bit to ``engine.merge`` of the parts; see
``benchmarks/bench_merge.py`` (the merge, W = 2..64) and ``benchmarks/bench_distributed.py``
(the collective, gloo).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import pandas as pd
import torch.distributed as dist

from mismatch_monitor.engine import MismatchStats
from .rank_exemplars import PackedFrame, pack_exemplars, top_exemplars
from .rank_merge import merge_packed
from .rank_payload import PackedStats, pack

Exemplars = dict[str, pd.DataFrame]


class Shard(NamedTuple):
    """What one rank sends for one step."""

    step: int | None
    tables: PackedStats | dict[str, pd.DataFrame]   # packed as sent; frames are packed on merging
    dims: tuple[str, ...]
    exemplars: dict[str, PackedFrame] | Exemplars    # packed as sent (with the rank column), or frames
    rank: int
    error: tuple[str, str] | None = None     # (exception class, message) of a rejected batch
    params: tuple | None = None              # MismatchStats.params: ranks of other configs do not merge


class Rejection(NamedTuple):
    """A shard left out of the writer's step, and why."""

    rank: int
    step: int | None
    kind: str
    message: str


def distributed_world() -> int:
    """The world size of the initialised default process group; 1 without one."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def launched_world() -> int:
    """How many processes a launcher (torchrun, accelerate, ...) says it started (``WORLD_SIZE``)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


class DistributedReducer:
    """Reduces per-rank statistics to the writer rank (``dst``), exactly.

    Args:
        group: the process group of the ranks that share a step (default: the world).
        dst: global rank that merges and writes (default 0).
        exemplars_k: how many exemplars of each kind to keep; use the collector's ``exemplars_k``.
        all_ranks: give every rank the global view (an all-gather) instead of the writer only.
            Without it, other ranks get their own statistics back, so their ``log_step`` report
            describes their share of the step.
    """

    def __init__(self, *, group: Any = None, dst: int = 0, exemplars_k: int = 16,
                 all_ranks: bool = False) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "expected torch.distributed to be initialised (dist.init_process_group) before "
                "building a DistributedReducer, got an uninitialised default process group")
        if exemplars_k < 0:
            raise ValueError(f"expected exemplars_k >= 0, got {exemplars_k}")
        world = dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        if dst not in ranks:
            raise ValueError(f"expected dst to be a rank of the group {ranks}, got {dst}")
        self.group = group
        self.dst = dst
        self.exemplars_k = exemplars_k
        self.all_ranks = all_ranks
        self.rank = dist.get_rank()
        self.world_size = world
        self._rejections: list[Rejection] = []

    @property
    def is_writer(self) -> bool:
        """True on the one rank that merges, writes the run store and should serve /metrics."""
        return self.rank == self.dst

    def __call__(self, stats: MismatchStats, exemplars: Exemplars, *, step: int | None = None,
                 error: BaseException | None = None) -> tuple[MismatchStats, Exemplars]:
        """Merge this step's shards (``error``: why this rank's own batch was rejected; it then
        sends empty statistics so that no rank waits)."""
        payload = shard(stats, exemplars, self.rank, step=step, error=error)
        if self.all_ranks:
            parts: list[Any] = [None] * self.world_size
            dist.all_gather_object(parts, payload, group=self.group)
        else:
            parts = [None] * self.world_size if self.is_writer else None
            dist.gather_object(payload, parts, dst=self.dst, group=self.group)
            if not self.is_writer:
                return stats, {name: df.assign(rank=self.rank) for name, df in exemplars.items()}
        merged, exemplars, rejected = merge_parts(parts, self.exemplars_k, step=step)
        if self.is_writer:
            self._rejections.extend(r for r in rejected if r.rank != self.rank)   # its own is noted
        return merged, exemplars

    def take_rejections(self) -> list[Rejection]:
        """Shards of other ranks left out of the steps merged since the last call (writer only)."""
        out, self._rejections = self._rejections, []
        return out


def shard(stats: MismatchStats, exemplars: Exemplars, rank: int, *, step: int | None = None,
          error: BaseException | None = None) -> Shard:
    """What a rank sends: its statistics and exemplars packed, each exemplar with its rank (an
    exemplar's seq_index counts within its own rank's batch)."""
    return Shard(step, pack(stats), tuple(stats.dims), pack_exemplars(exemplars, rank), rank,
                 None if error is None else (type(error).__name__, str(error)), stats.params)


def merge_parts(parts: list[Shard], exemplars_k: int, *, step: int | None = None
                ) -> tuple[MismatchStats, Exemplars, list[Rejection]]:
    """Merge the gathered shards of ``step``: statistics exactly, exemplars top K. A shard of
    another step is refused (a rank skipped a ``log_step``); one whose batch was rejected on its
    rank adds nothing. Both are returned as rejections, with their reason."""
    kept, rejected = [], []
    for part in parts:
        if part.step != step:
            rejected.append(Rejection(part.rank, part.step, "StepMismatch",
                                      f"rank {part.rank} sent step {part.step} while the writer merges step "
                                      f"{step}: a rank skipped or repeated a log_step; its shard was not "
                                      "merged into this step"))
        elif part.error is not None:
            rejected.append(Rejection(part.rank, part.step, *part.error))
        else:
            kept.append(part)
    stats = merge_packed([packed(p) for p in kept]) if kept else MismatchStats.empty()
    return stats, top_exemplars([p.exemplars for p in kept], exemplars_k), rejected


def packed(part: Shard) -> PackedStats:
    """A shard's statistics packed (a shard built from frames is packed here)."""
    if isinstance(part.tables, PackedStats):
        return part.tables
    return pack(MismatchStats(part.tables, tuple(part.dims), part.params))
