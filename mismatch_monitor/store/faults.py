"""What the writer does while the disk refuses its flushes (full, read-only, gone).

An *episode* runs from the first failed flush to the next one that succeeds (or to close). In it:
- the steps of failed flushes are kept, in order, up to ``max_buffered_steps``; beyond that the
  oldest are dropped and counted (``RunWriter.dropped_steps``), never silently;
- due flushes are retried after a backoff that doubles from ``first`` to ``longest`` seconds
  (an explicit ``flush()`` or ``close()`` tries at once);
- one error opens the episode (the collector counts it and keeps its message), one more error
  says which steps were dropped, if any, when the episode ends; later failures of the same
  episode only count attempts. An episode that dropped nothing ends with one log line instead.
  With the collector, which logs each error it counts, an episode makes two log lines.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

log = logging.getLogger("mismatch_monitor")


@dataclass(frozen=True)
class Backoff:
    """Seconds between retries of a failing flush: ``first``, doubling up to ``longest``."""

    first: float = 1.0
    longest: float = 60.0

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.longest:
            raise ValueError(f"expected 0 < first <= longest, got first={self.first}, longest={self.longest}")


@dataclass
class Episode:
    """One run of failed flushes: when it started, attempts, and the steps dropped in it."""

    started: float
    attempts: int = 1
    dropped: list[int] = field(default_factory=list)

    def dropped_text(self) -> str:
        steps = sorted(self.dropped)
        span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
        return f"{len(steps)} step(s) ({span})"


class WriteFaults:
    """The writer's record of failing flushes (used under the writer's lock)."""

    def __init__(self, backoff: Backoff, clock: Callable[[], float] = time.monotonic) -> None:
        self.backoff = backoff
        self._clock = clock
        self.episode: Episode | None = None
        self.retry_at = 0.0
        self._delay = backoff.first
        self.dropped_total = 0
        self.episodes = 0

    @property
    def failing(self) -> bool:
        return self.episode is not None

    def may_retry(self) -> bool:
        """A due flush may start now (no episode, or its backoff has passed)."""
        return self.episode is None or self._clock() >= self.retry_at

    def failed(self) -> bool:
        """Note a failed flush; True when it opens an episode (its error is then reported)."""
        now = self._clock()
        opened = self.episode is None
        if opened:
            self.episode = Episode(started=now)
            self.episodes += 1
            self._delay = self.backoff.first
        else:
            self.episode.attempts += 1
            self._delay = min(self._delay * 2, self.backoff.longest)
        self.retry_at = now + self._delay
        return opened

    def dropped(self, steps: list[int]) -> None:
        if self.episode is None:          # dropped without a failure: a buffer bound met anyway
            self.episode = Episode(started=self._clock(), attempts=0)
            self.episodes += 1
        self.episode.dropped.extend(steps)
        self.dropped_total += len(steps)

    def recovered(self, written: int, where: str) -> str | None:
        """End the episode after a write succeeded; the dropped-steps message, if any."""
        episode, self.episode = self.episode, None
        if episode is None:
            return None
        if not episode.dropped:            # the episode's second and last line
            log.warning("mismatch-monitor: %s is writable again after %d failed attempt(s) over %.1f s: "
                        "%d kept step(s) written", where, episode.attempts, self._clock() - episode.started,
                        written)
            return None
        return (f"{episode.dropped_text()} were dropped while {where} could not be written "
                f"(the writer keeps at most max_buffered_steps unwritten steps, the oldest go first)")

    def gave_up(self, steps: list[int], where: str) -> str | None:
        """At close: the steps that could not be written are dropped; the message (None if none)."""
        if steps:
            self.dropped(steps)
        episode, self.episode = self.episode, None
        if episode is None or not episode.dropped:
            return None
        return (f"{episode.dropped_text()} were dropped: {where} could not be written "
                f"({episode.attempts} failed attempt(s)) and the writer was closed")
