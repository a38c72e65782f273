"""Cutting over-long documents into capacity-sized pieces, in stream order."""
from __future__ import annotations

import numpy as np

from ._jit import kernel


@kernel
def _count_pieces(lengths, max_piece):
    total = lengths.shape[0]
    for i in range(lengths.shape[0]):
        if lengths[i] > max_piece:  # rare: no division for the others
            total += (lengths[i] - 1) // max_piece
    return total


@kernel
def _expand(ids, lengths, max_piece, sample, start, length):
    k = 0
    for i in range(ids.shape[0]):
        L = lengths[i]
        if L <= max_piece:  # one piece, the common case
            sample[k] = ids[i]
            start[k] = 0
            length[k] = L
            k += 1
            continue
        s = 0
        while True:
            piece = L - s if L - s < max_piece else max_piece
            sample[k] = ids[i]
            start[k] = s
            length[k] = piece
            k += 1
            s += piece
            if s >= L:
                break


def expand_pieces(ids, lengths, max_piece: int):
    """Items for documents ``ids`` (int64[n]) of ``lengths`` (int64[n], each >= 1), every
    document longer than ``max_piece`` cut into pieces of ``max_piece`` tokens (the last one
    shorter), pieces kept consecutive. Returns ``(sample, start, length)``, int64 arrays."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    if max_piece <= 0:
        raise ValueError(f"piece size {max_piece} must be positive")
    total = int(_count_pieces(lengths, np.int64(max_piece)))
    sample = np.empty(total, dtype=np.int64)
    start = np.empty(total, dtype=np.int64)
    length = np.empty(total, dtype=np.int64)
    _expand(ids, lengths, np.int64(max_piece), sample, start, length)
    return sample, start, length
