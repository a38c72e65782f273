"""Zigzag CP sharding geometry, shared by the cost model, the planner, the metrics and the CP
sharder: every document is padded to a multiple of ``2 x cp`` tokens (:func:`cp_pad_unit`) and
cut into ``2 cp`` chunks, rank ``r`` holding chunks ``r`` and ``2 cp - 1 - r`` so that causal
attention work is near equal across the CP ranks (:func:`zigzag_attention`).

Numpy only: the loader imports it, and it must not pull in numba or the planner."""
from __future__ import annotations

import numpy as np


def cp_pad_unit(cp: int) -> int:
    """The multiple every document's length is padded to under CP degree ``cp``: ``2 cp``
    (two zigzag chunks per rank), or 1 (no padding) without CP."""
    return 2 * cp if cp > 1 else 1


def padded_lengths(lengths: np.ndarray, cp: int) -> np.ndarray:
    """int64[N]: each document's length rounded up to a multiple of ``2 cp`` (as it is when
    cp == 1): the tokens it occupies in a microbatch and in the CP shards."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if cp <= 1:
        return lengths
    unit = cp_pad_unit(cp)
    return -(-lengths // unit) * unit


def zigzag_attention(lengths: np.ndarray, cp: int) -> np.ndarray:
    """Causal attention work (query-key pairs) of every CP rank for documents of these lengths
    under zigzag sharding: float64[len(lengths), cp]. Padding tokens carry no work."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if cp == 1:
        lf = lengths.astype(np.float64)
        return (lf * (lf + 1) / 2)[:, None]
    c = -(-lengths // (2 * cp))  # chunk size per document
    out = np.zeros((lengths.shape[0], cp))

    def tri(x):  # sum_{p < x} (p + 1)
        x = x.astype(np.float64)
        return x * (x + 1) / 2

    for r in range(cp):
        for j in (r, 2 * cp - 1 - r):
            lo = np.minimum(j * c, lengths)
            hi = np.minimum((j + 1) * c, lengths)
            out[:, r] += tri(hi) - tri(lo)
    return out
