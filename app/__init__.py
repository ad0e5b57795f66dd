"""The Streamlit dashboard: ``mismatch-monitor dashboard [RUNS_ROOT]``.

``main.py`` is the entry script; each ``page_*.py`` only lays out. Queries come from
``loaders.py`` (one plain function per page over :mod:`mismatch_monitor.query`), cached in
``data.py``; charts come from ``figures.py`` and ``heatmaps.py`` (plain functions returning
plotly figures). ``main.py`` and ``page_*.py`` are scripts that Streamlit runs; the other
modules are ordinary modules with nothing running at import time.
"""
