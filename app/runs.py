"""Which runs the dashboard may open: the runs root, and the runs under it.

The dashboard serves one *runs root* (``mismatch-monitor dashboard RUNS_ROOT``). A run is named by
its path relative to the root (usually its directory name); a name or path that resolves outside
the root, symbolic links included, is refused with :class:`RunOutsideRoot`. Nothing here imports
Streamlit, so the rules are tested as plain functions.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Mapping, Sequence

from mismatch_monitor.store import RUN_FILE, RunNotFound, find_runs

ROOT_ENV = "MISMATCH_MONITOR_RUNS_ROOT"
ROOT_ARG = "--runs-root"


class RunOutsideRoot(PermissionError):
    """A run path that resolves outside the configured runs root."""


def default_runs_root(cwd: Path | None = None) -> Path:
    """``./runs`` when it exists, else the project's ``sample_data/`` runs."""
    local = (cwd or Path.cwd()) / "runs"
    if local.is_dir():
        return local.resolve()
    return (Path(__file__).resolve().parent.parent / "sample_data").resolve()


def runs_root_from(argv: Sequence[str], environ: Mapping[str, str]) -> Path:
    """The runs root: ``--runs-root`` in the script arguments, then $MISMATCH_MONITOR_RUNS_ROOT,
    then :func:`default_runs_root`."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument(ROOT_ARG, default=None)
    known, _ = parser.parse_known_args(list(argv))
    chosen = known.runs_root or environ.get(ROOT_ENV) or None
    return Path(chosen).expanduser().resolve() if chosen else default_runs_root()


def list_runs(root: Path) -> dict[str, Path]:
    """Run name -> run directory for every run directly under ``root`` (or ``root`` itself)."""
    root = Path(root).resolve()
    # resolved before the root check: a link inside the root that points out of it is not listed
    resolved = (q.resolve() for q in find_runs(root))
    return {(p.name if p != root else root.name): p for p in resolved if _under(root, p)}


def _under(root: Path, path: Path) -> bool:
    """``path`` (resolved) is ``root`` or lies below it."""
    return path == root or root in path.parents


def resolve_run(root: Path, requested: str) -> Path:
    """The run directory ``requested`` names (relative to ``root``, or absolute).

    Raises :class:`RunOutsideRoot` when it resolves outside ``root`` and
    :class:`~mismatch_monitor.store.RunNotFound` when it is not a run directory.
    """
    root = Path(root).resolve()
    text = str(requested).strip()
    if not text:
        raise RunNotFound("no run named (an empty name)")
    if not text.isprintable():   # a null byte or a control character: no path has it
        raise RunNotFound(f"no run is named {text!r}: a run name has no control characters")
    named = list_runs(root).get(text)
    if named is not None:
        return named
    candidate = Path(text).expanduser()
    candidate = (candidate if candidate.is_absolute() else root / candidate).resolve()
    if not _under(root, candidate):
        # the message is shown in the page: it names no server path
        raise RunOutsideRoot(
            f"refused to open {text!r}: it resolves outside the runs root. "
            f"The dashboard only opens runs under its root; start it with "
            f"`mismatch-monitor dashboard RUNS_ROOT` to serve another directory.")
    if not (candidate / RUN_FILE).is_file():
        raise RunNotFound(f"{text!r} is not a run under the runs root (no {RUN_FILE} there)")
    return candidate


def run_name(root: Path, run_dir: Path) -> str:
    """The name a run directory under ``root`` is shown and linked by."""
    root, run_dir = Path(root).resolve(), Path(run_dir).resolve()
    return root.name if run_dir == root else os.path.relpath(run_dir, root)
