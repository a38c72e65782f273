"""A stable argsort of integer keys for the planner's per-step sorts, in linear time.

numba's ``np.argsort(a, kind="mergesort")`` costs about 37 ns an item at a few hundred items
(768 items: 29 us; its quicksort 11 us), and the token-first step sorts that many every step:
where every document is longer than half a microbatch, the planner spent a third of its time
there. :func:`_argsort_int` gives the same order (value ascending, ties in index order) by an
LSD radix sort over the bits the values span (digits of 8 bits or more, as wide as the item
count allows) and an insertion sort at :data:`SMALL` items or fewer.
"""
from __future__ import annotations

import numpy as np

from ._jit import kernel

#: at most this many items are sorted by insertion (no counting arrays to clear)
SMALL = 32


@kernel
def _argsort_int(a, out):
    """Fill ``out`` (int64[n]) with the indices of ``a`` (int64[n]) by value ascending, ties in
    index order: ``np.argsort(a, kind="mergesort")``."""
    n = a.shape[0]
    for i in range(n):
        out[i] = i
    if n <= SMALL:
        for t in range(1, n):
            j = out[t]
            v = a[j]
            q = t
            while q > 0 and a[out[q - 1]] > v:
                out[q] = out[q - 1]
                q -= 1
            out[q] = j
        return
    lo = a[0]
    hi = a[0]
    for i in range(1, n):
        if a[i] < lo:
            lo = a[i]
        if a[i] > hi:
            hi = a[i]
    # offsets from the least value, as uint64: the span of any two int64 values fits
    ulo = np.uint64(lo)
    span = np.uint64(hi) - ulo
    bits = 0
    while span > np.uint64(0):
        bits += 1
        span >>= np.uint64(1)
    if bits == 0:
        return  # every value equal: index order
    # digits no wider than log2(n) (at least 8): the counting arrays stay small beside n
    maxw = 8
    while (1 << (maxw + 1)) <= n:
        maxw += 1
    passes = (bits + maxw - 1) // maxw
    width = (bits + passes - 1) // passes
    nd = 1 << width
    mask = np.uint64(nd - 1)
    ka = np.empty(n, dtype=np.uint64)
    for i in range(n):
        ka[i] = np.uint64(a[i]) - ulo
    kb = np.empty(n, dtype=np.uint64)
    b = np.empty(n, dtype=np.int64)
    c = np.empty(nd + 1, dtype=np.int64)
    src = out
    dst = b
    for q in range(passes):
        sh = np.uint64(q * width)
        c[:] = 0
        for i in range(n):
            c[((ka[i] >> sh) & mask) + 1] += 1
        if c[((ka[0] >> sh) & mask) + 1] == n:
            continue  # every key has this digit: no reorder
        for d in range(nd):
            c[d + 1] += c[d]
        for i in range(n):
            d = (ka[i] >> sh) & mask
            p = c[d]
            dst[p] = src[i]
            kb[p] = ka[i]
            c[d] = p + 1
        src, dst = dst, src
        ka, kb = kb, ka
    if src is not out:
        out[:] = src


def argsort_int(a) -> np.ndarray:
    """``np.argsort(a, kind="mergesort")`` of integer keys (int64[n] indices)."""
    a = np.ascontiguousarray(a, dtype=np.int64)
    out = np.empty(a.shape[0], dtype=np.int64)
    _argsort_int(a, out)
    return out
