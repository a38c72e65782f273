"""Hybrid DP x CP planning: the state of the rounds being built, as named tuples of arrays
that the kernels pass around (numba compiles a named tuple of arrays as one argument).

* :class:`Batch` (read-only): the cost table of the batch and the planner's knobs;
* :class:`Rounds`: per round ``r`` and rank ``p``: ``load[r, p]`` seconds, ``rtok[r, p]``
  tokens, ``gid[r, p]`` the group holding the rank (-1: none yet); per round ``T[r]`` its
  height (slowest rank) and ``room[r]`` the whole-document work it can still absorb; per group
  ``g``: offset ``g_off``, size exponent ``g_k``, round ``g_round``, per-rank seconds
  ``g_load`` and tokens ``g_tok``;
* :class:`Placement`: per document ``d``: ``d_round``, ``d_off``, ``d_k``, ``d_owner`` (the
  plan's per-item arrays, see :mod:`packing.hybrid_cp`).

Every array preallocated by the caller (int64 / float64). The round and group counts (``nr``,
``ng``) are scalars passed and returned beside them.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ._jit import kernel

#: relative slack under which a load counts as fitting a round's height
_TOL = 1e-9


class Batch(NamedTuple):
    """The batch being planned: ``time`` float64[n, K] and ``tok`` int64[n, K] (per-rank
    seconds and tokens of every document on groups of ``2^k`` ranks), ``cap`` the rank
    capacity, ``P`` the pool's ranks, ``ka_lo``/``ka_hi`` the group size exponents a sharded
    document may take (``ka_hi < ka_lo``: none), ``whole_ok`` whole documents allowed on members
    of groups of two or more, ``fixed_k`` the fixed partition's exponent (-1: hybrid). Scalars
    int64 (``whole_ok`` bool)."""

    time: np.ndarray
    tok: np.ndarray
    cap: np.int64
    P: np.int64
    ka_lo: np.int64
    ka_hi: np.int64
    whole_ok: bool
    fixed_k: np.int64


class Rounds(NamedTuple):
    """The rounds and groups being built (see the module docstring): ``load``/``rtok``/``gid``
    [R_cap, P], ``T``/``room`` [R_cap], ``g_*`` [G_cap]."""

    load: np.ndarray
    rtok: np.ndarray
    gid: np.ndarray
    T: np.ndarray
    room: np.ndarray
    g_off: np.ndarray
    g_k: np.ndarray
    g_round: np.ndarray
    g_load: np.ndarray
    g_tok: np.ndarray


class Placement(NamedTuple):
    """Where every document runs (int64[n] each): round, group offset, group size exponent,
    owner (-1: sharded over the group, else the member holding it whole)."""

    d_round: np.ndarray
    d_off: np.ndarray
    d_k: np.ndarray
    d_owner: np.ndarray


def batch(time, tok, cap, P, ka_lo, ka_hi, whole_ok, fixed_k) -> Batch:
    """A :class:`Batch` with its scalars of the kernels' one type (int64, bool)."""
    return Batch(time, tok, np.int64(cap), np.int64(P), np.int64(ka_lo), np.int64(ka_hi),
                 bool(whole_ok), np.int64(fixed_k))


@kernel
def _new_rounds(R_cap, P):
    """Empty :class:`Rounds` for at most ``R_cap`` rounds of ``P`` ranks."""
    G_cap = R_cap * P
    return Rounds(np.zeros((R_cap, P)), np.zeros((R_cap, P), dtype=np.int64),
                  np.full((R_cap, P), -1, dtype=np.int64), np.zeros(R_cap), np.zeros(R_cap),
                  np.empty(G_cap, dtype=np.int64), np.empty(G_cap, dtype=np.int64),
                  np.empty(G_cap, dtype=np.int64), np.empty(G_cap),
                  np.empty(G_cap, dtype=np.int64))


@kernel
def _free_block(gid, r, k, P):
    """Lowest offset of an aligned block of 2^k free ranks in round r, or -1."""
    size = 1 << k
    o = np.int64(0)
    while o + size <= P:
        ok = True
        for p in range(o, o + size):
            if gid[r, p] >= 0:
                ok = False
                break
        if ok:
            return o
        o += size
    return -1


@kernel
def _new_group(rs, ng, r, o, k):
    """Group ``ng`` of 2^k ranks at offset o of round r, empty; returns ng + 1."""
    rs.g_off[ng] = o
    rs.g_k[ng] = k
    rs.g_round[ng] = r
    rs.g_load[ng] = 0.0
    rs.g_tok[ng] = 0
    for p in range(o, o + (1 << k)):
        rs.gid[r, p] = ng
    return ng + 1


@kernel
def _slot_room(rs, r, p, Teff, rho, cap):
    """Whole-document work slot (r, p) can still absorb below height Teff within its memory."""
    a = Teff - rs.load[r, p]
    m = rho * (cap - rs.rtok[r, p])
    if m < a:
        a = m
    return a if a > 0 else 0.0


@kernel
def _round_room(bt, rs, r, Teff, rho, ex_o, ex_size):
    """Room of every slot of round r (slots of groups of two or more excluded without whole
    documents there, and the block [ex_o, ex_o + ex_size) too, a group about to be made)."""
    gid = rs.gid
    g_k = rs.g_k
    s = 0.0
    for p in range(bt.P):
        if not bt.whole_ok and ((gid[r, p] >= 0 and g_k[gid[r, p]] > 0)
                                or ex_o <= p < ex_o + ex_size):
            continue
        s += _slot_room(rs, r, p, Teff, rho, bt.cap)
    return s


@kernel
def _add_whole(bt, rs, pl, d, r, p):
    """Document d whole on rank p of round r (the rank's group exists)."""
    gi = rs.gid[r, p]
    rs.load[r, p] += bt.time[d, 0]
    rs.rtok[r, p] += bt.tok[d, 0]
    pl.d_round[d] = r
    pl.d_off[d] = rs.g_off[gi]
    pl.d_k[d] = rs.g_k[gi]
    pl.d_owner[d] = p - rs.g_off[gi]


@kernel
def _add_shard(bt, rs, pl, d, gi, k):
    """Document d sharded over group gi (of 2^k ranks)."""
    t = bt.time[d, k]
    r = rs.g_round[gi]
    rs.g_load[gi] += t
    rs.g_tok[gi] += bt.tok[d, k]
    for p in range(rs.g_off[gi], rs.g_off[gi] + (1 << rs.g_k[gi])):
        rs.load[r, p] += t
        rs.rtok[r, p] += bt.tok[d, k]
    pl.d_round[d] = r
    pl.d_off[d] = rs.g_off[gi]
    pl.d_k[d] = k
    pl.d_owner[d] = -1
