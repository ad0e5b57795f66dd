"""The DuckDB query layer: every read of a run, parameterised (the store keeps the SQL it writes
with: rollup building, compaction's copy of current rows, ``store/rollup.py`` and ``store/current.py``).

Readers resolve each step to the file set that last wrote it (``steps`` index, highest
``write_id``, then highest ``file_id``), so restarts and compactions never show a step twice,
and data files a crashed flush left without an index entry are ignored. Sufficient statistics
are summed (``sum``/``max``/``min`` per ``engine/fields.py``) in SQL and metrics are derived
afterwards by :func:`mismatch_monitor.metrics.derive`, so a marginal means what a cell means.
Identifiers (group-by columns) are checked against the known key columns; every value is bound.

``files`` lists a run's current files and keeps what was read from them; ``core`` holds the
readers every part uses; ``binned`` merges steps into bins; ``views`` what the dashboard reads
beyond them; ``logs`` the alert and error logs; ``events`` the run's events and outcomes;
``breakdowns`` the per-table breakdowns (pool shares, probability buckets, MoE layers).
"""

from .core import (aggregate, connect, forget_files, histogram, latest, metric_series, metric_series_runs,
                   rows, run_config, steps_index, table_files, token_cell_table)
from .core import _retry  # noqa: F401  (compaction documents the retry it relies on)
from .rollup import aligned_bins
from .logs import ALERT_COLUMNS, alert_events, collector_errors, error_messages, firing_alerts, resync_firings
from .binned import aggregate_binned, step_width
from .views import (binned_sums, compare_runs, derive_sums, distinct_values, exemplar_steps, metric_series_binned,
                    metric_totals)
from .breakdowns import crossing_length, lowprob_series, pool_shares, routing_layer_series
from .binned import _current_sources  # noqa: F401  (tested directly)

__all__ = ["connect", "forget_files", "table_files", "run_config", "steps_index", "aggregate", "metric_series",
           "latest", "metric_series_runs", "histogram", "rows", "token_cell_table", "ALERT_COLUMNS",
           "step_width", "aligned_bins", "aggregate_binned", "binned_sums", "derive_sums", "metric_series_binned",
           "metric_totals", "pool_shares",
           "lowprob_series", "routing_layer_series", "crossing_length", "alert_events", "firing_alerts",
           "resync_firings", "exemplar_steps", "compare_runs", "distinct_values", "collector_errors", "error_messages"]
