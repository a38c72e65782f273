"""The default epoch order (``order='permutation'``, packing/shuffle.py): a permutation of [0, n)
equal bit for bit to the reference written from its definition (tests/naive/order.py), the
lengths carried through it equal to a gather, uniform over permutations, pinned to known values
(the order is a public, stable definition: a plan recomputed after an upgrade must not move
samples), and the same in another process."""
from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer.planning.order import permutation_order
from balancer.planning.stream import epoch_order
from packing.shuffle import BUCKET, MAX_N, bucket_bits, seeded_permutation
from tests.naive.order import permutation as naive_permutation


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 3000), seed=st.integers(0, 2 ** 63 - 1), epoch=st.integers(0, 10 ** 6))
def test_small_orders_equal_the_reference(n, seed, epoch):
    order = epoch_order(n, seed, epoch)
    assert order.dtype == np.int64 and order.shape == (n,)
    assert np.array_equal(np.sort(order), np.arange(n))
    assert np.array_equal(order, naive_permutation(n, seed, epoch))


@pytest.mark.parametrize("n", [BUCKET, BUCKET + 1, 2 * BUCKET + 7, 5 * BUCKET - 3])
def test_bucketed_orders_equal_the_reference(n):
    assert bucket_bits(n) == (0 if n <= BUCKET else int(np.ceil(np.log2(n / BUCKET))))
    for seed, epoch in ((0, 0), (7, 3)):
        order = epoch_order(n, seed, epoch)
        assert np.array_equal(np.sort(order), np.arange(n))
        assert np.array_equal(order, naive_permutation(n, seed, epoch))


def test_values_are_carried_through_the_shuffle():
    rng = np.random.default_rng(0)
    for n in (0, 1, 5000, 3 * BUCKET + 11):
        values = rng.integers(1, 1 << 40, n)
        order, carried = permutation_order(n, 11, 2, values=values)
        assert np.array_equal(order, epoch_order(n, 11, 2))
        assert np.array_equal(carried, values[order])
    with pytest.raises(ValueError, match=r"shape \(3,\): expected \(4,\)"):
        seeded_permutation(4, 1, 2, values=np.arange(3))
    with pytest.raises(ValueError, match="0..1099511627776 positions"):
        seeded_permutation(MAX_N + 1, 1, 2)


def test_every_permutation_equally_often():
    """4 samples, 4,800 seeds: each of the 24 orders ~200 times (chi-square, 23 degrees of
    freedom: 60 is far in its tail, p < 1e-4; the seeds are fixed, so the count is too)."""
    index = {p: k for k, p in enumerate(itertools.permutations(range(4)))}
    counts = np.zeros(24)
    for seed in range(4800):
        counts[index[tuple(epoch_order(4, seed, 0))]] += 1
    chi2 = float(((counts - 200.0) ** 2 / 200.0).sum())
    assert counts.min() > 0 and chi2 < 60, (counts, chi2)


def test_positions_uniform_across_buckets():
    """With several buckets a sample must still land anywhere: over 300 seeds the mean position
    of samples 0 and n-1 is near (n - 1) / 2 (standard error ~ n / sqrt(12 * 300) = 0.017 n)."""
    n = 3 * BUCKET
    first = np.empty(300)
    last = np.empty(300)
    for seed in range(300):
        inverse = np.argsort(epoch_order(n, seed, 1))
        first[seed], last[seed] = inverse[0], inverse[n - 1]
    for pos in (first, last):
        assert abs(pos.mean() / (n - 1) - 0.5) < 0.07, pos.mean() / (n - 1)
        assert pos.min() < 0.05 * n and pos.max() > 0.95 * n


def test_known_values():
    """The definition pinned: changing the shuffle changes every plan."""
    assert epoch_order(10, 0, 0).tolist() == KNOWN_10
    head = epoch_order(100_000, 3, 1)[:8].tolist()
    assert head == KNOWN_100K_HEAD


def test_same_order_in_another_process():
    import hashlib
    import os
    code = ("import hashlib; from balancer.planning.stream import epoch_order; "
            "print(hashlib.sha256(epoch_order(70000, 5, 2).tobytes()).hexdigest())")
    here = hashlib.sha256(epoch_order(70000, 5, 2).tobytes()).hexdigest()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONHASHSEED": "7"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == here


KNOWN_10 = [7, 9, 4, 0, 2, 3, 5, 8, 6, 1]
KNOWN_100K_HEAD = [84797, 29427, 22601, 63224, 86733, 60214, 1917, 79476]
