"""The ``mismatch-monitor`` command line: one sub-command per module, wired here.

Each sub-command module exposes ``add_arguments(parser)`` and ``run(args) -> int`` and is
imported only when its command runs, so a command's heavy dependencies never slow the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "summary": ("summary", "latest step per pool and the worst slices of a run"),
    "compact": ("compact", "merge a run's small Parquet files, without readers noticing"),
    "export": ("export", "export a metric series as CSV or Parquet"),
    "demo": ("demo", "run the live simulation demo"),
    "sample-data": ("sample_data", "regenerate the runs in sample_data/"),
    "serve": ("serve", "export a run's latest values to Prometheus"),
    "alerts": ("alerts", "render or check the Prometheus alert rules"),
    "dashboard": ("dashboard", "open the Streamlit dashboard on a runs root"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported (``None``: none, for the overview)."""
    parser = argparse.ArgumentParser(
        prog="mismatch-monitor",
        description="See, slice and act on training-inference mismatch in LLM RL.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name != command:
            continue
        try:
            mod = importlib.import_module(f"{__name__}.{module}")
        except ImportError as exc:
            p.set_defaults(_unavailable=str(exc))
            continue
        mod.add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    args = parser.parse_args(argv)
    unavailable = getattr(args, "_unavailable", None)
    if unavailable:
        print(f"mismatch-monitor {args.command}: unavailable ({unavailable})", file=sys.stderr)
        return 2
    mod = importlib.import_module(f"{__name__}.{args._module}")
    try:
        return int(mod.run(args) or 0)
    except (FileNotFoundError, ValueError) as exc:
        print(f"mismatch-monitor {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # output piped into `head` and closed early: not an error
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
