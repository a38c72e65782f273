"""The busiest CP rank's causal attention work under zigzag sharding, per document and group size.

Zigzag sharding cuts a document of ``L`` tokens into ``2g`` chunks of ``c = ceil(L / 2g)`` tokens
(the last ones padded) and gives rank ``r`` chunks ``r`` and ``2g - 1 - r``; a chunk's causal work
is ``tri(hi) - tri(lo)`` query-key pairs with ``tri(x) = x (x + 1) / 2`` (padding carries none).
The CP cost table needs only the largest rank's work per (document, group size): computing it in
one pass avoids the ``[n, g]`` array per size that :func:`balancer.zigzag.zigzag_attention`
builds (2,000 numpy calls per 64-rank table). The sums run in the same order as there, so the
figures are bit-identical to ``zigzag_attention(lengths, g).max(axis=1)``.
"""
from __future__ import annotations

import numpy as np

from ._jit import kernel


@kernel
def _tri(x):
    xf = float(x)
    return xf * (xf + 1.0) / 2.0


@kernel
def _zigzag_max_pairs(lengths, sizes, out):
    """``out[i, j]`` = the largest per-rank pair count of document ``i`` on ``sizes[j]`` ranks
    (float64[n, k]; ``lengths`` int64[n] > 0, ``sizes`` int64[k] >= 1)."""
    n, k = lengths.shape[0], sizes.shape[0]
    for i in range(n):
        L = lengths[i]
        for j in range(k):
            g = sizes[j]
            if g == 1:
                out[i, j] = _tri(L)
                continue
            c = -(-L // (2 * g))
            best = 0.0
            for r in range(g):
                w = 0.0
                lo = min(r * c, L)
                hi = min((r + 1) * c, L)
                w += _tri(hi) - _tri(lo)
                q = 2 * g - 1 - r
                lo = min(q * c, L)
                hi = min((q + 1) * c, L)
                w += _tri(hi) - _tri(lo)
                if w > best:
                    best = w
            out[i, j] = best


def zigzag_max_pairs(lengths: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """float64[len(lengths), len(sizes)]: the busiest rank's causal query-key pairs of every
    document on every group size (``sizes[j] == 1``: the whole document's pairs)."""
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)
    if lengths.ndim != 1 or sizes.ndim != 1:
        raise ValueError("lengths and sizes must be 1-D")
    if sizes.size and int(sizes.min()) < 1:
        raise ValueError(f"group sizes must be >= 1, got {int(sizes.min())}")
    out = np.empty((lengths.shape[0], sizes.shape[0]))
    _zigzag_max_pairs(lengths, sizes, out)
    return out
