"""A real Prometheus (Debian's 2.42, as ``.ci/run`` installs it) scraping the exporter while a
run is logged through the collector, with the rendered rules for one step a second.

The resync alert (``MismatchLowESS``) must appear firing in ``/api/v1/alerts`` for the pool
whose ratios collapsed, starting at the step the in-process evaluator says (within one
scrape/evaluation interval), and Prometheus' totals must equal what was logged. Prometheus is
bound to 127.0.0.1 and stopped by PID. Runtime: about 15 s.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from mismatch_monitor.alerts import AlertEvaluator, render_rules
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.collectors import MismatchCollector
from mismatch_monitor.exporter import MismatchExporter

from external_tools import find, needs
from servers import stop_process

PROMETHEUS = find("prometheus")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, **params: str) -> Any:
    query = ("?" + urllib.parse.urlencode(params)) if params else ""
    with urllib.request.urlopen(url + query, timeout=5) as r:
        body = r.read().decode()
    return json.loads(body) if body.startswith("{") else body


@contextmanager
def prometheus(workdir: Path, target_port: int, rules: str) -> Iterator[str]:
    (workdir / "rules.yml").write_text(rules)
    (workdir / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "rule_files: [rules.yml]\n"
        "scrape_configs:\n  - job_name: mismatch\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{target_port}']\n")
    port = free_port()
    log = open(workdir / "prometheus.log", "w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}",
                             f"--storage.tsdb.path={workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
                             "--log.level=warn"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, (workdir / "prometheus.log").read_text()
            try:
                if "Ready" in get(url + "/-/ready"):
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)
        yield url
    finally:
        stop_process(proc)
        log.close()


def instant(url: str, expr: str, **params: str) -> list[dict]:
    return get(url + "/api/v1/query", query=expr, **params)["data"]["result"]


def batch(step: int, fp8_noise: float) -> TokenBatch:
    gen = torch.Generator().manual_seed(step)
    mu = -(8.0 + 3.0 * torch.rand(8, 64, generator=gen, dtype=torch.float64))  # pi stays < 0
    noise = torch.tensor([0.03] * 4 + [fp8_noise] * 4, dtype=torch.float64)[:, None]
    lr = noise * torch.randn(8, 64, generator=gen, dtype=torch.float64)
    return TokenBatch.from_padded(mu + lr, mu, torch.ones(8, 64), labels={
        "pool": ["bf16"] * 4 + ["fp8"] * 4, "hardware": ["H100"] * 4 + ["MI300"] * 4})


@needs("prometheus")
def test_prometheus_fires_the_resync_alert_while_a_run_is_logged(tmp_path):
    exporter = MismatchExporter()
    port = exporter.start()
    resyncs: list[Any] = []
    tokens = 0
    try:
        with prometheus(tmp_path, port, render_rules(step_seconds=1.0)) as url, \
                MismatchCollector(tmp_path / "run", exporter=exporter, alert_evaluator=AlertEvaluator(),
                                  flush_every_steps=1) as mc:
            mc.on_resync(resyncs.append)
            step, deadline = 0, time.monotonic() + 45
            while not instant(url, "mismatch_last_step"):        # healthy until scraped once
                mc.log_step(step, batch(step, 0.05))
                tokens, step = tokens + 512, step + 1
                time.sleep(1.0)
                assert time.monotonic() < deadline, "prometheus never scraped the exporter"
            collapse = step
            firing: list[dict] = []
            while not firing:                                    # fp8's ratios collapse: ESS ~ 0.37
                mc.log_step(step, batch(step, 1.0))
                tokens, step = tokens + 512, step + 1
                time.sleep(1.0)
                alerts = get(url + "/api/v1/alerts")["data"]["alerts"]
                firing = [a for a in alerts if a["labels"]["alertname"] == "MismatchLowESS"
                          and a["state"] == "firing"]
                assert time.monotonic() < deadline, f"no firing MismatchLowESS; alerts: {alerts}"
            last = step - 1

            alert = firing[0]
            assert [a["labels"]["pool"] for a in firing] == ["fp8"]
            assert alert["labels"]["resync"] == "true" and alert["labels"]["severity"] == "critical"
            assert alert["annotations"]["summary"].startswith("ESS of pool fp8 is 0.")
            # in-process: one resync, asked when the collapse has held two steps; LowESS and the step
            # jump fire at the same step for fp8, and the first rule that asks (LowESS) takes the one request
            assert [(e.alert, e.pool, e.since_step) for e in resyncs] == [("MismatchLowESS", "fp8", collapse)]
            seen = instant(url, "mismatch_last_step", time=alert["activeAt"])
            assert abs(int(float(seen[0]["value"][1])) - collapse) <= 1   # one scrape/evaluation interval

            # Prometheus' totals are the logged totals once it has scraped the last step
            deadline = time.monotonic() + 10
            while int(float(instant(url, "mismatch_last_step")[0]["value"][1])) != last:
                assert time.monotonic() < deadline
                time.sleep(0.3)
            total = instant(url, "sum(mismatch_tokens_total)")
            assert float(total[0]["value"][1]) == tokens
            resync_total = instant(url, 'mismatch_resyncs_total{pool="fp8"}')
            assert float(resync_total[0]["value"][1]) == 1
            ess = instant(url, 'mismatch_ess_ratio{pool="fp8"}')
            assert float(ess[0]["value"][1]) == pytest.approx(
                exporter.registry.get_sample_value("mismatch_ess_ratio", {"pool": "fp8"}), rel=1e-12)
    finally:
        exporter.stop()
