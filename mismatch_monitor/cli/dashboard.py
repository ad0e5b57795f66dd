"""``mismatch-monitor dashboard [RUNS_ROOT] [--port 8501] [--address 127.0.0.1]``.

Starts ``streamlit run`` on the dashboard's entry script, bound to 127.0.0.1 unless told
otherwise, headless, with usage statistics off, and hands it the runs root (only runs under it
can be opened). The server runs as a child process; SIGINT/SIGTERM stop it. A port something else
listens on is refused before the server starts (``--port 0`` takes a free one and prints it).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import FrameType

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs_root", nargs="?", default=None,
                        help="directory holding run directories (default: ./runs if it exists, "
                             "else the bundled sample_data/)")
    parser.add_argument("--port", type=int, default=8501,
                        help="port to serve on (default 8501; 0: any free port, printed)")
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


class DashboardError(RuntimeError):
    """The dashboard server did not come up (its port was taken, or it exited)."""


def claim_port(address: str, port: int) -> int:
    """``port`` if nothing listens on it at ``address``, or a free port the system picks for
    ``port == 0``; ValueError naming the port otherwise. Streamlit binds with SO_REUSEADDR, so a
    port whose last server just closed counts as free, as it will for Streamlit."""
    if not 0 <= port < 65536:
        raise ValueError(f"expected a port in 0..65535 (0: any free port), got {port}")
    family, kind, proto, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(sockaddr)
        except OSError as exc:
            raise ValueError(f"port {port} on {address} is in use ({exc.strerror}): another dashboard "
                             "or server listens there; pick another port, or 0 for any free one") from exc
        return int(probe.getsockname()[1])


def wait_until_serving(child: subprocess.Popen[bytes], url: str, timeout: float = 90.0) -> None:
    """Return once the server at ``url`` answers its health check; DashboardError if the child
    exits first (e.g. it lost a race for the port) or nothing answers within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as response:
                if response.read() == b"ok":
                    return
        except OSError:
            pass
        if child.poll() is not None:
            raise DashboardError(f"the dashboard server exited with status {child.returncode} "
                                 f"before serving {url}")
        if time.monotonic() > deadline:
            raise DashboardError(f"the dashboard server did not answer at {url} within {timeout:.0f} s")
        time.sleep(0.3)


def resolve_root(runs_root: str | None) -> Path:
    from ..app.runs import default_runs_root

    root = Path(runs_root).expanduser().resolve() if runs_root else default_runs_root()
    if not root.is_dir():
        raise FileNotFoundError(f"runs root {root} is not a directory; expected a directory of run "
                                "directories (each with a run.json)")
    return root


def run(args: argparse.Namespace) -> int:
    root = resolve_root(args.runs_root)
    port = claim_port(args.address, args.port)
    if args.address not in LOOPBACK:
        print(f"mismatch-monitor dashboard: serving on {args.address}: anyone who can reach it can read "
              "the runs under the root", file=sys.stderr)
    cmd = streamlit_command(root, port=port, address=args.address)
    env = dict(os.environ, STREAMLIT_BROWSER_GATHER_USAGE_STATS="false")
    print(f"mismatch-monitor dashboard: runs root {root}, http://{args.address}:{port}", file=sys.stderr)
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
