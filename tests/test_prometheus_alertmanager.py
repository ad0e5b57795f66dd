"""The Alertmanager example, run by a real Alertmanager (Debian's 0.25): resync alerts reach the
trainer's webhook, and a pool's warnings are inhibited while its resync alert fires.

Alertmanager and the webhook receiver are bound to 127.0.0.1; Alertmanager is stopped by PID.
Runtime: about 4 s.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.request
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from mismatch_monitor.alerts import DEFAULT_RULES
from mismatch_monitor.alerts.render import ALERTMANAGER_EXAMPLE

from external_tools import find, needs
from servers import stop_process

ALERTMANAGER = find("alertmanager")
RULES = {r.name: r for r in DEFAULT_RULES}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Webhook(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.received.append(json.loads(body))  # type: ignore[attr-defined]
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def alert(name: str, pool: str) -> dict[str, Any]:
    rule = RULES[name]
    return {"labels": {"alertname": name, "pool": pool, **rule.labels},
            "annotations": {"summary": rule.text("summary", pool, 0.3)},
            "startsAt": datetime.now(timezone.utc).isoformat()}


@needs("alertmanager")
def test_resyncs_reach_the_webhook_and_inhibit_the_pools_warnings(tmp_path):
    assert ALERTMANAGER is not None
    hook = ThreadingHTTPServer(("127.0.0.1", 0), Webhook)
    hook.received = []  # type: ignore[attr-defined]
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    config = ALERTMANAGER_EXAMPLE.read_text()
    assert "http://127.0.0.1:9095/resync" in config
    (tmp_path / "am.yml").write_text(config.replace("http://127.0.0.1:9095/resync",
                                                    f"http://127.0.0.1:{hook.server_port}/resync"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "am.log", "w")
    proc = subprocess.Popen([ALERTMANAGER, f"--config.file={tmp_path / 'am.yml'}",
                             f"--storage.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--cluster.listen-address=", "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, (tmp_path / "am.log").read_text()
            try:
                urllib.request.urlopen(url + "/-/ready", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "alertmanager did not become ready"
                time.sleep(0.2)
        posted = [alert("MismatchLowESS", "fp8"), alert("MismatchTailGrowth", "fp8"),
                  alert("MismatchTailGrowth", "bf16")]
        req = urllib.request.Request(url + "/api/v2/alerts", data=json.dumps(posted).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        assert urllib.request.urlopen(req, timeout=5).status == 200
        while not hook.received:  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "the resync webhook received nothing"
            time.sleep(0.1)
        payload = hook.received[0]  # type: ignore[attr-defined]
        assert payload["receiver"] == "trainer-resync"
        assert [(a["labels"]["alertname"], a["labels"]["pool"]) for a in payload["alerts"]] == [
            ("MismatchLowESS", "fp8")]

        with urllib.request.urlopen(url + "/api/v2/alerts", timeout=5) as r:
            states = {(a["labels"]["alertname"], a["labels"]["pool"]): a["status"] for a in json.load(r)}
        assert states[("MismatchLowESS", "fp8")]["state"] == "active"
        assert states[("MismatchTailGrowth", "fp8")]["state"] == "suppressed"
        assert states[("MismatchTailGrowth", "fp8")]["inhibitedBy"]
        assert states[("MismatchTailGrowth", "bf16")]["state"] == "active"   # another pool: not inhibited
    finally:
        stop_process(proc)
        log.close()
        hook.shutdown()
        hook.server_close()
