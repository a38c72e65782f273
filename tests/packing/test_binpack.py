import numpy as np
import pytest
from hypothesis import given, strategies as st

import packing
from tests.naive import core as naive

sizes_st = st.lists(st.integers(1, 100), min_size=0, max_size=200)


@given(sizes_st, st.integers(100, 300))
def test_ffd_matches_reference(sizes, capacity):
    got, n = packing.first_fit_decreasing(np.array(sizes, dtype=np.int64), capacity)
    ref, n_ref = naive.ffd(sizes, capacity)
    assert n == n_ref
    assert np.array_equal(got, ref)


@given(sizes_st, st.integers(100, 300))
def test_bfd_matches_reference(sizes, capacity):
    got, n = packing.best_fit_decreasing(np.array(sizes, dtype=np.int64), capacity)
    n_ref, loads_ref = naive.bfd_bin_count(sizes, capacity)
    assert n == n_ref
    loads = np.bincount(got, weights=sizes, minlength=n) if sizes else np.zeros(0)
    assert sorted(loads.astype(int).tolist()) == loads_ref


@given(sizes_st, st.integers(100, 300))
def test_next_fit_matches_reference(sizes, capacity):
    got, n = packing.next_fit(np.array(sizes, dtype=np.int64), capacity)
    ref, n_ref = naive.next_fit(sizes, capacity)
    assert n == n_ref and np.array_equal(got, ref)


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=500), st.integers(5000, 20000),
       st.sampled_from(["next_fit", "ffd", "bfd"]))
def test_capacity_never_exceeded_and_lower_bound(sizes, capacity, algo):
    sizes = np.array(sizes, dtype=np.int64)
    bins, n = packing.BIN_PACKERS[algo](sizes, capacity)
    loads = np.bincount(bins, weights=sizes, minlength=n)
    assert loads.max() <= capacity
    assert (loads > 0).all()  # bins are numbered densely
    assert n >= packing.bins_lower_bound(sizes, capacity)


def test_bfd_efficiency_on_real_lengths(wlbllm):
    """Where capacity binds, BFD is within 0.5% of the bin-count lower bound."""
    sizes = wlbllm[:20000]
    _, n = packing.best_fit_decreasing(sizes, 131072)
    assert n <= np.ceil(packing.bins_lower_bound(sizes, 131072) / 0.995)


@pytest.mark.parametrize("bad,msg", [
    ([3, 0, 2], "sample 1: length 0 is not positive"),
    ([3, -4], "sample 1: length -4"),
    ([1.5, 2], "sample 0: length 1.5 is not an integer"),
    ([np.nan], "not an integer"),
    ([5, 11], "sample 1: length 11 exceeds the capacity 10"),
])
def test_bad_sizes_are_named(bad, msg):
    with pytest.raises(ValueError, match=msg):
        packing.first_fit_decreasing(np.array(bad), 10)


def test_bfd_capacity_limit():
    with pytest.raises(ValueError, match="exceeds the limit"):
        packing.best_fit_decreasing([1], packing.BFD_MAX_CAPACITY + 1)


def test_one_specialisation_per_kernel():
    from packing.binpack import _bfd, _ffd
    for dtype in (np.int32, np.int64, np.uint16, np.float64):
        packing.first_fit_decreasing(np.array([3, 2, 1], dtype=dtype), 5)
        packing.best_fit_decreasing(np.array([3, 2, 1], dtype=dtype), 5)
    assert len(_ffd.signatures) == 1 and len(_bfd.signatures) == 1
