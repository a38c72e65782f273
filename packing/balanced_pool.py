"""The ``balanced`` planner's pool of items read but not yet placed (state kept across steps):
slots of stream indices (int64), their arrival steps (int64, minus the steps read early for a
look-ahead lump), a going-now flag (bool) and the slots holding heavy items ("lumps"), grown by
doubling; and the compaction that drops the items a step placed."""
from __future__ import annotations

import numpy as np

from ._jit import kernel


def _grower(name):
    """A kernel ``name(a, need)``: ``a``, or a copy doubled until it holds ``need`` items. One
    kernel per element type (numba compiles a kernel once per argument type; one signature a
    kernel, tests/packing/test_signatures.py), all from this one body."""
    def grow(a, need):
        if need <= a.shape[0]:
            return a
        cap = a.shape[0] * 2
        while cap < need:
            cap *= 2
        b = np.empty(cap, dtype=a.dtype)
        b[:a.shape[0]] = a
        return b
    grow.__name__ = grow.__qualname__ = name   # its name in listings and its cache file's
    return kernel(grow)


_grow = _grower("_grow")              # int64 arrays
_grow_float = _grower("_grow_float")  # float64 arrays
_grow_bool = _grower("_grow_bool")    # bool arrays


@kernel
def _grow_pool(pool, parr, now, ls, need, need_ls):
    """The pool arrays with room for ``need`` items, ``ls`` for ``need_ls`` lump slots
    (doubled until they fit)."""
    return _grow(pool, need), _grow(parr, need), _grow_bool(now, need), _grow(ls, need_ls)


@kernel
def _pool_add(pool, parr, now, ls, np_, nls, i, arrival, going, lump):
    """Put stream item ``i`` in pool slot ``np_`` (the arrays have room: :func:`_grow_pool`),
    arrived at step ``arrival``; a lump's slot joins ``ls``. Returns the new lump count."""
    pool[np_] = i
    parr[np_] = arrival
    now[np_] = going
    if lump:
        ls[nls] = np_
        return nls + 1
    return nls


@kernel
def _compact_pool(pool, parr, ls, np_, placed, sizes, costs, w, cpt, thr, capacity):
    """Drop the slots a step placed (``placed`` bool[np_]), keeping pool order; rebuild the lump
    slots ``ls`` and the light weight. Returns (items left, lumps among them, their light
    weight, how many of them are longer than half the ``capacity``, the lumps' tokens)."""
    j = 0
    nls = 0
    fluid_w = 0
    nlong = np.int64(0)
    lump_tok = np.int64(0)
    for k in range(np_):
        if not placed[k]:
            i = pool[k]
            pool[j] = i
            parr[j] = parr[k]
            if (costs[i] - sizes[i] * cpt > thr):
                ls[nls] = j
                nls += 1
                lump_tok += sizes[i]
            else:
                fluid_w += w[i]
            if 2 * sizes[i] > capacity:
                nlong += 1
            j += 1
    return j, nls, fluid_w, nlong, lump_tok
