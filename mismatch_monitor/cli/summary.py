"""``mismatch-monitor summary RUN_DIR [--window N]``: the latest step (or the last N steps,
merged from their summed statistics) per pool, and the worst slices; the run's weight syncs,
resumes and resyncs, and the last value of each training outcome."""

from __future__ import annotations

import argparse
import math
from typing import Sequence

import pandas as pd

from .. import query
from ..metrics import format_of
from ..query.events import resync_effects, run_events, run_outcomes
from ..store.event_log import EVENT_KINDS
from ..label_text import label_text
from ..store import read_run_info, run_status
from ..store.alerting import coverage_line, evaluation_note, read_alerting

# (metric key, column title, format): each value in its declaration's format (metrics.format_of)
POOL_COLUMNS: tuple[tuple[str, str, str], ...] = tuple((key, title, "{:" + format_of(key) + "}") for key, title in (
    ("mismatch/n_tokens", "tokens"), ("mismatch/k3_kl", "k3 KL"), ("mismatch/abs_log_ratio/p99", "p99 |lr|"),
    ("mismatch/abs_log_ratio/max", "max |lr|"), ("mismatch/ess", "ESS"), ("mismatch/rho/mean", "mean rho"),
    ("mismatch/clip_high_fraction", "rho>C"), ("mismatch/icepop_masked_fraction", "IcePop"),
    ("mismatch/extreme_fraction", "extreme"), ("mismatch/routing/flip_rate", "flips"),
))
SLICE_KEYS = ("pool", "length_bucket", "turn_bucket")


def _pool(value, missing: str = "(none)") -> str:
    """A pool's name as the labels write it (an empty name shows as such, never as blank)."""
    return missing if pd.isna(value) else label_text(value)


EVENTS_LISTED = 10   # the latest weight syncs, resumes and resyncs listed by default
RESYNC_METRIC = "mismatch/k3_kl"   # what a resync's effect is read on


def _fmt(value: object, pattern: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return "-"
    return pattern.format(value)


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h))
              for i, h in enumerate(header)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _slice_name(row: pd.Series) -> str:
    parts = [f"pool={_pool(row['pool'], '(none)')}", f"len>={row['length_bucket']}"]
    if not pd.isna(row["turn_bucket"]):           # null when the run has no turn indices
        parts.append(f"turn>={row['turn_bucket']}")
    return " ".join(parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (holds run.json)")
    parser.add_argument("--worst", type=int, default=5, help="how many worst slices to list")
    parser.add_argument("--window", type=int, default=1, metavar="N",
                        help="cover the last N steps up to the latest observed one, merged exactly "
                             "from their sums (a p99 of all their tokens, not a mean of per-step "
                             "values); default 1, the latest step alone")
    parser.add_argument("--events", type=int, default=EVENTS_LISTED, metavar="N",
                        help="how many of the latest weight syncs, resumes and resyncs to list (all are counted)")


def _window(con: object, run_dir: str, by: list[str], first: int, last: int) -> pd.DataFrame:
    """Metrics per group over steps first..last, merged from the summed statistics."""
    return query.metric_series(con, run_dir, by, steps=(first, last), per_step=False)


def _print_events(events: pd.DataFrame, latest: int) -> None:
    if not len(events):
        return
    counts = events["kind"].value_counts()
    print("weight events: " + ", ".join(f"{int(counts[k])} {k}" for k in EVENT_KINDS if k in counts)
          + (f" (the latest {latest}):" if len(events) > latest else ":"))
    for _, e in events.tail(latest).iterrows():
        pool = "every pool" if pd.isna(e["pool"]) else f"pool {_pool(e['pool'])}"
        version = "" if pd.isna(e["version"]) else f", version {e['version']}"
        print(f"  step {e['step']}: {e['kind']} ({pool}{version})" + (f": {e['message']}" if e["message"] else ""))


def _print_resync_effects(effects: pd.DataFrame, latest: int) -> None:
    if not len(effects):
        return
    pattern = "{:" + format_of(RESYNC_METRIC) + "}"
    print(f"\nresyncs, the pool's k3 KL before -> from the resync on (the latest {min(latest, len(effects))}):")
    rows = [[str(e["step"]), _pool(e["pool"], "(every pool)"),
             _fmt(e["before"], pattern) + ("" if pd.isna(e["before_step"]) else f" @{e['before_step']}"),
             _fmt(e["after"], pattern) + ("" if pd.isna(e["after_step"]) else f" @{e['after_step']}")]
            for _, e in effects.tail(latest).iterrows()]
    print(format_table(["step", "pool", "before", "after"], rows))


def _print_outcomes(outcomes: pd.DataFrame) -> None:
    if not len(outcomes):
        return
    last = outcomes.groupby(["name", "pool"], dropna=False, sort=False).tail(1)   # sorted by step
    last = last.sort_values(["name", "pool"], na_position="first", kind="stable")
    print("\ntraining outcomes, the last value of each:")
    rows = [[o["name"], _pool(o["pool"], "(whole batch)"), str(o["step"]),
             f"{o['value']:.6g}"] for _, o in last.iterrows()]
    print(format_table(["outcome", "pool", "step", "value"], rows))


def run(args: argparse.Namespace) -> int:
    if args.window < 1:
        raise ValueError(f"expected --window >= 1 (steps), got {args.window}")
    latest_events = getattr(args, "events", EVENTS_LISTED)   # callers building their own Namespace
    if latest_events < 0:
        raise ValueError(f"expected --events >= 0, got {latest_events}")
    info = read_run_info(args.run_dir)
    con = query.connect()
    idx = query.steps_index(con, args.run_dir)
    observed = idx[idx["n_tokens"] > 0]
    last_wall = float(idx["wall_time"].max()) if len(idx) else None
    status = run_status(info, last_wall)
    print(f"run {info['run_id']} ({status}): {len(idx)} step(s) logged, "
          f"{int(idx['collector_errors'].max()) if len(idx) else 0} collector error(s)")
    errors = query.error_messages(query.collector_errors(con, args.run_dir))
    if len(errors):
        print(f"collector errors: {int(errors['count'].sum())} stored, {len(errors)} distinct (latest first):")
        for _, e in errors.iterrows():
            at = "no step" if pd.isna(e["last_step"]) else f"last at step {int(e['last_step'])}"
            print(f"  {int(e['count'])}x ({at}) {e['where']}: {e['kind']}: {e['message']}")
    _print_events(run_events(con, args.run_dir), latest_events)
    _print_resync_effects(resync_effects(con, args.run_dir, RESYNC_METRIC), latest_events)
    _print_outcomes(run_outcomes(con, args.run_dir))
    if observed.empty:
        print("no observations yet: every metric is null")
        return 0
    step = int(observed["step"].max())
    first = step - args.window + 1
    span = f"step {step}" if args.window == 1 else f"steps {first}..{step}"
    by_pool = _window(con, args.run_dir, ["pool"], first, step)
    print(f"\nlatest step {step}, per pool:" if args.window == 1 else
          f"\nlast {args.window} steps ({span}), per pool, merged from their sums:")
    rows = []
    for _, r in by_pool.iterrows():
        meta = info.get("pools", {}).get(r["pool"], {}) if not pd.isna(r["pool"]) else {}
        name = _pool(r["pool"], "(no pool)")
        hw = "/".join(str(meta[k]) for k in ("hardware", "precision") if k in meta)
        rows.append([name + (f" [{hw}]" if hw else "")] + [_fmt(r[k], f) for k, _, f in POOL_COLUMNS])
    print(format_table(["pool"] + [t for _, t, _ in POOL_COLUMNS], rows))

    slices = _window(con, args.run_dir, list(SLICE_KEYS), first, step)
    slices = slices[slices["mismatch/n_tokens"] > 0].sort_values(
        "mismatch/abs_log_ratio/p99", ascending=False).head(args.worst)
    print(f"\nworst slices {'at' if args.window == 1 else 'over'} {span} (by p99 |lr|):")
    rows = [[_slice_name(r)] + [_fmt(r[k], f) for k, _, f in POOL_COLUMNS[:5]]
            for _, r in slices.iterrows()]
    print(format_table(["slice"] + [t for _, t, _ in POOL_COLUMNS[:5]], rows))

    alerts = query.rows(con, args.run_dir, "alerts")
    alerting = read_alerting(info)
    if len(alerts):
        latest_state = alerts.sort_values("step").groupby(["alert", "pool"], dropna=False).tail(1)
        firing = latest_state[latest_state["state"] == "firing"]
        print(f"\nalerts firing: {len(firing)}")
        for _, a in firing.iterrows():
            # an alert names its pool by label text already (as Prometheus labels it): printed as stored
            pool = "(fleet)" if pd.isna(a["pool"]) else a["pool"]
            print(f"  [{a['severity']}] {a['alert']} pool={pool} since step {a['step']}: {a['summary']}")
        if alerting is not None and alerting.evaluator is not None:
            print("alert rules: " + coverage_line(alerting))
    else:
        print("\nno alert event. " + evaluation_note(alerting))
    return 0
