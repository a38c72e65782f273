"""Array-backed binary min-heap for numba kernels: ``keys`` float64[cap], ``ids`` int64[cap].

Ties on the key are broken by the id, so every heap operation is deterministic."""
from __future__ import annotations

import numpy as np

from ._jit import kernel


@kernel
def _less(keys, ids, a, b):
    return keys[a] < keys[b] or (keys[a] == keys[b] and ids[a] < ids[b])


@kernel
def _swap(keys, ids, a, b):
    k = keys[a]
    keys[a] = keys[b]
    keys[b] = k
    t = ids[a]
    ids[a] = ids[b]
    ids[b] = t


@kernel
def heap_push(keys, ids, size, key, ident):
    """Insert (key, ident); returns the new size."""
    i = size
    keys[i] = key
    ids[i] = ident
    while i > 0:
        parent = (i - 1) // 2
        if _less(keys, ids, i, parent):
            _swap(keys, ids, i, parent)
            i = parent
        else:
            break
    return size + 1


@kernel
def heap_pop(keys, ids, size):
    """Remove the smallest entry (left at index ``size - 1``); returns the new size."""
    last = size - 1
    _swap(keys, ids, np.int64(0), last)
    i = np.int64(0)
    while True:
        left = 2 * i + 1
        if left >= last:
            break
        smallest = left
        right = left + 1
        if right < last and _less(keys, ids, right, left):
            smallest = right
        if _less(keys, ids, smallest, i):
            _swap(keys, ids, i, smallest)
            i = smallest
        else:
            break
    return last
