"""packing.zigzag_work: the busiest zigzag rank's attention pairs, against a token-by-token count
and bit for bit against balancer.zigzag.zigzag_attention (which the CP cost table used before)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from balancer.zigzag import zigzag_attention
from packing.zigzag_work import zigzag_max_pairs


def busiest_by_tokens(L: int, g: int) -> int:
    """Count it token by token: rank r holds positions of chunks r and 2g-1-r (chunk size
    ceil(L / 2g)); a token at position p attends to p + 1 keys; padding positions (>= L) none."""
    c = -(-L // (2 * g))
    best = 0
    for r in range(g):
        pos = [p for j in (r, 2 * g - 1 - r) for p in range(j * c, (j + 1) * c) if p < L]
        best = max(best, sum(p + 1 for p in pos))
    return best


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 700), min_size=1, max_size=6),
       k=st.integers(1, 6))
def test_equals_the_token_count(lengths, k):
    sizes = 1 << np.arange(k, dtype=np.int64)
    got = zigzag_max_pairs(np.array(lengths), sizes)
    want = np.array([[busiest_by_tokens(L, int(g)) for g in sizes] for L in lengths], float)
    assert np.array_equal(got, want)


def test_bit_identical_to_zigzag_attention_on_long_documents():
    rng = np.random.default_rng(3)
    L = np.concatenate([rng.integers(1, 2_000_000, 3000), [1, 2, 3, 127, 128, 129, 4095]])
    sizes = 1 << np.arange(8, dtype=np.int64)
    got = zigzag_max_pairs(L, sizes)
    for j, g in enumerate(sizes.tolist()):
        assert np.array_equal(got[:, j], zigzag_attention(L, g).max(axis=1)), g


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="group sizes must be >= 1, got 0"):
        zigzag_max_pairs(np.array([4]), np.array([0, 1]))
    assert zigzag_max_pairs(np.zeros(0, np.int64), np.array([1, 2])).shape == (0, 2)
