"""Slow numpy reference of the ``blocks`` epoch order (:mod:`balancer.planning.order`): the
same keyed Feistel bijections, vectorised over positions; ``packing.permute``'s kernel must
equal it bit for bit."""
from __future__ import annotations

import numpy as np

from balancer.planning.order import BLOCK, GROUP, GROUP_BLOCKS, ROUNDS, _mix_int


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wraps mod 2**64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _round_keys(seed: int, epoch: int, level: int, group: np.ndarray) -> list[np.ndarray]:
    """ROUNDS uint64 keys per element of ``group`` (uint64[k]), from (seed, epoch, level)."""
    base = level_base(seed, epoch, level)
    g = _mix(group ^ np.uint64(base))
    return [_mix(g + np.uint64(_mix_int(base + r + 1))) for r in range(ROUNDS)]


def feistel(x: np.ndarray, m: int, keys: list[np.ndarray]) -> np.ndarray:
    """A keyed bijection of ``[0, m)`` applied to ``x`` (int64[k], each in ``[0, m)``; ``keys``
    ROUNDS uint64[k] arrays, one key per element): a balanced Feistel network on the smallest
    even number of bits covering ``m`` (a domain under 4 m), with cycle walking (re-applied
    until the value falls back in ``[0, m)``: the walk stays on x's cycle, so it ends and
    the map stays a bijection). Returns int64[k]."""
    if m <= 1:
        return np.zeros(x.shape[0], np.int64)
    bits = max(2, int(m - 1).bit_length())
    bits += bits & 1
    half = np.uint64(bits // 2)
    mask = np.uint64((1 << (bits // 2)) - 1)

    def once(v, ks):
        left, right = v >> half, v & mask
        for k in ks:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << half) | right

    y = once(x.astype(np.uint64), keys)
    out = np.uint64(m)
    todo = np.flatnonzero(y >= out)
    while todo.size:  # expected < 4 steps: the domain is under 4 m
        y[todo] = once(y[todo], [k[todo] for k in keys])
        todo = todo[y[todo] >= out]
    return y.astype(np.int64)


def block_order(n: int, seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
    """The samples at ``positions`` (int64[k], each in ``[0, n)``) of the ``blocks`` order of
    epoch ``epoch`` of an ``n``-sample corpus. int64[k]."""
    p = np.asarray(positions, dtype=np.int64)
    if p.size and (int(p.min()) < 0 or int(p.max()) >= n):
        raise ValueError(f"positions must lie in [0, {n})")
    n_full = n // BLOCK
    group = p // GROUP
    j = p - group * GROUP
    last = (n - 1) // GROUP  # the only group that may be smaller than GROUP
    m_last = n - last * GROUP
    shuffled = np.empty_like(j)
    for is_last, m in ((False, GROUP), (True, m_last)):
        sel = np.flatnonzero((group == last) == is_last)
        if sel.size:
            g = group[sel].astype(np.uint64)
            shuffled[sel] = feistel(j[sel], m, _round_keys(seed, epoch, 1, g))
    slot = group * GROUP_BLOCKS + shuffled // BLOCK
    full = slot < n_full
    block = slot.copy()  # the tail block (slot n_full) stays where it is
    if full.any():
        s = slot[full]
        block[full] = feistel(s, n_full, _round_keys(seed, epoch, 0, np.zeros(s.shape[0],
                                                                              np.uint64)))
    return block * BLOCK + shuffled % BLOCK


def _mix_one(x: int) -> int:
    """splitmix64's finaliser on one Python int (mod 2**64)."""
    return int(_mix(np.array([x & 0xFFFFFFFFFFFFFFFF], np.uint64))[0])


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The default (``permutation``) order of an ``n``-sample epoch, written from the
    definition in :mod:`packing.shuffle` with Python ints: buckets drawn per position (top
    ``bits`` bits of splitmix64 at counter i + 1), positions kept in order within a bucket,
    then Fisher-Yates in each bucket (slot j from the last down swaps with
    ``floor(r * (j + 1) / 2**32)``, r the high 32 bits of the next draw, a draw rejected while
    its low product ``(r * (j + 1)) mod 2**32 < 2**32 mod (j + 1)``). int64[n]."""
    golden = 0x9E3779B97F4A7C15
    m64 = (1 << 64) - 1
    bucket_key = level_base(seed, epoch, 2)
    state = level_base(seed, epoch, 3)
    bits = 0
    while bits < 12 and (1 << (14 + bits)) < n:
        bits += 1
    if bits:
        counters = (np.uint64(bucket_key)
                    + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(golden))
        bucket = (_mix(counters) >> np.uint64(64 - bits)).astype(np.int64)
    else:
        bucket = np.zeros(n, np.int64)
    out = []
    for b in range(1 << bits):
        slots = [int(i) for i in np.flatnonzero(bucket == b)]
        for j in range(len(slots) - 1, 0, -1):
            s = j + 1
            while True:
                state = (state + golden) & m64
                prod = (_mix_one(state) >> 32) * s
                if prod % (1 << 32) >= (1 << 32) % s:
                    break
            k = prod >> 32
            slots[j], slots[k] = slots[k], slots[j]
        out.extend(slots)
    return np.array(out, dtype=np.int64)


def level_base(seed: int, epoch: int, level: int) -> int:
    """The base key of one level of the order's key derivation (levels 0 and 1: the block
    order; 2 and 3: the permutation's buckets and swaps)."""
    return _mix_int(_mix_int(_mix_int(int(seed) + 0x9E3779B97F4A7C15) ^ int(epoch)) ^
                    (int(level) + 1))
