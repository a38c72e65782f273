"""Keyed bijections computed per element: the two-level block shuffle of an epoch order
(``balancer.planning.order`` defines it and derives the keys; ``tests/naive/order.py`` is the
numpy reference it must equal bit for bit). Arithmetic is on uint64, wrapping mod 2**64."""
from __future__ import annotations

import numpy as np

from ._jit import kernel


@kernel
def _mix(x):
    """splitmix64's finaliser."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@kernel
def _feistel(x, m, keys, half, mask):
    """The bijection of [0, m) keyed by ``keys`` (uint64[rounds]) at ``x`` (uint64 < m): a
    balanced Feistel network on 2 * half bits, re-applied until the value is below m."""
    while True:
        left = x >> half
        right = x & mask
        for r in range(keys.shape[0]):
            t = right
            right = left ^ (_mix(right ^ keys[r]) & mask)
            left = t
        x = (left << half) | right
        if x < m:
            return x


@kernel
def _domain(m):
    """(half, mask) of the smallest even bit count >= 2 covering [0, m)."""
    bits = 0
    v = m - np.uint64(1)
    while v > np.uint64(0):
        bits += 1
        v = v >> np.uint64(1)
    if bits < 2:
        bits = 2
    bits += bits & 1
    half = np.uint64(bits // 2)
    return half, (np.uint64(1) << half) - np.uint64(1)


@kernel
def _block_order(n, positions, block, group_blocks, base0, c0, base1, c1, out):
    group = block * group_blocks
    n_full = n // block
    last = (n - 1) // group
    keys0 = np.empty(c0.shape[0], np.uint64)
    g0 = _mix(np.uint64(0) ^ base0)
    for r in range(c0.shape[0]):
        keys0[r] = _mix(g0 + c0[r])
    keys1 = np.empty(c1.shape[0], np.uint64)
    h_full, m_full = _domain(np.uint64(group))
    h_last, m_last = _domain(np.uint64(n - last * group))
    h0, k0 = _domain(np.uint64(n_full)) if n_full > 0 else (np.uint64(1), np.uint64(1))
    cur = -1
    for i in range(positions.shape[0]):
        p = positions[i]
        g = p // group
        if g != cur:  # keys of this group
            gg = _mix(np.uint64(g) ^ base1)
            for r in range(c1.shape[0]):
                keys1[r] = _mix(gg + c1[r])
            cur = g
        j = np.uint64(p - g * group)
        if g == last:
            m = n - last * group
            s = _feistel(j, np.uint64(m), keys1, h_last, m_last) if m > 1 else np.uint64(0)
        else:
            s = _feistel(j, np.uint64(group), keys1, h_full, m_full)
        slot = g * group_blocks + np.int64(s // np.uint64(block))
        b = slot
        if slot < n_full:
            b = np.int64(_feistel(np.uint64(slot), np.uint64(n_full), keys0, h0, k0)) \
                if n_full > 1 else np.int64(0)
        out[i] = b * block + np.int64(s % np.uint64(block))


def block_order_kernel(n: int, positions: np.ndarray, block: int, group_blocks: int,
                       base0: int, c0: np.ndarray, base1: int, c1: np.ndarray) -> np.ndarray:
    """Samples at ``positions`` (int64[k] in [0, n)) of the block shuffle with block size
    ``block``, ``group_blocks`` blocks per group, block-order keys (``base0``, ``c0``
    uint64[rounds]) and in-group keys (``base1``, ``c1``). int64[k]."""
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    if n <= 0 or block <= 0 or group_blocks <= 0:
        raise ValueError(f"n {n}, block {block} and group_blocks {group_blocks} must be >= 1")
    if positions.size and (positions.min() < 0 or positions.max() >= n):
        raise ValueError(f"positions must lie in [0, {n})")
    out = np.empty(positions.shape[0], np.int64)
    _block_order(np.int64(n), positions, np.int64(block), np.int64(group_blocks),
                 np.uint64(base0), np.ascontiguousarray(c0, np.uint64), np.uint64(base1),
                 np.ascontiguousarray(c1, np.uint64), out)
    return out
