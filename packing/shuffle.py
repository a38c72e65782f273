"""The permutation ``numpy.random.Generator.permutation(n)`` returns, bit for bit, in less time.

numpy shuffles ``arange(n)`` by Fisher-Yates: for i = n-1 down to 1 it draws j uniform in
0..i (``random_interval``: masked rejection on the bit generator's 32-bit stream while i fits 32
bits, on its 64-bit stream above that) and swaps elements i and j. Its loop alternates a draw
(a call through the bit generator, a mispredicted rejection branch) with a swap at a random
place of an 8 MB array, so the swaps' cache misses are served one at a time. Here the draws come
first, from the generator's raw 64-bit outputs (``bit_generator.random_raw``: the 32-bit stream
is each output's low half, then its high half, as numpy's buffered ``next_uint32`` gives them),
and the swaps then run in a tight loop whose misses overlap. Same draws, same swaps: the same
permutation (``tests/packing/test_shuffle.py`` checks it against numpy's).
"""
from __future__ import annotations

import sys

import numpy as np

from ._jit import kernel

_U32 = 0xFFFFFFFF


@kernel
def _draw_js(words, k, i, out_j):
    """Draw ``out_j[i], out_j[i-1], ...`` (each uniform in ``0..i`` by masked rejection on the
    uint32 ``words`` from index ``k``) until i reaches 0 or the words run out. Every i here is
    below 2**32. Returns (the next i to draw for, the next word)."""
    nw = words.shape[0]
    if i <= 0:
        return i, k
    mask = np.uint64(i)  # the smallest all-ones mask covering i
    mask |= mask >> np.uint64(1)
    mask |= mask >> np.uint64(2)
    mask |= mask >> np.uint64(4)
    mask |= mask >> np.uint64(8)
    mask |= mask >> np.uint64(16)
    # no branch on the rejection (a coin flip the predictor misses): every word is written to
    # out_j[i], and i moves on only when it was accepted (the next draw overwrites a rejected one)
    while i > 0 and k < nw:
        v = np.uint64(words[k]) & mask
        k += 1
        out_j[i] = np.int64(v)
        i -= np.int64(v <= np.uint64(i))
        if (mask >> np.uint64(1)) >= np.uint64(i):
            mask >>= np.uint64(1)
    return i, k


@kernel
def _apply_swaps(data, js):
    """Fisher-Yates with the drawn ``js``: for i = n-1 down to 1, swap ``data[i]`` and
    ``data[js[i]]`` (int64)."""
    for i in range(data.shape[0] - 1, 0, -1):
        j = js[i]
        t = data[j]
        data[j] = data[i]
        data[i] = t


def permutation(rng: np.random.Generator, n: int) -> np.ndarray:
    """``rng.permutation(n)``: the same values (int64[n]). ``rng`` is left in an unspecified
    state: use a generator made for this call. Lengths of 2**32 or more (drawn from the 64-bit
    stream), other bit generators and big-endian machines go to numpy."""
    n = int(n)
    bg = rng.bit_generator
    if (n > _U32 or type(bg).__name__ != "PCG64" or bg.state.get("has_uint32", 0)
            or sys.byteorder != "little"):  # the words' order is each output's low half first
        return rng.permutation(n).astype(np.int64, copy=False)
    out = np.arange(n, dtype=np.int64)
    if n >= 2:
        js = np.empty(n, dtype=np.int64)
        i = n - 1
        # ~1.4 words a draw on average (a try is rejected less than half the time): n raw
        # outputs give 2n words; the rare shortfall is drawn on
        chunk = n
        while i > 0:
            words = bg.random_raw(chunk).view(np.uint32)
            i, _ = _draw_js(words, np.int64(0), np.int64(i), js)
            chunk = max(1024, int(i))
        _apply_swaps(out, js)
    return out
