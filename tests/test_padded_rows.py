"""The padded layout's compiled row scan and run copies (``padded_native``, ``_padded.c``): the
same flat tensors as ``t[mask.to(torch.bool)]``, bit for bit, for every mask dtype, with holes,
empty rows, strided masks and values whose low byte is zero; and the numpy path they replace
where the extension is not built gives the same."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mismatch_monitor import padded_native
from mismatch_monitor.batch import TokenBatch
from mismatch_monitor.batch_layout import PaddedRows

MASK_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


@pytest.fixture(autouse=True)
def built():
    assert padded_native.available(), "the compiled padded scan mismatch_monitor._padded was not built"


def _mask(B: int, T: int, seed: int, holes: bool = False, dtype=torch.int64, value: int = 1) -> torch.Tensor:
    """Left prompt padding, a response, right padding; rows of no tokens; optional holes."""
    g = np.random.default_rng(seed)
    m = np.zeros((B, T), dtype=np.int64)
    for b in range(B):
        if g.random() < 0.15:
            continue
        f = int(g.integers(0, T))
        e = int(g.integers(f, T + 1))
        m[b, f:e] = value
        if holes and e - f > 2:
            m[b, int(g.integers(f + 1, e - 1))] = 0
    t = torch.from_numpy(m)
    return t.to(dtype) if dtype != torch.bool else t != 0


def _fields(B: int, T: int, seed: int, dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    pi = -torch.rand(B, T, generator=g, dtype=torch.float64).to(dtype)
    return dict(trainer_logprobs=pi, sampler_logprobs=pi - 0.01,
                turn_index=torch.randint(0, 4, (B, T), generator=g),
                token_ids=torch.randint(0, 1000, (B, T), generator=g),
                trainer_experts=torch.randint(0, 8, (B, T, 2, 3), generator=g),
                sampler_experts=torch.randint(0, 8, (B, T, 2, 3), generator=g))


def _same(got: TokenBatch, mask: torch.Tensor, fields: dict) -> None:
    keep = mask.to(torch.bool)
    for name, t in fields.items():
        want = t[keep]
        have = getattr(got, name)
        assert have.dtype == want.dtype and have.shape == want.shape, name
        assert torch.equal(have.view(torch.int16) if want.dtype == torch.bfloat16 else have,
                           want.view(torch.int16) if want.dtype == torch.bfloat16 else want), name
    assert torch.equal(got.seq_offsets, torch.cat([torch.zeros(1, dtype=torch.int64), keep.sum(1).cumsum(0)]))


@pytest.mark.parametrize("mask_dtype", MASK_DTYPES)
@pytest.mark.parametrize("holes", [False, True])
def test_every_mask_dtype_gives_the_boolean_select(mask_dtype, holes):
    for seed in range(3):
        mask = _mask(37, 53, seed, holes, mask_dtype)
        fields = _fields(37, 53, seed)
        _same(TokenBatch.from_padded(response_mask=mask, **fields), mask, fields)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_every_logprob_dtype_is_copied_bit_for_bit(dtype):
    mask = _mask(20, 31, 7)
    fields = _fields(20, 31, 7, dtype)
    _same(TokenBatch.from_padded(response_mask=mask, **fields), mask, fields)


@pytest.mark.parametrize("value", [256, -1, 1 << 40, -(1 << 63)])
def test_a_token_is_any_nonzero_value_not_its_low_byte(value):
    # 256 and 2^40 have a zero low byte; -2^63 only its sign bit set
    mask = _mask(16, 24, 3, dtype=torch.int64, value=value)
    rows = PaddedRows(mask)
    assert torch.equal(rows.lengths, (mask != 0).sum(1))
    fields = _fields(16, 24, 3)
    _same(TokenBatch.from_padded(response_mask=mask, **fields), mask, fields)


def test_single_run_masks_are_never_cast_to_bool():
    mask = _mask(64, 128, 1)
    rows = PaddedRows(mask)
    t = torch.randn(64, 128)
    assert torch.equal(rows.select(t), t[mask.to(torch.bool)])
    assert rows._bool is None              # read in its own dtype: no [B, T] bool copy made
    holed = PaddedRows(_mask(64, 128, 1, holes=True))
    assert holed._scan is None             # not one run per row: the select takes the bool mask


@pytest.mark.parametrize("shape", [(0, 5), (4, 0), (3, 6)])
def test_empty_batches_and_empty_rows(shape):
    mask = torch.zeros(shape, dtype=torch.int64)
    fields = _fields(*shape, seed=0)
    got = TokenBatch.from_padded(response_mask=mask, **fields)
    assert got.num_tokens == 0
    _same(got, mask, fields)


def test_strided_masks_and_tensors():
    base = _mask(30, 80, 5)
    fields = {k: v[:, ::2] for k, v in _fields(30, 80, 5).items()}      # rows not contiguous slots
    mask = base[:, ::2]
    _same(TokenBatch.from_padded(response_mask=mask, **fields), mask, fields)
    wide = _mask(30, 160, 5)[:, :80]                                        # rows of stride 160
    fields = {k: v[:, :80] for k, v in _fields(30, 160, 5).items()}
    _same(TokenBatch.from_padded(response_mask=wide, **fields), wide, fields)


def test_a_float_mask_takes_the_cast():
    mask = _mask(12, 20, 2).to(torch.float32)
    mask[0, 0] = float("nan")                 # NaN counts as a token, as .to(torch.bool) says
    assert padded_native.rows(mask) is None
    fields = _fields(12, 20, 2)
    _same(TokenBatch.from_padded(response_mask=mask, **fields), mask, fields)


def test_the_numpy_path_gives_the_same(monkeypatch):
    for holes in (False, True):
        mask = _mask(25, 40, 11, holes)
        fields = _fields(25, 40, 11)
        compiled = TokenBatch.from_padded(response_mask=mask, **fields)
        monkeypatch.setattr(padded_native, "library", lambda: None)
        plain = TokenBatch.from_padded(response_mask=mask, **fields)
        monkeypatch.undo()
        for name in fields:
            assert torch.equal(getattr(compiled, name), getattr(plain, name)), name


def test_gather_refuses_runs_beyond_the_rows():
    counts, firsts = np.array([3], dtype=np.int64), np.array([2], dtype=np.int64)
    with pytest.raises(ValueError, match="runs reach slot 5"):
        padded_native.gather(torch.zeros(1, 4), counts, firsts, 3)
