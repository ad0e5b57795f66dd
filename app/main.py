"""Entry script: ``streamlit run app/main.py -- --runs-root RUNS_ROOT`` (what
``mismatch-monitor dashboard`` runs). Draws the shared sidebar, then the chosen page."""

from __future__ import annotations

import os
import sys

import streamlit as st

from mismatch_monitor.app import state
from mismatch_monitor.app.navigation import PAGES
from mismatch_monitor.app.runs import runs_root_from


def main() -> None:
    st.set_page_config(page_title="mismatch-monitor", layout="wide")  # no page_icon: it would fetch from a CDN
    # a live refresh redraws in place: what is shown stays at full opacity until replaced
    st.html("<style>[data-testid='stElementContainer'][data-stale='true']{opacity:1 !important;"
            "transition:none !important}</style>")
    root = runs_root_from(sys.argv[1:], os.environ)
    page = st.navigation([st.Page(p.path, title=p.title, url_path=p.url_path,
                                  default=i == 0) for i, p in enumerate(PAGES)])
    state.sidebar(root)
    page.run()


main()
