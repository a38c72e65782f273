"""The epoch permutation equals numpy's ``Generator.permutation`` bit for bit (the draws are
numpy's own: a change in numpy's shuffle fails here, not silently in a plan)."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from packing.shuffle import permutation


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 5000), st.integers(0, 2**32 - 1), st.integers(0, 1000))
def test_permutation_equals_numpy(n, seed, epoch):
    ref = np.random.default_rng([seed, epoch]).permutation(n)
    got = permutation(np.random.default_rng([seed, epoch]), n)
    assert got.dtype == np.int64 and np.array_equal(got, ref)


@pytest.mark.parametrize("n", [2, 3, 255, 256, 257, 65536, 65537, 400_000])
def test_permutation_equals_numpy_at_power_of_two_edges(n):
    # the rejection mask shrinks as i crosses each power of two
    for seed in range(3):
        ref = np.random.default_rng([seed, 1]).permutation(n)
        assert np.array_equal(permutation(np.random.default_rng([seed, 1]), n), ref)


def test_other_generators_are_numpys():
    ref = np.random.Generator(np.random.Philox(7)).permutation(1000)
    assert np.array_equal(permutation(np.random.Generator(np.random.Philox(7)), 1000), ref)
