"""A seeded uniform permutation of ``[0, n)``, defined here bit for bit (the default epoch order,
``balancer.planning.order.permutation_order``; ``tests/naive/order.py`` is the numpy reference
it must equal).

Rao and Sandelius' two-pass shuffle: every position ``i`` draws a bucket (the top ``bits`` bits
of splitmix64 at counter ``i + 1`` under ``bucket_key``), positions are scattered to their buckets
in increasing order, then each bucket is shuffled by Fisher-Yates with draws from one splitmix64
stream (``swap_key``), buckets in order. If the draws are uniform the result is a uniformly
random permutation; it is the same on every machine and numpy version (uint64 arithmetic,
wrapping mod 2**64). Why not ``numpy.random.Generator.permutation``: that one swaps over the
whole array (a cache miss per element at 1M+ samples) and its stream may change between numpy
versions; here a bucket (~16K positions) is shuffled in cache, and an int64 array (the lengths)
is carried along at no extra pass (``values``), where a gather would read it at random places.
"""
from __future__ import annotations

import numpy as np

from ._jit import kernel
from .permute import _mix as _splitmix  # splitmix64's finaliser

#: positions a bucket holds on average: its Fisher-Yates runs in the core's cache
BUCKET = 1 << 14
#: at most 2**MAX_BITS buckets (the scatter writes to that many places at once)
MAX_BITS = 12
#: splitmix64's increment
GOLDEN = 0x9E3779B97F4A7C15
#: the most positions: buckets then average at most 2**28 positions, far below the 2**32 that
#: the Fisher-Yates step's 32-bit draws reach (checked per bucket all the same)
MAX_N = 1 << 40


@kernel
def _draw(state, bound):
    """(next state, a draw uniform in [0, bound)): splitmix64's next output, Lemire's
    multiply-and-reject on its high 32 bits (exact; ``bound`` int64 in [1, 2**32])."""
    golden = np.uint64(GOLDEN)
    low = np.uint64(0xFFFFFFFF)
    s = np.uint64(bound)
    state += golden
    m = (_splitmix(state) >> np.uint64(32)) * s
    if (m & low) < s:
        reject = (low - s + np.uint64(1)) % s  # 2**32 mod s
        while (m & low) < reject:
            state += golden
            m = (_splitmix(state) >> np.uint64(32)) * s
    return state, np.int64(m >> np.uint64(32))


@kernel
def _bucket(bucket_key, i, shift):
    """The bucket of position ``i``: splitmix64 at counter ``i + 1``, shifted right by
    ``shift + 1`` (= 64 - bits)."""
    x = _splitmix(bucket_key + np.uint64(i + 1) * np.uint64(GOLDEN))
    return np.int64((x >> shift) >> np.uint64(1))


@kernel
def _scatter(n, bits, bucket_key, values, with_values, out, out_values):
    """Positions ``[0, n)`` into ``out`` (int64[n]) grouped by bucket (bucket of ``i``: the top
    ``bits`` bits of splitmix64 at counter ``i + 1`` under ``bucket_key``), in increasing order
    within a bucket; ``values[i]`` (int64[n]) to the same place of ``out_values`` if
    ``with_values``. Returns the buckets' starts (int64[2**bits + 1])."""
    n_buckets = 1 << bits
    start = np.zeros(n_buckets + 1, dtype=np.int64)
    shift = np.uint64(63 - bits)  # then one more: two shifts of < 64 bits (bits 0: bucket 0)
    # the buckets kept (2 bytes a position: MAX_BITS <= 16), not drawn again for the scatter:
    # the draws in a loop of their own, free of the counts' stores (1M positions, best of 21:
    # 6.3-9.4 -> 4.5-6.7 ms where the output's memory is reused; where it is fresh, its page
    # faults take most of the ~14 ms either way)
    bucket = np.empty(n, dtype=np.uint16)
    for i in range(n):
        bucket[i] = _bucket(bucket_key, i, shift)
    for i in range(n):
        start[bucket[i] + 1] += 1
    for b in range(n_buckets):
        start[b + 1] += start[b]
    fill = start[:n_buckets].copy()
    for i in range(n):
        b = bucket[i]
        p = fill[b]
        fill[b] = p + 1
        out[p] = i
        if with_values:
            out_values[p] = values[i]
    return start


@kernel
def _shuffle_buckets(start, swap_key, with_values, out, out_values):
    """Fisher-Yates in each bucket ``[start[b], start[b + 1])`` of ``out`` (int64), buckets in
    order, one stream of draws from ``swap_key``: slot j, from the last down, swaps with a slot
    drawn uniformly from ``[0, j]``; the same swaps in ``out_values`` if ``with_values``."""
    state = swap_key
    if not with_values:
        for b in range(start.shape[0] - 1):
            lo = start[b]
            for j in range(start[b + 1] - lo - 1, 0, -1):
                state, k = _draw(state, j + 1)
                t = out[lo + j]
                out[lo + j] = out[lo + k]
                out[lo + k] = t
        return
    # with values, a bucket's (position, value) pairs are shuffled side by side in a scratch
    # copy: a swap then touches one cache line where the two arrays took two (1M positions,
    # best of 21: 10.2-14.4 -> 4.9-8.5 ms, the copies in and out included)
    largest = 0
    for b in range(start.shape[0] - 1):
        largest = max(largest, start[b + 1] - start[b])
    pair = np.empty((largest, 2), dtype=np.int64)
    for b in range(start.shape[0] - 1):
        lo = start[b]
        size = start[b + 1] - lo
        for j in range(size):
            pair[j, 0] = out[lo + j]
            pair[j, 1] = out_values[lo + j]
        for j in range(size - 1, 0, -1):
            state, k = _draw(state, j + 1)
            p0 = pair[j, 0]
            p1 = pair[j, 1]
            pair[j, 0] = pair[k, 0]
            pair[j, 1] = pair[k, 1]
            pair[k, 0] = p0
            pair[k, 1] = p1
        for j in range(size):
            out[lo + j] = pair[j, 0]
            out_values[lo + j] = pair[j, 1]


def bucket_bits(n: int) -> int:
    """log2 of the bucket count for ``n`` positions: ~BUCKET positions a bucket, at most
    2**MAX_BITS buckets (part of the permutation's definition)."""
    bits = 0
    while bits < MAX_BITS and (BUCKET << bits) < n:
        bits += 1
    return bits


def seeded_permutation(n: int, bucket_key: int, swap_key: int, values=None):
    """The permutation of ``[0, n)`` under two uint64 keys (int64[n]); with ``values``
    (int64[n]) also ``values[permutation]``, returned as a pair."""
    n = int(n)
    if not 0 <= n <= MAX_N:
        raise ValueError(f"n={n}: a seeded permutation takes 0..{MAX_N} positions")
    out = np.empty(n, dtype=np.int64)
    with_values = values is not None
    if with_values:
        values = np.ascontiguousarray(values, dtype=np.int64)
        if values.shape != (n,):
            raise ValueError(f"values of shape {values.shape}: expected ({n},)")
        out_values = np.empty(n, dtype=np.int64)
    else:
        values = out_values = np.zeros(0, dtype=np.int64)
    # read-only always (a SampleTable's lengths are): one compiled signature of the scatter
    values = values.view()
    values.setflags(write=False)
    start = _scatter(np.int64(n), np.int64(bucket_bits(n)), np.uint64(bucket_key), values,
                     np.bool_(with_values), out, out_values)
    if n and int(np.diff(start).max()) > 1 << 32:  # never at n <= MAX_N, short of a broken draw
        raise ValueError(f"a bucket of {int(np.diff(start).max())} positions: the shuffle draws "
                         f"32 bits")
    _shuffle_buckets(start, np.uint64(swap_key), np.bool_(with_values), out, out_values)
    return (out, out_values) if with_values else out
