"""Gathers of several int64 arrays by one index array in one compiled pass: a plan's entries
take their sample, start and length from the epoch's items at once, where three ``np.take``
calls read the (scattered) index three times."""
from __future__ import annotations

import numpy as np

from ._jit import kernel


@kernel
def _take3(idx, a, b, c, out_a, out_b, out_c):
    """``out_x[k] = x[idx[k]]`` for x in a, b, c (int64; ``idx`` int64[k]). Returns -1, or
    the first position whose index is outside ``[0, len(a))`` (nothing gathered from there
    on): the bounds are checked in the gather's own pass, not in two reductions before it."""
    n = a.shape[0]
    for k in range(idx.shape[0]):
        i = idx[k]
        if i < 0 or i >= n:
            return k
        out_a[k] = a[i]
        out_b[k] = b[i]
        out_c[k] = c[i]
    return -1


def take3(idx, a, b, c) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(a[idx], b[idx], c[idx])`` of three int64 arrays of one length; ``idx`` (int64[k]) is
    checked to lie in ``[0, len(a))``."""
    idx = np.ascontiguousarray(idx, dtype=np.int64)
    a, b, c = (np.ascontiguousarray(x, dtype=np.int64) for x in (a, b, c))
    n = a.shape[0]
    if b.shape[0] != n or c.shape[0] != n:
        raise ValueError(f"arrays of {n}, {b.shape[0]} and {c.shape[0]} elements: expected one length")
    out = [np.empty(idx.shape[0], dtype=np.int64) for _ in range(3)]
    bad = _take3(idx, a, b, c, *out)
    if bad >= 0:
        raise ValueError(f"index {int(idx[bad])} at position {bad} outside 0..{n - 1} "
                         f"(indices {int(idx.min())}..{int(idx.max())})")
    return out[0], out[1], out[2]
