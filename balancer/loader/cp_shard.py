"""Context-parallel sharding of one packed microbatch, per document.

Layout of the whole microbatch under CP (``cp > 1``): every document is padded at its end to a
multiple of ``2 * cp`` tokens (``cu_seqlens_padded``), so its padded length is ``2 * cp`` chunks
of ``P_d / (2 cp)`` tokens. A document is either

* **zigzag-sharded** (owner -1): CP rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``, which
  equalises causal attention work; or
* **whole** on one CP rank (owner ``r``): that rank holds all ``P_d`` tokens, the others none.
  WLB-LLM keeps short documents whole when that balances the ranks better;
  :func:`choose_owners` decides this per microbatch from the cost model.

CP rank ``r``'s shard is ``full[shard_index(...)]``, documents in microbatch order, and within a
sharded document chunk ``r`` before chunk ``2 cp - 1 - r``. The shards of all ranks are a
partition of the padded microbatch: ``full[concat(index_0, ..., index_{cp-1})] ==
concat(shard_0, ..., shard_{cp-1})``, so ``full[concat(index)] = concat(shards)`` (or
:func:`unshard`) reconstructs it exactly.
"""
from __future__ import annotations

import heapq
from typing import Optional

import numpy as np

from ..cost.model import CostModel
from ..zigzag import padded_lengths, zigzag_attention  # noqa: F401 (cp_shard.padded_lengths kept)

#: the placement cost when the collator is given no cost model
_DEFAULT_COST = CostModel.quadratic(65536)


def _segments_to_index(starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + l)`` of every segment, vectorised."""
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    first = np.cumsum(lens) - lens
    return np.repeat(starts - first, lens) + np.arange(total, dtype=np.int64)


def shard_index(lengths: np.ndarray, cp: int, cp_rank: int,
                owner: Optional[np.ndarray] = None) -> np.ndarray:
    """Positions (int64[T_r]) in the padded microbatch of CP rank ``cp_rank``'s tokens.

    ``lengths`` are the real document lengths; ``owner`` (int64[N], default all -1) gives -1
    for zigzag-sharded documents and the owning rank for whole ones."""
    if not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank {cp_rank} is outside 0..{cp - 1}")
    padded = padded_lengths(lengths, cp)
    offs = np.cumsum(padded) - padded
    if cp == 1:
        return np.arange(int(padded.sum()), dtype=np.int64)
    n = padded.shape[0]
    owner = np.full(n, -1, np.int64) if owner is None else np.asarray(owner, np.int64)
    chunk = padded // (2 * cp)
    sharded = owner < 0
    mine = owner == cp_rank
    # two segments per sharded document, one per whole document this rank owns, in doc order
    seg_start = np.stack([offs + cp_rank * chunk, offs + (2 * cp - 1 - cp_rank) * chunk], axis=1)
    seg_len = np.stack([np.where(sharded, chunk, np.where(mine, padded, 0)),
                        np.where(sharded, chunk, 0)], axis=1)
    seg_start[:, 0] = np.where(sharded, seg_start[:, 0], offs)
    return _segments_to_index(seg_start.ravel(), seg_len.ravel())


def unshard(shards: list, indices: list, total: int):
    """Rebuild the padded microbatch (length ``total``) from every rank's shard and index."""
    like = shards[0]
    out = like.new_empty(total) if hasattr(like, "new_empty") else np.empty(total, like.dtype)
    for s, i in zip(shards, indices):
        out[i] = s
    return out


def rank_attention(lengths: np.ndarray, cp: int, owner: Optional[np.ndarray] = None) -> np.ndarray:
    """Causal attention work (query-key pairs, float64[cp]) of every CP rank."""
    lengths = np.asarray(lengths, dtype=np.int64)
    work = np.zeros(cp)
    if lengths.shape[0] == 0:
        return work
    owner = np.full(lengths.shape[0], -1, np.int64) if owner is None else np.asarray(owner)
    sharded = owner < 0
    if sharded.any():
        work += zigzag_attention(lengths[sharded], cp).sum(axis=0)
    lw = lengths[~sharded].astype(np.float64)
    np.add.at(work, owner[~sharded], lw * (lw + 1) / 2)
    return work


def _doc_loads(lengths: np.ndarray, cp: int, cost: Optional[CostModel]):
    """(whole cost float64[N], sharded per-rank cost float64[N, cp]) of every document, from
    the cost model's :meth:`~balancer.cost.protocol.CostFormula.shard_costs` (the built-in
    quadratic-64k model when None)."""
    return (cost if cost is not None else _DEFAULT_COST).shard_costs(lengths, cp)


def choose_owners(lengths: np.ndarray, cp: int, cost: Optional[CostModel] = None,
                  max_rank_tokens: Optional[int] = None) -> np.ndarray:
    """Per-document CP placement for one microbatch (int64[N]: -1 sharded, else the owner).

    Documents in decreasing cost; the ``k`` costliest are zigzag-sharded and the rest placed
    whole by LPT (least-loaded rank first, ties to the lower rank) under ``max_rank_tokens``
    padded tokens per rank; the ``k`` with the smallest maximum rank cost wins, ties going to
    fewer sharded documents. ``k = N`` (everything sharded) is always a candidate, so the choice
    is never worse than plain zigzag under the cost model."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = lengths.shape[0]
    all_sharded = np.full(n, -1, np.int64)
    if cp <= 1 or n == 0:
        return all_sharded
    whole, sharded = _doc_loads(lengths, cp, cost)
    padded = padded_lengths(lengths, cp)
    order = np.argsort(-whole, kind="stable")
    base = np.vstack([np.zeros(cp), np.cumsum(sharded[order], axis=0)])  # [k] sharded prefix
    base_tok = np.concatenate([[0], np.cumsum(padded[order])]) / cp
    cap = np.inf if max_rank_tokens is None else float(max_rank_tokens)
    best_k, best = n, float(base[n].max())
    w_ord, p_ord = whole[order].tolist(), padded[order].tolist()
    ks = range(n - 1, -1, -1) if n <= 256 else np.unique(np.linspace(0, n - 1, 64).astype(int))[::-1]
    for k in ks:
        k = int(k)
        heap = [(float(base[k, r]), r, float(base_tok[k])) for r in range(cp)]
        heapq.heapify(heap)
        ok = True
        for j in range(k, n):
            skipped = []
            while heap and heap[0][2] + p_ord[j] > cap:
                skipped.append(heapq.heappop(heap))
            if not heap:
                ok = False
                break
            load, r, tok = heapq.heappop(heap)
            heapq.heappush(heap, (load + w_ord[j], r, tok + p_ord[j]))
            for s in skipped:
                heapq.heappush(heap, s)
            if max(h[0] for h in heap) > best:  # already worse: prune
                ok = False
                break
        if not ok:
            continue
        m = max(h[0] for h in heap)
        if m <= best * (1 + 1e-12):
            best_k, best = k, m
    if best_k == n:
        return all_sharded
    # replay the winning LPT to record owners
    owner = all_sharded.copy()
    heap = [(float(base[best_k, r]), r, float(base_tok[best_k])) for r in range(cp)]
    heapq.heapify(heap)
    for j in range(best_k, n):
        skipped = []
        while heap[0][2] + p_ord[j] > cap:
            skipped.append(heapq.heappop(heap))
        load, r, tok = heapq.heappop(heap)
        owner[order[j]] = r
        heapq.heappush(heap, (load + w_ord[j], r, tok + p_ord[j]))
        for s in skipped:
            heapq.heappush(heap, s)
    return owner
