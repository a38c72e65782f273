"""The cost-formula protocol (issue #12): CostModel implements it, and a formula that is not a
CostModel, implementing only the protocol, is planned, sharded and calibrated with unchanged
code."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from balancer import CostModel, Layout, PlannerConfig, SampleTable, plan_epoch
from balancer.cost import blocks, calibration
from balancer.cost.model import available_presets, load_cost_model
from balancer.cost.protocol import CostFormula
from balancer.loader import cp_shard
from balancer.zigzag import zigzag_attention


class Linear:
    """``k x L`` per document and pass: a formula that is not a CostModel."""

    name, unit = "linear", "tokens"

    def __init__(self, k: float = 1.0):
        self.k = k

    def doc_costs(self, lengths):
        lf = np.asarray(lengths, dtype=np.float64)
        return self.k * lf, 2 * self.k * lf

    def doc_total(self, lengths):
        f, b = self.doc_costs(lengths)
        return f + b

    @property
    def microbatch_constant(self):
        return 0.0, 0.0

    def doc_parts(self, lengths):
        f, b = self.doc_costs(lengths)
        z = np.zeros_like(f)
        return z, z, f + b, z

    def shard_costs(self, lengths, cp):
        lf = np.asarray(lengths, dtype=np.float64)
        return 3 * self.k * lf, np.repeat((3 * self.k * lf / cp)[:, None], cp, axis=1)

    def calibration_features(self, doc_lengths, offsets):
        return CostModel.calibration_features(doc_lengths, offsets)[:, 1:2]


@pytest.mark.parametrize("name", ["quadratic-64k"] + available_presets())
def test_every_preset_is_a_cost_formula(name):
    assert isinstance(load_cost_model(name), CostFormula)


@pytest.mark.slow
def test_a_formula_outside_costmodel_is_planned_and_sharded():
    assert isinstance(Linear(), CostFormula)
    lengths = np.random.default_rng(0).integers(1, 900, 500)
    plan = plan_epoch(SampleTable(lengths), Linear(), Layout(dp=2, microbatches=2, capacity=1024),
                      PlannerConfig())
    assert np.array_equal(np.sort(plan.entry_sample), np.arange(500))  # every sample once
    f, b = blocks.microbatch_costs(Linear(), plan.entry_length, plan.mb_offsets)
    assert np.allclose(f + b, np.add.reduceat(3.0 * plan.entry_length, plan.mb_offsets[:-1]))
    assert np.array_equal(plan.mb_fwd, f) and np.array_equal(plan.mb_bwd, b)
    owners = cp_shard.choose_owners(np.array([500, 20, 20, 8]), 2, Linear())
    assert owners.shape == (4,)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=20), st.sampled_from([2, 4, 8]),
       st.booleans())
def test_shard_costs_are_the_zigzag_split_of_the_formula(lengths, cp, recompute):
    c = CostModel(forward={"a": 1e-4, "b": 1.0, "d": 3.0}, backward={"a": 2e-4, "b": 2.0},
                  recompute=recompute)
    L = np.array(lengths, np.int64)
    whole, sharded = c.shard_costs(L, cp)
    att = sum(c.doc_parts(L)[:2])  # a L^2 over both passes
    a = att / (L.astype(float) ** 2)
    lin = c.doc_parts(L)[2]
    # whole: the quadratic coefficient on causal pairs L (L + 1) / 2 x 2, plus the linear part
    assert np.allclose(whole, a * L * (L + 1) + lin, rtol=1e-12)
    # sharded: every rank's zigzag pairs, and the padded tokens shared by cp ranks
    pad = -(-L // (2 * cp)) * (2 * cp)
    assert np.allclose(sharded, 2 * a[:, None] * zigzag_attention(L, cp)
                       + (lin / L * pad / cp)[:, None], rtol=1e-12)
    w1, s1 = c.shard_costs(L, 1)
    assert np.allclose(s1[:, 0], w1, rtol=1e-12)  # one rank holds the whole document


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 10**6), min_size=1, max_size=30), st.booleans())
def test_doc_parts_sum_to_the_total(lengths, recompute):
    c = CostModel(forward={"a": 1e-6, "b": 2.0, "d": 5.0}, backward={"a": 2e-6, "b": 4.0, "d": 1.0},
                  recompute=recompute)
    assert np.allclose(sum(c.doc_parts(lengths)), c.doc_total(lengths), rtol=1e-12)


def test_calibration_reads_the_formulas_features():
    lens, off = calibration.to_csr([[3, 4], [10], [1, 1, 1]])
    x = calibration.features(lens, off)
    assert np.array_equal(x, CostModel.calibration_features(lens, off))
    assert x.tolist() == [[25, 7, 1, 2], [100, 10, 1, 1], [3, 3, 1, 3]]


def test_the_multimodal_llm_cost_is_a_formula():
    from balancer.multimodal.cost import available_presets as mm_presets, load_mm_cost_model
    for name in mm_presets():
        assert isinstance(load_mm_cost_model(name).llm, CostFormula)
