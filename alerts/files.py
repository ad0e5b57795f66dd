"""The files rendered from the definitions and committed next to them.

``alerts/mismatch_rules.yml`` (the rules, for one step a minute), ``alerts/mismatch_rules_test.yml``
(promtool tests over :mod:`.scenario`, expected alerts from the in-process evaluator) and the
alert table in ``docs/ALERTS.md``. ``mismatch-monitor alerts render --write`` regenerates them;
``mismatch-monitor alerts check`` (and the test suite) fails while any of them is stale.
"""

from __future__ import annotations

import re
from pathlib import Path

from .definitions import DEFAULT_RULES
from .promtool import render_unit_tests
from .render import DEFAULT_STEP_SECONDS, RULES_FILE, RULES_TEST_FILE, markdown_table, render_rules
from .scenario import counter_tests, scenario_history

DOCS_FILE = Path(__file__).resolve().parents[1] / "docs" / "ALERTS.md"
TABLE_BEGIN = "<!-- BEGIN ALERT TABLE: rendered by `mismatch-monitor alerts render --write` -->"
TABLE_END = "<!-- END ALERT TABLE -->"


# the scenario pools' metadata: their summaries say "x times its expected healthy level" where
# expected_levels.csv has a row (tpu has none: nothing is said)
# max_staleness: the three asynchronous pools lag one update by design, tpu is synced every step
SCENARIO_POOLS = {"bf16": {"precision": "bf16", "engine": "vllm", "max_staleness": 1},
                  "fp8": {"precision": "fp8_e4m3", "engine": "vllm", "max_staleness": 1},
                  "int4": {"precision": "int4", "engine": "transformers/sdpa", "max_staleness": 1},
                  "tpu": {"precision": "bf16", "engine": "jax", "max_staleness": 0}}


def render_test_file() -> str:
    series, promql = counter_tests(DEFAULT_STEP_SECONDS)
    header = ("promtool unit tests for mismatch_rules.yml: every alert fires and clears on the scenario\n"
              "of mismatch_monitor.alerts.scenario; the expected alerts are the in-process evaluator's.\n"
              "Do not edit: mismatch-monitor alerts render --write. Run: promtool test rules "
              "mismatch_rules_test.yml")
    return render_unit_tests(scenario_history(DEFAULT_STEP_SECONDS), rules=DEFAULT_RULES,
                             step_seconds=DEFAULT_STEP_SECONDS, rule_file=RULES_FILE.name,
                             eval_steps="changes", promql_tests=promql, extra_series=series, header=header,
                             pools=SCENARIO_POOLS)


def docs_with_table(text: str) -> str:
    pattern = re.compile(re.escape(TABLE_BEGIN) + r".*?" + re.escape(TABLE_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"expected the markers {TABLE_BEGIN!r} ... {TABLE_END!r} in {DOCS_FILE}")
    return pattern.sub(lambda _: f"{TABLE_BEGIN}\n{markdown_table(DEFAULT_RULES)}{TABLE_END}", text)


def committed_files() -> dict[Path, str]:
    """Each committed, rendered file and the content it should have."""
    files = {RULES_FILE: render_rules(DEFAULT_RULES, step_seconds=DEFAULT_STEP_SECONDS),
             RULES_TEST_FILE: render_test_file()}
    if DOCS_FILE.exists():  # a source checkout
        files[DOCS_FILE] = docs_with_table(DOCS_FILE.read_text(encoding="utf-8"))
    return files


def stale_files() -> list[Path]:
    return [p for p, text in committed_files().items()
            if not p.exists() or p.read_text(encoding="utf-8") != text]


def write_committed_files() -> list[Path]:
    """Rewrite the stale files; returns them."""
    changed = []
    for path, text in committed_files().items():
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(path)
            changed.append(path)
    return changed
