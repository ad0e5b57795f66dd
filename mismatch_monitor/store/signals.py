"""Flushing when training stops without close(): on SIGTERM/SIGINT, and in a pause.

SIGTERM is what schedulers send before a kill. The writer installs a handler (only from the main
thread, where Python runs handlers) that writes what is buffered, within ``seconds``, and then
calls the handler that was installed before it: the user's own, Python's (SIGINT raises
KeyboardInterrupt), or the default action (SIGTERM then ends the process by the same signal, as
it would have without us). An ignored signal stays ignored. A handler is never replaced: on close
the previous one is put back only if ours is still the one installed; otherwise ours stays in the
chain and passes the signal on.

A signal that arrives while the main thread is inside the writer (its lock held, its buffer half
updated) is acted on when the main thread leaves it (:class:`DeferringLock`).

:class:`FlushTimer` flushes every ``seconds`` whether or not a step arrives, so a pause in training
does not leave steps in memory.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import weakref
from types import FrameType
from typing import Any, Callable

log = logging.getLogger("mismatch_monitor")

SIGNALS = (signal.SIGTERM, signal.SIGINT)
Handler = Callable[[int, FrameType | None], Any] | int | None


class DeferringLock:
    """A re-entrant lock that knows when the main thread is inside it, so that a signal handler
    (which runs on the main thread, between any two bytecodes) can wait for it to leave."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._main_depth = 0
        self.deferred: list[Callable[[], None]] = []

    def __enter__(self) -> "DeferringLock":
        self._lock.acquire()
        if threading.current_thread() is threading.main_thread():
            self._main_depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        run: list[Callable[[], None]] = []
        if threading.current_thread() is threading.main_thread():
            self._main_depth -= 1
            if self._main_depth == 0 and self.deferred:
                run, self.deferred = self.deferred, []
        self._lock.release()
        for fn in run:
            fn()

    @property
    def main_inside(self) -> bool:
        """Called on the main thread: is it inside the lock (interrupted there by a signal)?"""
        return self._main_depth > 0


def _chain(previous: Handler, signum: int, frame: FrameType | None) -> None:
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_DFL or previous is None:
        signal.signal(signum, signal.SIG_DFL)     # the default action: end by this signal
        os.kill(os.getpid(), signum)
    # SIG_IGN: ignored before us, ignored now


class SignalFlush:
    """Installs the chained handlers for one writer (held weakly: it may be collected)."""

    def __init__(self, writer: Any, lock: DeferringLock, seconds: float) -> None:
        self._writer = weakref.ref(writer)
        self._lock = lock
        self._seconds = seconds
        self._previous: dict[int, Handler] = {}
        self.active = False
        if threading.current_thread() is not threading.main_thread():
            return                                  # signal.signal works on the main thread only
        for sig in SIGNALS:
            self._previous[sig] = signal.getsignal(sig)
            signal.signal(sig, self._handle)
        self.active = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._lock.main_inside:                  # finish what the main thread was doing first
            self._lock.deferred.append(lambda: self._flush_and_chain(signum, None))
            return
        self._flush_and_chain(signum, frame)

    def _flush_and_chain(self, signum: int, frame: FrameType | None) -> None:
        writer = self._writer()
        if self.active and writer is not None and not writer.closed:
            self.flush_within(writer, signum)
        _chain(self._previous.get(signum, signal.SIG_DFL), signum, frame)

    def flush_within(self, writer: Any, signum: int) -> None:
        """Write what is buffered on a helper thread; give up waiting after ``seconds``."""
        pending = writer.pending_steps
        done = threading.Event()

        def run() -> None:
            try:
                writer.flush(raise_errors=False)
            except Exception:  # noqa: BLE001 - a handler must reach the chained one
                log.exception("mismatch-monitor: the flush on signal %d failed", signum)
            finally:
                done.set()

        helper = threading.Thread(target=run, name="mismatch-monitor-signal-flush", daemon=True)
        helper.start()
        if done.wait(self._seconds):
            # let it end before the signal is passed on: a daemon thread still running when the
            # interpreter exits (KeyboardInterrupt, or SIGTERM's default action) can abort it
            helper.join(self._seconds)
            log.warning("mismatch-monitor: %s: wrote %d buffered step(s) of %s before passing the signal on",
                        signal.Signals(signum).name, pending - writer.pending_steps, writer.run_dir)
        else:
            log.error("mismatch-monitor: %s: the flush of %s did not finish within %.1f s; %d step(s) "
                      "may be lost", signal.Signals(signum).name, writer.run_dir, self._seconds,
                      writer.pending_steps)

    def uninstall(self) -> None:
        """Put the previous handlers back where ours is still installed (else stay a link)."""
        if not self.active:
            return
        self.active = False
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, previous in self._previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


class FlushTimer:
    """A daemon thread that calls ``writer.flush_if_due()`` every ``seconds`` (held weakly)."""

    def __init__(self, writer: Any, seconds: float) -> None:
        self._stop = threading.Event()
        ref = weakref.ref(writer)

        def loop() -> None:
            while not self._stop.wait(seconds):
                w = ref()
                if w is None or w.closed:
                    return
                try:
                    w.flush_if_due()
                except Exception:  # noqa: BLE001 - errors of flushes are kept by the writer
                    log.exception("mismatch-monitor: the timed flush of %s failed", w.run_dir)
                del w

        self._thread = threading.Thread(target=loop, name="mismatch-monitor-flush-timer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
