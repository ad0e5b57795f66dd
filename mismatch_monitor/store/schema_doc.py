"""Renders docs/SCHEMA.md from the one definition of the columns (``engine/fields.py``).

    python -m mismatch_monitor.store.schema_doc > docs/SCHEMA.md

A test fails when the committed file is stale.
"""

from __future__ import annotations

from ..batch import STANDARD_DIMENSIONS
from ..engine.fields import LENGTH_KEY, TABLES, TOKEN_CELL_TABLES, TURN_KEY
from ..exemplars import empty_exemplars
from . import rollup
from .schema import SCHEMA_KEY, SCHEMA_VERSION

INTRO = f"""# Run directory schema (version {SCHEMA_VERSION})

Generated from `mismatch_monitor/engine/fields.py` by
`python -m mismatch_monitor.store.schema_doc`; do not edit by hand.

```
RUN_DIR/
  run.json                    run id, start time, metric config, per-pool metadata, restarts,
                              what evaluated the alerts and what each rule could judge (store/alerting.py)
  steps/part-<file_id>.parquet      the step index (written last by every flush)
  <table>/part-<file_id>.parquet    one file per flush (or compaction) per table
  rollups/<table>/part-<file_id>.parquet   that file's rows merged per block of steps (below)
  writer.lock                 held (flock) by the one writer of the run: pid, host, since
  ids                         the last write/file id handed out (ids follow the run, not the clock)
  quarantine/<table>/...      files readers could not serve, moved there by `mismatch-monitor compact`
```

Ids: each flush takes one more than the largest id the run has used (file names and `ids`),
so a restart on a host whose clock is behind still wins. A second writer on a run is refused
with the holder's pid and host; a lock left by a dead process is taken over. Readers set aside
(and log once) a file that is unreadable, unstamped, or stamped for another table; compaction
moves such files to `quarantine/` and removes the temporary files of dead processes and, when
no writer holds the run, orphan files no index names. `run.json` counts `dropped_steps`: steps
a writer could not keep while the disk refused writes (`RunWriter(max_buffered_steps=...)`).
Label names that clash with a stored column (`file_id`, `write_id`, `block`, a value field,
...: `schema.reserved_names()`) are refused.

Every Parquet file carries the key `{SCHEMA_KEY.decode()}` = `{SCHEMA_VERSION}` in its footer
metadata, and every row the columns `step`, `write_id` (the flush that logged the step) and
`file_id` (the file set holding the row). A reader takes, for each step, the `steps` row with the
highest `write_id` (then `file_id`) and only the data rows with that step and `file_id`: a step
logged again after a restart wins, a compaction's copy is read once, and data files of a flush
that died before writing its index are ignored. Files are written under a temporary name that
does not match `*.parquet`, fsynced and renamed into place.

## Cell keys

Statistics are stored at the finest grain: one row per non-empty cell. Every marginal (by pool,
by pool x length, all) is a merge of cells: `sum` for counts and sums, `max`/`min` for extremes.

| column | meaning |
|---|---|
""" + "".join(f"| `{d}` | sequence label (string; null when the batch did not give it) |\n"
              for d in STANDARD_DIMENSIONS) + f"""| *other labels* | any further label dimension a batch gave (string) |
| `{LENGTH_KEY}` | response-length bucket, as its lower edge in tokens (`MetricConfig.length_edges`) |
| `{TURN_KEY}` | turn bucket, as its lower edge (`MetricConfig.turn_edges`); token tables only, null without turn indices |

`lr = log pi - log mu` (trainer minus sampler log-prob of the sampled token), `rho = exp(lr)`.
"""


def render() -> str:
    parts = [INTRO]
    for table, (extra, fields) in TABLES.items():
        cell = "token cell" if table in TOKEN_CELL_TABLES else "sequence cell"
        keys = ", ".join(f"`{k}`" for k in extra)
        parts.append(f"\n## `{table}`\n\nOne row per {cell}" + (f" and {keys}" if keys else "") + ".\n\n")
        parts.append("| column | type | merge | meaning |\n|---|---|---|---|\n")
        for f in fields:
            doc = f.doc.replace("|", "\\|")  # a literal pipe would end the cell
            parts.append(f"| `{f.name}` | {f.dtype} | {f.merge} | {doc} |\n")
    parts.append("""
## `exemplar_tokens`, `exemplar_sequences`

The K worst tokens (largest |lr|) and sequences (largest max |lr|) of each step, with their
labels; merged across ranks by keeping the global top K. Runs logged through the multi-rank
reducer add `rank`: an exemplar's `seq_index` counts within that rank's batch.

""")
    for name in ("exemplar_tokens", "exemplar_sequences"):
        cols = [c for c in empty_exemplars(name).columns if c not in STANDARD_DIMENSIONS]
        parts.append(f"- `{name}`: labels, " + ", ".join(f"`{c}`" for c in cols) + "\n")
    parts.append("""
## `alerts`

One row per alert state change (`firing` or `resolved`) written by the in-process evaluator:
`step`, `wall_time`, `alert`, `severity`, `pool`, `state`, `value`, `threshold`, `summary`,
`description`, `runbook`, `resync`, `fix` (the remedy the data points at first) and `since_step`
(the step the alert's condition started to hold). A pool is named by its label text, as Prometheus
shows it (`%null` for rows logged without a pool; see `report_keys.py`), null for a fleet-wide alert.

## `errors`

One row per error the collector counted, with its text (the count alone says nothing about
why): `step` (null when the error has no valid step), `wall_time`, `where` (what failed),
`kind` (the exception class), `message`. Rows of a flush are read once its index file exists
(a flush that carries only errors writes an empty one); `mismatch-monitor summary` and the
dashboard's Overview show them.

## `events`, `outcomes`

Logs of what happened to the weights and how training went, beside the statistics
(`store/event_log.py`; `MismatchCollector.log_event` / `log_outcomes`, read by
`query/events.py`). Like `errors`, their rows carry their own step and are read once their
flush's index file exists; compaction copies each flush's rows once.

- `events`: one row per `weight_sync`, `resume`, `resync` or `resync_request`: `step` (the first
  step whose batches come after the event), `wall_time`, `kind`, `pool` (null: every pool),
  `version` (the weight version, null when unknown), `message`. Every event is kept.
- `outcomes`: one row per value: `step`, `wall_time`, `pool` (null: the whole batch), `name`
  (`reward`, `loss`, `grad_norm`, `entropy`, `eval_reward` or any other), `value` (finite). A
  value logged again for the same (step, pool, name) replaces the earlier one (the latest
  `write_id`), as a re-logged step does.

## `steps`

`step`, `wall_time` (seconds since the epoch), `n_tokens`, `n_sequences`, `n_cells`,
`collector_errors` (errors the collector had counted by then; a step whose batch was rejected is
recorded with no statistics).
""")
    parts.append(f"""
## `rollups/<table>`

Written for {", ".join(f"`{t}`" for t in rollup.ROLLUP_TABLES)} beside each of their files, with
the same `file_id`, before the index: the file's rows merged per block of {rollup.BLOCK} steps
(`block` = step // {rollup.BLOCK} * {rollup.BLOCK}) and per grouping, each column by its merge
rule above. `grouping` names the dimensions a row keeps (comma-joined; empty for all):
{", ".join(f"`{rollup.grouping_name(g) or '(all)'}`" for g in rollup.GROUPINGS)}; `abs_hist` keeps
only the first {len(rollup.HIST_GROUPINGS)}.
The other dimensions are null. Columns: `block`, `grouping`, the kept dimensions, the table's
extra keys, `step_last` (the last step among the merged rows), the merged columns, `file_id`.
A reader takes a block from rollups only where that is exact (every flush with a step in the
block rolled up, none of its steps re-logged since, the whole block inside the range and bin
read); a run without rollups is read from its cells.
""")
    return "".join(parts)


if __name__ == "__main__":
    print(render(), end="")
