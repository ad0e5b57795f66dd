"""The torch ops' token pass and routing counts on a GPU never wait for the device inside their loops.

There is no GPU here, so two CPU-side proofs: the pass runs to the end on the ``meta`` device,
whose tensors have shapes but no values (every op whose result depends on the data, such as
``bool()``, ``.item()``, a boolean-mask select, ``nonzero``, ``unique`` or ``bincount``, raises
there); and on the CPU, the same sync-free code computes exactly what the float64 reference
does, while ``bool()`` and ``.item()`` raise. The same for the routing counts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mismatch_monitor.config import MetricConfig
from mismatch_monitor.engine import compute_stats, torch_pass
from mismatch_monitor.engine.accumulators import packed_copy
from mismatch_monitor.engine.routing import routing_counts
from mismatch_monitor.engine.slicing import assign_cells
from mismatch_monitor.engine.token_pass import token_pass
from reference import assert_tables_match, make_case, reference_tables

TORCH = MetricConfig(kernel="torch", chunk_tokens=1024)     # many chunks


def _rich_case():
    # invalid tokens of every kind, tails outside every band, turns, support and kept log-mass
    return make_case(21, num_sequences=60, tail_fraction=0.02, bad_fraction=0.02)


def _on_meta(batch, cells):
    moved = {f.name: getattr(batch, f.name).to("meta") for f in dataclasses.fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor)}
    return (dataclasses.replace(batch, **moved),
            dataclasses.replace(cells, seq_cell=cells.seq_cell.to("meta"), seq_length=cells.seq_length.to("meta")))


@pytest.mark.parametrize("layout", ["offsets", "seq_ids"])
def test_the_torch_pass_needs_no_value_of_the_device_inside_its_loop(layout):
    batch = _rich_case().batch(layout)
    meta_batch, meta_cells = _on_meta(batch, assign_cells(batch, TORCH))
    acc = token_pass(meta_batch, meta_cells, TORCH)
    assert acc.joint_n.device.type == "meta" and acc.abs_hist.numel() > 0


def test_the_routing_counts_need_no_value_of_the_device():
    case = make_case(22, num_sequences=30, routing=(5, 8))
    t, s = (torch.from_numpy(x).to("meta") for x in (case.trainer_experts, case.sampler_experts))
    cell = torch.zeros(t.shape[0], dtype=torch.int64, device="meta")
    routed, any_flip, per_layer, L = routing_counts(t, s, cell, 3, 64)
    assert per_layer.shape == (3, 5) and L == 5 and routed.device.type == "meta"


def test_the_cpu_shortcuts_would_wait_for_the_device(monkeypatch):
    # the check above can fail: the CPU's variant (three reductions per chunk, runs of one
    # sequence found first) reads values, which on a GPU is a wait each
    monkeypatch.setattr(torch_pass, "sync_free", lambda device: False)
    batch = _rich_case().batch("offsets")
    meta_batch, meta_cells = _on_meta(batch, assign_cells(batch, TORCH))
    with pytest.raises((RuntimeError, NotImplementedError)):
        token_pass(meta_batch, meta_cells, TORCH)
    case = make_case(22, num_sequences=30, routing=(5, 8))
    t, s = (torch.from_numpy(x).to("meta") for x in (case.trainer_experts, case.sampler_experts))
    with pytest.raises((RuntimeError, NotImplementedError)):
        routing_counts(t, s, torch.zeros(t.shape[0], dtype=torch.int64, device="meta"), 3, 64)


def _no_reads(*args, **kwargs):
    raise AssertionError("the sync-free pass read a value of the device")


@pytest.mark.parametrize("layout", ["offsets", "seq_ids"])
def test_the_sync_free_pass_is_exact_against_the_reference(monkeypatch, layout):
    case = _rich_case()
    batch = case.batch(layout)
    monkeypatch.setattr(torch_pass, "sync_free", lambda device: True)
    cells = assign_cells(batch, TORCH)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "__bool__", _no_reads)
        m.setattr(torch.Tensor, "item", _no_reads)
        token_pass(batch, cells, TORCH)
        routing_counts(batch.trainer_experts, batch.sampler_experts, batch.seq_index, batch.num_sequences, 64)
    got = compute_stats(batch, TORCH)
    want = reference_tables(case, TORCH)
    for name in ("tokens", "abs_hist", "lowprob", "sequences", "seq_hist", "staleness", "routing_layers"):
        assert_tables_match(got[name], want[name], name)


def test_one_packed_copy_gives_every_tensor_back():
    tensors = [torch.arange(3, dtype=torch.int32), torch.randn(5, dtype=torch.float64),
               torch.arange(6).reshape(2, 3), torch.tensor([True, False, True]), torch.zeros(0),
               torch.randn(4, 7, dtype=torch.float64)[:, ::2]]          # odd sizes and a strided view
    for a, b in zip(tensors, packed_copy(tensors)):
        assert a.dtype == b.dtype and torch.equal(a, b)
