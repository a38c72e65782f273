"""Hybrid DP x CP plans of one global batch (issue #15): the per-document CP degree planner and
the fixed-CP baseline, and the items they plan (documents, or pieces of them when cutting).

* :func:`plan_hybrid`: per-document CP degree on one pool of ``P = dp x cp`` ranks, the compiled
  planner of :mod:`packing.hybrid_cp` on the cost table of :class:`balancer.cost.cp.CPCostModel`.
  Documents are never cut unless ``over_limit="chunk"`` and a document is longer than the largest
  aligned group holds.
* :func:`plan_fixed_cp`: fixed CP of degree ``cp`` (``P / cp`` groups, the same partition every
  round); documents longer than ``cp x rank_capacity`` are cut into pieces (counted).
* :func:`cut_documents`: the pieces of documents longer than a limit.

Both return :class:`packing.hybrid_cp.HybridPlan` (see there for the CSR layout); an item is a
document, or a piece ``[item_start, item_start + item_length)`` of document ``item_doc``.
"""
from __future__ import annotations

from typing import Literal, Optional

import numpy as np

from packing.hybrid_cp import HybridPlan, plan_batch
from packing.validate import as_sizes

from ..cost.cp import CPCostModel, CPCostTable

OverLimit = Literal["error", "chunk"]


# ---- items: documents, or pieces of them --------------------------------------------------------
def cut_documents(lengths: np.ndarray, limit: int):
    """``(item_doc, item_start, item_length)``, int64 each: every document longer than
    ``limit`` cut into consecutive pieces of ``limit`` tokens (the last one shorter), the others
    whole; pieces in document order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    limit = int(limit)
    pieces = np.maximum(1, -(-lengths // limit))
    item_doc = np.repeat(np.arange(lengths.shape[0], dtype=np.int64), pieces)
    first = np.cumsum(pieces) - pieces
    j = np.arange(item_doc.shape[0], dtype=np.int64) - np.repeat(first, pieces)
    item_start = j * limit
    item_length = np.minimum(limit, lengths[item_doc] - item_start)
    return item_doc, item_start, item_length


def _items(lengths, limit: int, over_limit: OverLimit, what: str, detail: str = ""):
    if over_limit not in ("error", "chunk"):
        raise ValueError(f"over_limit {over_limit!r}: expected 'error' or 'chunk'")
    over = np.flatnonzero(lengths > limit)
    if over.size and over_limit == "error":
        i = int(over[0])
        raise ValueError(f"sample {i}: length {int(lengths[i])} exceeds {what} of {limit} "
                         f"tokens{detail}; over_limit='chunk' cuts such documents into pieces "
                         f"(counted as documents_cut)")
    doc, start, length = cut_documents(lengths, limit)
    return doc, start, length, int(over.size)


def _largest_group(n_ranks: int) -> int:
    return 1 << (int(n_ranks).bit_length() - 1)



# ---- planners ---------------------------------------------------------------------------------
def plan_hybrid(lengths, model: CPCostModel, n_ranks: int, *, over_limit: OverLimit = "error",
                candidates: int = 2, local_search: int = 64,
                table: Optional[CPCostTable] = None) -> HybridPlan:
    """Hybrid plan of one global batch (``lengths``: its documents) on ``n_ranks`` ranks.

    A document longer than the largest aligned group holds (``model.doc_limit(g)``, ``g`` the
    largest power of two <= n_ranks) is an error naming it, or with ``over_limit="chunk"`` is cut
    into pieces of that limit (counted in ``documents_cut``). ``table`` may pass the documents'
    cost table already computed (no cut documents then)."""
    lengths = as_sizes(lengths)
    g = _largest_group(n_ranks)
    limit = model.doc_limit(g)
    doc, start, length, cut = _items(lengths, limit, over_limit, "the pool's limit",
                                     f" ({g} ranks x rank_capacity {model.rank_capacity}, CP "
                                     f"padding included)")
    if table is None or cut:
        table = model.table(length, n_ranks)
    plan = plan_batch(table.time, table.tokens, model.rank_capacity, n_ranks,
                      candidates=candidates, local_search=local_search, doc_ids=doc,
                      lengths=length)
    return plan._replace(item_start=start, documents_cut=cut)


def plan_fixed_cp(lengths, model: CPCostModel, n_ranks: int, cp: int, *, whole: bool = False,
                  candidates: int = 2, local_search: int = 64) -> HybridPlan:
    """Fixed CP of degree ``cp``: every round the pool is ``n_ranks / cp`` groups of ``cp``
    ranks; documents longer than a group holds are cut into pieces of that limit (counted).
    ``whole=False`` (standard CP) shards every document over its group; ``whole=True`` lets a
    document that fits one rank stay whole on one member (cp_shard ``choose_owners`` style).
    Documents are packed by LPT on per-rank time under the memory limit over the rounds."""
    lengths = as_sizes(lengths)
    cp = int(cp)
    if cp < 1 or cp & (cp - 1) or n_ranks % cp:
        raise ValueError(f"cp {cp} must be a power of two dividing the pool of {n_ranks} ranks")
    limit = model.doc_limit(cp)
    doc, start, length, cut = _items(lengths, limit, "chunk", "")
    table = model.table(length, n_ranks)
    plan = plan_batch(table.time, table.tokens, model.rank_capacity, n_ranks,
                      candidates=candidates, local_search=local_search, whole=whole,
                      fixed=cp.bit_length() - 1, doc_ids=doc, lengths=length)
    return plan._replace(item_start=start, documents_cut=cut)



__all__ = ["OverLimit", "cut_documents", "plan_fixed_cp", "plan_hybrid"]
