"""``fixed_cp<c>``: the fixed-CP baseline of the hybrid mode, one strategy per degree ``c`` (a
power of two dividing the pool): every round the pool is ``P / c`` groups of ``c`` ranks, the
same partition every round, and documents longer than a group holds are cut into pieces of that
limit (counted in ``documents_cut``: that is the baseline, whatever ``over_length`` says).
:func:`plan_fixed_cp` plans one global batch; the strategy plans every global batch of the
stream on its own. Knobs: none.
"""
from __future__ import annotations

import time

from packing.hybrid_cp import HybridPlan, plan_batch
from packing.validate import as_sizes

from ..cost.cp import CPCostModel
from .hybrid import _items, plan_batches
from .registry import register


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
    if limit < 1:  # rank_capacity 1: a zigzag shard is two chunks per rank
        raise ValueError(f"cp {cp} holds no document at rank_capacity {model.rank_capacity}: a "
                         f"group of {cp} ranks needs 2 tokens per rank (zigzag CP); use cp 1 "
                         f"or a rank_capacity >= 2")
    doc, start, length, cut = _items(lengths, limit, "chunk", "")
    table = model.table(length, n_ranks)
    plan = plan_batch(table.time, table.tokens, model.rank_capacity, n_ranks,
                      candidates=candidates, local_search=local_search, whole=whole,
                      fixed=cp.bit_length() - 1, doc_ids=doc, lengths=length)
    return plan._replace(item_start=start, documents_cut=cut)


@register("fixed_cp<c>", "fixed CP of degree c on every global batch: the pool as P / c groups "
                         "of c ranks every round, longer documents cut", mode="hybrid",
          baseline=True)
def plan(lengths, cost, n_ranks, budget, config, *, degree):
    def one(docs):
        t0 = time.perf_counter()
        p = plan_fixed_cp(docs, cost, n_ranks, degree)
        return p, time.perf_counter() - t0
    return plan_batches(lengths, budget, one)


__all__ = ["plan_fixed_cp"]
