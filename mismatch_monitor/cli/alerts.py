"""``mismatch-monitor alerts render|check``: the Prometheus rules from the alert definitions.

    mismatch-monitor alerts render --step-seconds 30 > mismatch_rules.yml   # for 30 s steps
    mismatch-monitor alerts render --write    # regenerate the committed files in alerts/
    mismatch-monitor alerts check             # stale files? promtool and amtool verdicts
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="alerts_command", metavar="ACTION", required=True)
    render = sub.add_parser("render", help="print the rules file (or rewrite the committed files)")
    render.add_argument("--step-seconds", type=float, default=60.0,
                        help="duration of one training step; windows and 'for' are multiples of it")
    render.add_argument("--rate-window", default="5m", help="window of the counter-ratio recording rules")
    render.add_argument("--out", default="-", help="file to write (default: standard output)")
    render.add_argument("--write", action="store_true",
                        help="rewrite the committed rules, promtool tests and docs table instead")
    check = sub.add_parser("check", help="fail on stale committed files; run promtool and amtool on them")
    check.add_argument("--skip-tools", action="store_true", help="only check that the files are up to date")


def run(args: argparse.Namespace) -> int:
    if args.alerts_command == "render":
        return _render(args)
    return _check(args)


def _render(args: argparse.Namespace) -> int:
    from ..alerts.render import render_rules

    if args.write:
        from ..alerts.files import write_committed_files

        for path in write_committed_files():
            print(f"wrote {path}")
        return 0
    text = render_rules(step_seconds=args.step_seconds, rate_window=args.rate_window)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(text)
    return 0


def _check(args: argparse.Namespace) -> int:
    from ..alerts.files import stale_files
    from ..alerts.promtool import run_tool
    from ..alerts.render import ALERTMANAGER_EXAMPLE, RULES_FILE, RULES_TEST_FILE

    failed = False
    for path in stale_files():
        print(f"stale: {path} (run: mismatch-monitor alerts render --write)")
        failed = True
    if not args.skip_tools:
        checks = (("promtool", ("check", "rules", RULES_FILE.name)),
                  ("promtool", ("test", "rules", RULES_TEST_FILE.name)),
                  ("amtool", ("check-config", ALERTMANAGER_EXAMPLE.name)))
        for tool, tool_args in checks:
            try:
                result = run_tool(tool, *tool_args, cwd=RULES_FILE.parent)
            except FileNotFoundError as exc:
                print(f"{tool}: {exc}")
                failed = True
                continue
            ok = result.returncode == 0
            failed |= not ok
            print(f"{'ok' if ok else 'FAILED'}: {tool} {' '.join(tool_args)}")
            if not ok:
                print(result.stdout + result.stderr)
    return 1 if failed else 0
