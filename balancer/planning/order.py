"""The epoch orders, defined here bit for bit from (seed, epoch) alone, not by a library's random
generator, so an order is the same on every machine and numpy version.

The default order (``'permutation'``, :func:`permutation_order`, through
:func:`balancer.planning.stream.epoch_order`) is one uniformly random permutation of the whole
corpus (:mod:`packing.shuffle`: a bucket scatter, then Fisher-Yates in each bucket): every
process holds it (int64 per sample) and reads the lengths of samples scattered over the whole
corpus in every window. Before 2026-12-07 it was ``numpy.random.default_rng([seed,
epoch]).permutation(n)``, whose stream numpy does not promise to keep across versions.

``'blocks'`` (``PlannerConfig.order='blocks'``) computes any range of an epoch's order on the
fly, from (seed, epoch, position) alone, in memory proportional to the range: a two-level
shuffle built from keyed bijections (a Feistel network with cycle walking, ``packing.permute``):

- the corpus is cut into blocks of :data:`BLOCK` consecutive samples (the last ``n % BLOCK``
  samples form a short tail block, which stays last);
- the full blocks are put in a seeded order (a bijection of ``[0, n // BLOCK)``);
- that order is cut into groups of :data:`GROUP_BLOCKS` blocks (:data:`GROUP` samples), and
  the samples of each group are shuffled by a bijection of ``[0, group size)`` keyed by it.

So position ``p`` maps to a sample in O(1) (:func:`block_order`), a window reads the lengths of
a few hundred contiguous runs of the corpus per million samples (not a million scattered
reads), and nothing of size n is held. The price: samples of one block (4096 neighbours in
the corpus) stay within one group (1M consecutive positions) of the epoch, and the tail block
in the last group.
"""
from __future__ import annotations

import numpy as np

#: samples per block: contiguous in the corpus, read together
BLOCK = 1 << 12
#: blocks per group: the samples of a group are shuffled together (GROUP samples)
GROUP_BLOCKS = 1 << 8
GROUP = BLOCK * GROUP_BLOCKS
#: Feistel rounds (4 make a pseudo-random permutation; 2 more for margin)
ROUNDS = 6

_M64 = (1 << 64) - 1


def _mix_int(x: int) -> int:
    """splitmix64's finaliser on a Python int (keys)."""
    x &= _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def level_keys(seed: int, epoch: int, level: int) -> tuple[int, np.ndarray]:
    """(base, round constants uint64[ROUNDS]) of one level (0: the block order, 1: the
    in-group shuffles); a group ``g``'s round key ``r`` is mix(mix(g ^ base) + c[r])."""
    base = _mix_int(_mix_int(_mix_int(int(seed) + 0x9E3779B97F4A7C15) ^ int(epoch)) ^
                    (int(level) + 1))
    return base, np.array([_mix_int(base + r + 1) for r in range(ROUNDS)], np.uint64)


def permutation_keys(seed: int, epoch: int) -> tuple[int, int]:
    """(bucket key, swap key) of the default order's permutation (``order='permutation'``,
    :func:`permutation_order`): levels 2 and 3 of the same derivation as the block order's."""
    return level_keys(seed, epoch, 2)[0], level_keys(seed, epoch, 3)[0]


def permutation_order(n: int, seed: int, epoch: int, values=None):
    """The default epoch order (``order='permutation'``): a uniformly random permutation of
    ``[0, n)`` (int64[n]) from (seed, epoch), defined bit for bit by
    :mod:`packing.shuffle` (the same on every machine and numpy version); with ``values``
    (int64[n], e.g. the lengths) also ``values[order]``, gathered on the way, as a pair."""
    from packing.shuffle import seeded_permutation
    return seeded_permutation(n, *permutation_keys(seed, epoch), values=values)


def block_order(n: int, seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
    """The samples at ``positions`` (int64[k], each in ``[0, n)``) of the ``blocks`` order of
    epoch ``epoch`` of an ``n``-sample corpus. int64[k]."""
    from packing.permute import block_order_kernel
    b0, c0 = level_keys(seed, epoch, 0)
    b1, c1 = level_keys(seed, epoch, 1)
    return block_order_kernel(int(n), positions, BLOCK, GROUP_BLOCKS, b0, c0, b1, c1)


def block_order_range(n: int, seed: int, epoch: int, lo: int, hi: int) -> np.ndarray:
    """``block_order`` of positions ``[lo, hi)``. int64[hi - lo]."""
    return block_order(n, seed, epoch, np.arange(lo, max(lo, hi), dtype=np.int64))
