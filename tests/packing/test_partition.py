import numpy as np
import pytest
from hypothesis import given, strategies as st

import packing
from tests.naive import core as naive


def _groups(draw_n, m):
    return st.integers(1, draw_n).map(lambda k: k * m)


@st.composite
def equal_problem(draw, max_k=12):
    m = draw(st.integers(1, 6))
    k = draw(st.integers(1, max_k))
    costs = draw(st.lists(st.floats(0, 1000, allow_nan=False), min_size=m * k, max_size=m * k))
    return np.array(costs), m


@given(equal_problem())
def test_lpt_equal_matches_reference(p):
    costs, m = p
    got = packing.lpt_equal(costs, m)
    ref = naive.lpt_equal(costs.tolist(), m)
    assert np.allclose(np.sort(packing.group_loads(costs, got, m)),
                       np.sort(packing.group_loads(costs, ref, m)))


@given(equal_problem(), st.sampled_from(["lpt", "kk", "balanced"]))
def test_equal_counts(p, algo):
    costs, m = p
    g = packing.PARTITIONERS[algo](costs, m)
    assert np.array_equal(np.bincount(g, minlength=m), np.full(m, len(costs) // m))


@given(equal_problem())
def test_refine_never_worse_and_keeps_counts(p):
    costs, m = p
    g0 = packing.lpt_equal(costs, m)
    g1 = packing.refine_swaps(costs, g0, m)
    assert np.array_equal(np.bincount(g1, minlength=m), np.bincount(g0, minlength=m))
    assert packing.group_loads(costs, g1, m).max() <= packing.group_loads(costs, g0, m).max() + 1e-9


@given(st.integers(2, 3).flatmap(lambda m: st.tuples(
    st.just(m), st.lists(st.integers(1, 50), min_size=2 * m, max_size=2 * m))))
def test_balanced_close_to_optimal_on_tiny(p):
    m, costs = p
    costs = np.array(costs, dtype=float)
    g = packing.balanced_equal(costs, m)
    opt = naive.best_equal_partition_max(costs, m)
    # LPT's guarantee for equal-cardinality partitioning is 4/3 - 1/(3m); KK/refine do better
    assert packing.group_loads(costs, g, m).max() <= opt * (4 / 3) + 1e-9


def test_kk_unconstrained_covers_all(rng):
    costs = rng.random(37) * 100
    g = packing.kk(costs, 5)
    assert g.min() >= 0 and g.max() < 5
    loads = packing.group_loads(costs, g, 5)
    assert loads.max() - loads.min() < costs.max()


def test_bad_partition_inputs():
    with pytest.raises(ValueError, match="cannot be split into 3 groups"):
        packing.lpt_equal([1.0, 2.0], 3)
    with pytest.raises(ValueError, match="sample 1: cost nan"):
        packing.kk_equal([1.0, np.nan], 2)
