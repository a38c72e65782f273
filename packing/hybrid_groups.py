"""Hybrid DP x CP planning: the state of the rounds being built.

Per round ``r`` and rank ``p``: ``load[r, p]`` seconds, ``rtok[r, p]`` tokens, ``gid[r, p]``
the group holding the rank (-1: none yet); per group ``g``: offset ``g_off``, size exponent
``g_k``, round ``g_round``, per-rank seconds ``g_load`` and tokens ``g_tok``. Per document
``d``: ``d_round``, ``d_off``, ``d_k``, ``d_owner`` (the plan's per-item arrays, see
:mod:`packing.hybrid_cp`). Every array preallocated by the caller (int64 / float64).
"""
from __future__ import annotations

import numpy as np

from ._jit import kernel

#: relative slack under which a load counts as fitting a round's height
_TOL = 1e-9


@kernel
def _free_block(gid, r, k, P):
    """Lowest offset of an aligned block of 2^k free ranks in round r, or -1."""
    size = 1 << k
    o = 0
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
def _new_group(gid, g_off, g_k, g_round, g_load, g_tok, ng, r, o, k):
    g_off[ng] = o
    g_k[ng] = k
    g_round[ng] = r
    g_load[ng] = 0.0
    g_tok[ng] = 0
    for p in range(o, o + (1 << k)):
        gid[r, p] = ng
    return ng + 1


@kernel
def _slot_room(load, rtok, r, p, Teff, rho, cap):
    """Whole-document work slot (r, p) can still absorb below height Teff within its memory."""
    a = Teff - load[r, p]
    m = rho * (cap - rtok[r, p])
    if m < a:
        a = m
    return a if a > 0 else 0.0


@kernel
def _round_room(load, rtok, gid, g_k, r, Teff, rho, cap, P, whole_ok, ex_o, ex_size):
    """Room of every slot of round r (slots of groups of two or more excluded without whole
    documents there, and the block [ex_o, ex_o + ex_size) too, a group about to be made)."""
    s = 0.0
    for p in range(P):
        if not whole_ok and ((gid[r, p] >= 0 and g_k[gid[r, p]] > 0)
                             or ex_o <= p < ex_o + ex_size):
            continue
        s += _slot_room(load, rtok, r, p, Teff, rho, cap)
    return s


@kernel
def _add_whole(d, r, p, time, tok, gid, g_off, g_k, load, rtok, d_round, d_off, d_k, d_owner):
    gi = gid[r, p]
    load[r, p] += time[d, 0]
    rtok[r, p] += tok[d, 0]
    d_round[d] = r
    d_off[d] = g_off[gi]
    d_k[d] = g_k[gi]
    d_owner[d] = p - g_off[gi]


@kernel
def _add_shard(d, gi, k, time, tok, g_off, g_k, g_round, g_load, g_tok, load, rtok, d_round,
               d_off, d_k, d_owner):
    t = time[d, k]
    r = g_round[gi]
    g_load[gi] += t
    g_tok[gi] += tok[d, k]
    for p in range(g_off[gi], g_off[gi] + (1 << g_k[gi])):
        load[r, p] += t
        rtok[r, p] += tok[d, k]
    d_round[d] = r
    d_off[d] = g_off[gi]
    d_k[d] = k
    d_owner[d] = -1
