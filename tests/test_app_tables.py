"""Tables as shown: every table of every page, on the sample runs under AppTest, shows no "None",
"nan" or raw column name; a share of an empty total says so, a real zero is 0%."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch

from mismatch_monitor.app import tables
from mismatch_monitor.app.navigation import PAGES
from mismatch_monitor.collectors import MismatchCollector
from test_app_pages import open_page

SAMPLE_DATA = Path(__file__).resolve().parent.parent / "sample_data"
RUNS = ("vllm_fleet", "stable_fleet")   # real engines, one extreme-ratio token / pools with none among others
pytestmark = pytest.mark.skipif(not all((SAMPLE_DATA / r).is_dir() for r in RUNS), reason="no sample runs")


def shown(element) -> pd.DataFrame:  # noqa: ANN001 - an AppTest Dataframe
    """The cells as the browser draws them: a styled table's display values, else its data (where
    Streamlit writes a null as "None")."""
    arrow = element.proto.arrow_data
    raw = arrow.styler.display_values if arrow.HasField("styler") and arrow.styler.display_values else arrow.data
    frame = pa.ipc.open_stream(raw).read_pandas()
    return frame.astype(object).where(frame.notna(), "None")


def test_a_share_of_an_empty_total_says_so_and_a_zero_share_is_zero_percent() -> None:
    shares = pd.DataFrame({"pool": ["a", "b", None], "n_extreme": [0.0, 3.0, 1.0], "extreme_share": [0.0, 0.75, 0.25],
                           "sample_share": [0.5, 0.5, np.nan], "tail_to_sample": [0.0, 1.5, np.nan]})
    text = tables.pool_shares(shares).to_string()
    assert "0.0%" in text and "75.0%" in text and "no sequences" in text and "(no pool)" in text
    assert "None" not in text and "nan" not in text
    empty = tables.pool_shares(shares.assign(extreme_share=np.nan, tail_to_sample=np.nan)).to_string()
    assert empty.count("no extreme tokens") == 2 * len(shares)


@pytest.mark.parametrize("page", PAGES, ids=[p.url_path for p in PAGES])
def test_no_table_shows_none_or_a_raw_column_name(monkeypatch, page) -> None:  # noqa: ANN001
    for run in RUNS:
        at = open_page(monkeypatch, SAMPLE_DATA, page, run, refresh="off")
        for element in at.dataframe:
            frame = shown(element)
            where = f"{page.url_path} on {run}: {list(frame.columns)}"
            cells = frame.to_numpy(dtype=object).ravel()
            assert not {"None", "nan", "NaN", "<NA>"} & {str(c).strip() for c in cells}, where
            assert not [c for c in frame.columns if re.fullmatch(r"[a-z0-9]+(_[a-z0-9]+)+", str(c))], where


def test_the_pools_table_of_a_run_without_extreme_tokens(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    # a run whose two pools never leave |log ratio| < 0.1: no extreme-ratio token anywhere
    torch.manual_seed(0)
    with MismatchCollector(tmp_path / "quiet", pools={"a": {"precision": "bf16"}, "b": {"precision": "fp16"}}) as c:
        for step in range(3):
            pi = -torch.rand(4, 16) * 3
            c.log_step(step, trainer_logprobs=pi, sampler_logprobs=pi + (torch.rand(4, 16) - 0.5) * 0.2,
                       response_mask=torch.ones(4, 16, dtype=torch.bool), labels={"pool": ["a", "a", "b", "b"]})
    at = open_page(monkeypatch, tmp_path, PAGES[1], "quiet", refresh="off")
    table = shown(at.dataframe[0])
    assert set(table["share of extreme-ratio tokens"]) == {"no extreme tokens"}
    assert set(table["extreme-ratio tokens"]) == {"0"}                 # a count of zero is 0
    at = open_page(monkeypatch, SAMPLE_DATA, PAGES[1], "stable_fleet", refresh="off", window="last 100")
    table = shown(at.dataframe[0]).set_index("pool")
    assert table.loc["async", "share of extreme-ratio tokens"] == "0.0%"   # none of a non-empty tail
