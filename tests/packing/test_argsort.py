"""packing.argsort: the linear-time stable argsort gives numpy's stable order exactly."""
import numpy as np
from hypothesis import given, strategies as st

from packing.argsort import SMALL, argsort_int


@given(st.lists(st.integers(-2**63, 2**63 - 1), max_size=300))
def test_argsort_int_equals_numpy_stable_argsort(values):
    a = np.array(values, dtype=np.int64)
    assert np.array_equal(argsort_int(a), np.argsort(a, kind="mergesort"))


@given(st.integers(0, 2**16), st.integers(SMALL + 1, 5000),
       st.sampled_from([1, 3, 40, 32768, 2**40, 2**62]))
def test_argsort_int_of_many_items_with_ties_equals_numpy(seed, n, top):
    rng = np.random.default_rng(seed)
    a = rng.integers(-top, top, n, endpoint=True)
    assert np.array_equal(argsort_int(a), np.argsort(a, kind="mergesort"))


def test_argsort_int_at_the_int64_extremes():
    a = np.array([2**63 - 1, -2**63, 0, -1, 2**63 - 1, -2**63] * 10, dtype=np.int64)
    assert np.array_equal(argsort_int(a), np.argsort(a, kind="mergesort"))
