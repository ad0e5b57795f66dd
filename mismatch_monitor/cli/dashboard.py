"""``mismatch-monitor dashboard [RUNS_ROOT] [--port 8501] [--address 127.0.0.1]``.

Starts ``streamlit run`` on the dashboard's entry script, bound to 127.0.0.1 unless told
otherwise, headless, with usage statistics off, and hands it the runs root (only runs under it
can be opened). The server runs as a child process; SIGINT/SIGTERM stop it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import FrameType

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs_root", nargs="?", default=None,
                        help="directory holding run directories (default: ./runs if it exists, "
                             "else the bundled sample_data/)")
    parser.add_argument("--port", type=int, default=8501, help="port to serve on (default 8501)")
    parser.add_argument("--address", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only)")


def streamlit_command(runs_root: Path, *, port: int, address: str,
                      python: str = sys.executable) -> list[str]:
    """The exact ``streamlit run`` command line (tested; no telemetry, no file watcher)."""
    from ..app.navigation import APP_DIR

    return [python, "-m", "streamlit", "run", str(APP_DIR / "main.py"),
            "--server.address", address, "--server.port", str(port), "--server.headless", "true",
            "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none",
            "--server.runOnSave", "false", "--global.developmentMode", "false",
            "--client.toolbarMode", "minimal", "--", "--runs-root", str(runs_root)]


def resolve_root(runs_root: str | None) -> Path:
    from ..app.runs import default_runs_root

    root = Path(runs_root).expanduser().resolve() if runs_root else default_runs_root()
    if not root.is_dir():
        raise FileNotFoundError(f"runs root {root} is not a directory; expected a directory of run "
                                "directories (each with a run.json)")
    return root


def run(args: argparse.Namespace) -> int:
    root = resolve_root(args.runs_root)
    if not 0 < args.port < 65536:
        raise ValueError(f"expected a port in 1..65535, got {args.port}")
    if args.address not in LOOPBACK:
        print(f"mismatch-monitor dashboard: serving on {args.address}: anyone who can reach it can read "
              "the runs under the root", file=sys.stderr)
    cmd = streamlit_command(root, port=args.port, address=args.address)
    env = dict(os.environ, STREAMLIT_BROWSER_GATHER_USAGE_STATS="false")
    print(f"mismatch-monitor dashboard: runs root {root}, http://{args.address}:{args.port}", file=sys.stderr)
    child = subprocess.Popen(cmd, env=env)

    def stop(signum: int, frame: FrameType | None) -> None:
        child.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if child.poll() is None:
            child.kill()
            child.wait()
