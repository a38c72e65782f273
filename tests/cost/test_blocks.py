"""Per-document totals and per-microbatch costs (balancer/cost/blocks.py): the one-pass compiled
path taken for a CostModel without attention terms equals, bit for bit, the per-pass arrays
of ``CostModel.doc_costs`` summed per microbatch in entry order; anything it refuses (bad
lengths, overflow, a formula of the protocol) goes the checked way with that way's errors."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from balancer.cost import blocks
from balancer.cost.model import CostModel, PassCost, load_cost_model
from packing.segments import add_segment_sums

coef = st.sampled_from([0.0, 1.0, 2.5, 1 / 3, 2.0 ** -16, 7e-9])


def _reference(cost, lengths, offsets):
    f, b = cost.doc_costs(lengths)
    mb_f = np.zeros(offsets.shape[0] - 1)
    mb_b = np.zeros(offsets.shape[0] - 1)
    add_segment_sums(f, offsets, 0, mb_f)
    add_segment_sums(b, offsets, 0, mb_b)
    cf, cb = cost.microbatch_constant
    return f + b, mb_f + cf, mb_b + cb


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 2 ** 21), min_size=0, max_size=60),
       st.lists(st.integers(0, 6), min_size=1, max_size=30),
       st.tuples(coef, coef, coef, coef), st.tuples(coef, coef, coef, coef), st.booleans())
def test_one_pass_equals_the_per_pass_arrays(lengths, counts, fw, bw, recompute):
    if not any(fw + bw):
        fw = (1.0,) + fw[1:]
    cost = CostModel(forward=PassCost(a=fw[0], b=fw[1], c=fw[2], d=fw[3]),
                     backward=PassCost(a=bw[0], b=bw[1], c=bw[2], d=bw[3]), recompute=recompute)
    lengths = np.array(lengths, dtype=np.int64)
    # microbatches of 0..6 entries (empty ones included) covering every entry
    cuts = np.minimum(np.concatenate([[0], np.cumsum(counts)]), lengths.shape[0])
    offsets = np.append(cuts[cuts < lengths.shape[0]], lengths.shape[0]).astype(np.int64)
    total, mb_f, mb_b = _reference(cost, lengths, offsets)
    got = blocks.doc_totals(cost, lengths)
    assert got.tobytes() == total.tobytes()
    f, b = blocks.microbatch_costs(cost, lengths, offsets)
    assert f.tobytes() == mb_f.tobytes() and b.tobytes() == mb_b.tobytes()


@pytest.mark.parametrize("name", ["quadratic-64k", "llama-70b", "gemma3-27b"])
def test_presets_equal_the_checked_path(name):
    """llama-70b: recompute; gemma3-27b: attention terms (the checked path itself)."""
    cost = load_cost_model(name)
    lengths = np.random.default_rng(1).integers(1, 200_000, 5000)
    offsets = np.arange(0, 5001, 7)
    offsets[-1] = 5000
    total, mb_f, mb_b = _reference(cost, lengths, offsets)
    assert blocks.doc_totals(cost, lengths).tobytes() == total.tobytes()
    f, b = blocks.microbatch_costs(cost, lengths, offsets)
    assert f.tobytes() == mb_f.tobytes() and b.tobytes() == mb_b.tobytes()


def test_refused_inputs_take_the_checked_path():
    cost = load_cost_model("quadratic-64k")
    offsets = np.array([0, 2, 3])
    with pytest.raises(ValueError, match="sample 1: length 0"):
        blocks.doc_totals(cost, np.array([5, 0, 7]))
    with pytest.raises(ValueError, match="sample 2: length 0"):
        blocks.microbatch_costs(cost, np.array([5, 6, 0]), offsets)
    # integral floats are lengths on the checked path: the same values
    floats = np.array([5.0, 6.0, 7.0])
    assert np.array_equal(blocks.doc_totals(cost, floats),
                          blocks.doc_totals(cost, floats.astype(np.int64)))
    huge = CostModel(forward=PassCost(a=1e300), backward=PassCost(a=1e300))
    with pytest.raises(ValueError, match="too large|overflows"):
        blocks.doc_totals(huge, np.array([10 ** 6, 3]))
    with pytest.raises(ValueError, match="too large|overflows"):
        blocks.microbatch_costs(huge, np.array([10 ** 6, 3, 4]), offsets)


def test_a_subclass_keeps_its_own_costs():
    class Doubled(CostModel):
        def doc_costs(self, lengths):
            f, b = super().doc_costs(lengths)
            return 2 * f, 2 * b

    cost = Doubled(forward=PassCost(b=1.0), backward=PassCost(b=2.0))
    assert blocks.doc_totals(cost, np.array([4, 5])).tolist() == [24.0, 30.0]
    f, b = blocks.microbatch_costs(cost, np.array([4, 5]), np.array([0, 2]))
    assert f.tolist() == [18.0] and b.tolist() == [36.0]
