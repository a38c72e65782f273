"""Martello-Toth L2 (packing.bins_lower_bound_l2) against the exact minimum by exhaustive search
and against its definition evaluated at every threshold."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import packing
from tests.naive import core as naive


@st.composite
def instances(draw, max_items=9):
    capacity = draw(st.integers(2, 40))
    sizes = draw(st.lists(st.integers(1, capacity), min_size=0, max_size=max_items))
    return sizes, capacity


@settings(max_examples=300, deadline=None)
@given(instances())
def test_between_ceil_bound_and_optimum(inst):
    sizes, capacity = inst
    l2 = packing.bins_lower_bound_l2(np.array(sizes, dtype=np.int64), capacity)
    assert l2 >= packing.bins_lower_bound(np.array(sizes, dtype=np.int64), capacity)
    assert l2 <= naive.min_bins_exact(sizes, capacity)


@settings(max_examples=300, deadline=None)
@given(instances(max_items=60))
def test_matches_definition(inst):
    sizes, capacity = inst
    assert packing.bins_lower_bound_l2(np.array(sizes, dtype=np.int64), capacity) == \
        naive.bins_lower_bound_l2(sizes, capacity)


def test_random_small_instances_seeded():
    """Fixed random instances (not only what hypothesis draws): L2 <= optimum, >= ceil bound,
    and equal to the optimum on most of them."""
    rng = np.random.default_rng(0)
    tight = 0
    for _ in range(200):
        capacity = int(rng.integers(10, 100))
        sizes = rng.integers(1, capacity + 1, size=int(rng.integers(1, 10))).tolist()
        opt = naive.min_bins_exact(sizes, capacity)
        l2 = packing.bins_lower_bound_l2(np.array(sizes), capacity)
        assert packing.bins_lower_bound(np.array(sizes), capacity) <= l2 <= opt
        tight += l2 == opt
    assert tight >= 150


def test_items_above_half_capacity_never_share():
    # three items of 0.6 C: ceil(1.8) = 2 bins by tokens, 3 in fact; L2 proves 3
    assert packing.bins_lower_bound(np.array([60, 60, 60]), 100) == 2
    assert packing.bins_lower_bound_l2(np.array([60, 60, 60]), 100) == 3
    # half the capacity exactly: two share a bin
    assert packing.bins_lower_bound_l2(np.array([50, 50, 50, 50]), 100) == 2
    # 4 x 70 leave 4 x 30 that no 35 fits: 4 + ceil(6 x 35 / 100) = 7 bins (tokens say 5)
    sizes = [70] * 4 + [35] * 6
    assert packing.bins_lower_bound(np.array(sizes), 100) == 5
    assert packing.bins_lower_bound_l2(np.array(sizes), 100) == 7
    assert naive.min_bins_exact(sizes, 100) == 7


def test_empty_and_bad_input():
    assert packing.bins_lower_bound_l2(np.zeros(0, dtype=np.int64), 10) == 0
    with pytest.raises(ValueError, match="sample 1: length 11 exceeds the capacity 10"):
        packing.bins_lower_bound_l2(np.array([5, 11]), 10)
    with pytest.raises(ValueError, match="sample 1: length 0 is not positive"):
        packing.bins_lower_bound_l2(np.array([3, 0]), 10)
