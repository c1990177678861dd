"""``NewtonSchulz.prepare``: everything a model's shapes need is resolved (tuned, compiled) in
one announced place, rank 0 saying which shape and how many are left; results never change."""

from __future__ import annotations

import logging

import pytest
import torch

from dmuon_kernels import NewtonSchulz
from dmuon_kernels.syrk import _call_cache


@pytest.fixture
def lines(caplog, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    caplog.set_level(logging.INFO, logger="dmuon_kernels")
    return lambda: [r.getMessage() for r in caplog.records if "prepare" in r.getMessage()]


def test_rank_zero_announces_each_shape_with_how_many_are_left(lines, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    NewtonSchulz().prepare([(16, 48), (48, 16), (3, 8, 8)], device="cpu")
    announced = lines()
    assert announced[:2] == [
        "[DMuon][rank=0/8] Newton-Schulz prepare 1/2: shape=(16, 48) dtype=float32 (1 left after "
        "this one; SYRK autotune and kernel compilation on first use)",
        "[DMuon][rank=0/8] Newton-Schulz prepare 2/2: shape=(3, 8, 8) dtype=float32 (0 left "
        "after this one; SYRK autotune and kernel compilation on first use)",
    ]  # (48, 16) is (16, 48) transposed: one shape
    assert announced[2].startswith("[DMuon][rank=0/8] Newton-Schulz prepare done: 2 shapes in ")


def test_other_ranks_prepare_silently(lines, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    NewtonSchulz().prepare([(16, 48)], device="cpu")
    assert lines() == []


def test_prepare_resolves_every_product_of_the_iteration(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    _call_cache.clear()
    NewtonSchulz("gram").prepare([(8, 64)], device="cpu")
    assert _call_cache.size() >= 3  # X·Xᵀ, the polynomial, the commuting products, Q·X


def test_prepare_changes_no_result(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    G = torch.randn(16, 48, generator=torch.Generator().manual_seed(0))
    before = NewtonSchulz()(G)
    ns = NewtonSchulz()
    ns.prepare([G.shape])
    assert torch.equal(ns(G), before)


@pytest.mark.parametrize("shape", [(16,), (0, 4), (4, 4.0)], ids=str)
def test_a_shape_that_is_not_a_matrix_is_refused(shape):
    with pytest.raises(ValueError, match=r"prepare takes shapes \(m, n\) or \(\.\.\., m, n\)"):
        NewtonSchulz().prepare([shape], device="cpu")
