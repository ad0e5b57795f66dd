"""Stopping the servers tests start (Prometheus, Alertmanager, the demo), by their own PID."""

from __future__ import annotations

import subprocess


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
