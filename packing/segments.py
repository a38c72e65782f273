"""Sums over consecutive segments of an array (the entries of each microbatch of a plan), in
entry order: ``out[j] += values[offsets[j] - base] + ... `` summed from 0.0 left to right, the
same float sums as ``np.bincount(segment_of_entry, weights=values)``, without the per-entry
segment ids (a binary search per entry) that bincount needs."""
from __future__ import annotations

import numpy as np

from ._jit import kernel


@kernel
def _add_segment_sums(values, offsets, base, out):
    """``out[j] += sum(values[offsets[j] - base:offsets[j + 1] - base])`` for every segment
    ``j`` (``offsets`` int64[S + 1], ``values`` float64 covering ``offsets[0] - base ..
    offsets[S] - base``, ``out`` float64[S])."""
    for j in range(offsets.shape[0] - 1):
        s = 0.0
        for e in range(offsets[j] - base, offsets[j + 1] - base):
            s += values[e]
        out[j] += s


def add_segment_sums(values, offsets, base: int, out) -> None:
    """Add the sum of every segment of ``values`` (float64) to ``out`` (float64[S], in place):
    segment ``j`` is ``values[offsets[j] - base:offsets[j + 1] - base]`` (``offsets``
    int64[S + 1], non-decreasing), summed in order from 0.0."""
    values = np.ascontiguousarray(values, dtype=np.float64)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    if out.dtype != np.float64 or out.shape != (offsets.shape[0] - 1,):
        raise ValueError(f"out must be float64[{offsets.shape[0] - 1}], got {out.dtype}{list(out.shape)}")
    if offsets.shape[0] > 1:
        if offsets[0] < base or offsets[-1] - base > values.shape[0] or (np.diff(offsets) < 0).any():
            raise ValueError(f"offsets {offsets[0]}..{offsets[-1]} (base {base}) must be "
                             f"non-decreasing and within the {values.shape[0]} values")
    _add_segment_sums(values, offsets, np.int64(base), out)
