"""The dashboard's pages, in menu order: one definition for the app, its tests and benchmark."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

APP_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class PageSpec:
    file: str        # script next to main.py
    title: str
    url_path: str    # /<url_path> in the browser (no page icons: a page's icon is fetched from a CDN)
    loader: str      # name of the function in loaders.py that runs the page's queries

    @property
    def path(self) -> Path:
        return APP_DIR / self.file


PAGES: tuple[PageSpec, ...] = (
    PageSpec("page_overview.py", "Overview", "overview", "overview"),
    PageSpec("page_pools.py", "Pools", "pools", "pools"),
    PageSpec("page_tails.py", "Tails", "tails", "tails"),
    PageSpec("page_lowprob.py", "Low-probability buckets", "lowprob", "lowprob"),
    PageSpec("page_length_turn.py", "Length and turn", "length-turn", "length_turn"),
    PageSpec("page_routing.py", "Routing", "routing", "routing"),
    PageSpec("page_corrections.py", "Corrections", "corrections", "corrections"),
    PageSpec("page_alerts.py", "Alerts and resyncs", "alerts", "alerts"),
    PageSpec("page_compare.py", "Compare runs", "compare", "compare"),
    PageSpec("page_runs.py", "Several runs", "runs", "run_series"),
    PageSpec("page_exemplars.py", "Exemplars", "exemplars", "exemplars"),
)
