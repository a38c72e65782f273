"""``hybrid``: per-document CP degree on one pool of ``P = dp x cp`` ranks, every global batch
planned on its own (:func:`plan_hybrid`, the compiled planner of :mod:`packing.hybrid_cp` on the
cost table of :class:`balancer.cost.cp.CPCostModel`), and what the hybrid-mode strategies share:
the items they plan (documents, or pieces of them when cutting: :func:`cut_documents`) and the
stream's consecutive global batches (:func:`global_batches`, :func:`plan_batches`).

Documents are never cut unless ``over_length="chunk"`` and a document is longer than the largest
aligned group holds. Plans are :class:`packing.hybrid_cp.HybridPlan` (see there for the CSR
layout); an item is a document, or a piece ``[item_start, item_start + item_length)`` of
document ``item_doc``. Knobs: ``over_length`` (older name: ``over_limit``).

A global batch of at most one round of the pool's tokens (``n_ranks x rank_capacity``: the
run-time and RL path's single batches) is never planned slower than Megatron-LM's rule would
plan it: :func:`plan_hybrid` also plans it by that rule (:mod:`.megatron_hybrid`) and keeps that
plan where its estimated step time (:func:`step_time`) is lower and a trainer here can run it
(aligned groups, no rank over its tokens: :func:`packing.hybrid_cp.runnable`), counted in
``HybridPlan.megatron_steps``. Larger batches are not compared: Megatron's rule bounds only
each document's share of a rank's memory (every document runs its own pass there), so it packs
them into rounds no trainer here can run (prolong at 64 ranks x 4 rounds of 32K: one round of
5x a rank's capacity), and planning it costs O(documents x ranks) of Python (about 30x the
hybrid planner on a 2,700-document batch).
"""
from __future__ import annotations

import time
from typing import Callable, Literal, Optional

import numpy as np

from packing.hybrid_cp import HybridPlan, concat_plans, plan_batch, runnable
from packing.validate import as_sizes

from ..config import renamed
from ..cost.cp import CPCostModel, CPCostTable
from . import registry
from .registry import register

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


def _items(lengths, limit: int, over_length: OverLimit, what: str, detail: str = ""):
    if over_length not in ("error", "chunk"):
        raise ValueError(f"over_limit {over_length!r}: expected 'error' or 'chunk'")
    if limit < 1:  # pieces of 0 tokens: the callers refuse such a group first, naming it
        raise ValueError(f"{what} of {limit} tokens{detail} holds no document")
    over = np.flatnonzero(lengths > limit)
    if over.size and over_length == "error":
        i = int(over[0])
        raise ValueError(f"sample {i}: length {int(lengths[i])} exceeds {what} of {limit} "
                         f"tokens{detail}; over_length='chunk' (over_limit) cuts such documents "
                         f"into pieces (counted as documents_cut)")
    doc, start, length = cut_documents(lengths, limit)
    return doc, start, length, int(over.size)


def _largest_group(n_ranks: int) -> int:
    return 1 << (int(n_ranks).bit_length() - 1)


def pool_group(g: int, n_ranks: int) -> str:
    """The group whose limit is the pool's (:meth:`CPCostModel.pool_limit`), in words."""
    if g == n_ranks:
        return f"{g} ranks" if g > 1 else "1 rank"
    if g == 1:  # only a single rank holds anything (rank_capacity 1)
        return f"one rank of the pool's {n_ranks}: a CP shard needs 2 tokens per rank"
    return f"its largest aligned group: {g} of the pool's {n_ranks} ranks"



# ---- the estimate of one step ----------------------------------------------------------------
def round_loads(plan: HybridPlan, table: CPCostTable, grouped: Optional[Callable] = None):
    """``(compute, exposed, busy)``, (rounds, ranks) arrays of ``plan`` whose items are the rows
    of ``table``: every rank's compute and exposed exchange in every round (a whole item on its
    owner, a sharded one on every rank of its group: its own exchange each) and whether it runs
    something. ``grouped(g_of, k, sharded)``, where given and some item is sharded, charges the
    sharded items' exchange per group instead (an (R, P) array added to the exposed time, their
    own exposures then zero): ``g_of`` is the group of every entry, ``k`` its log2 size."""
    P, R = plan.n_ranks, plan.n_rounds
    comp = np.zeros((R, P))
    expo = np.zeros((R, P))
    busy = np.zeros((R, P), dtype=bool)
    g_of = plan.group_of_entry()
    size = plan.group_size[g_of]
    off = plan.group_offset[g_of]
    rnd = plan.round_of_group()[g_of]
    it, own = plan.entry_item, plan.entry_owner
    k = np.log2(size).astype(np.int64)
    sh = own < 0
    whole = ~sh
    k_eff = np.where(sh, k, 0)
    c_e = table.compute[it, k_eff]
    x_e = table.exposed[it, k_eff]
    np.add.at(comp, (rnd[whole], off[whole] + own[whole]), c_e[whole])
    np.add.at(expo, (rnd[whole], off[whole] + own[whole]), x_e[whole])
    busy[rnd[whole], off[whole] + own[whole]] = True
    if sh.any() and grouped is not None:
        x_e[sh] = 0.0
        expo += grouped(g_of, k, sh)
    if sh.any():
        # a sharded item adds to every rank of its group: difference arrays over rank ranges
        dc = np.zeros((R, P + 1))
        dx = np.zeros((R, P + 1))
        db = np.zeros((R, P + 1), dtype=np.int64)
        np.add.at(dc, (rnd[sh], off[sh]), c_e[sh])
        np.add.at(dc, (rnd[sh], off[sh] + size[sh]), -c_e[sh])
        np.add.at(dx, (rnd[sh], off[sh]), x_e[sh])
        np.add.at(dx, (rnd[sh], off[sh] + size[sh]), -x_e[sh])
        np.add.at(db, (rnd[sh], off[sh]), 1)
        np.add.at(db, (rnd[sh], off[sh] + size[sh]), -1)
        comp += np.maximum(np.cumsum(dc, axis=1)[:, :P], 0.0)
        expo += np.maximum(np.cumsum(dx, axis=1)[:, :P], 0.0)
        busy |= np.cumsum(db, axis=1)[:, :P] > 0
    return comp, expo, busy


def step_time(plan: HybridPlan, table: CPCostTable) -> float:
    """Estimated time of a one-step ``plan`` whose items are the rows of ``table``: the sum
    over rounds of the slowest rank's compute plus exposed exchange (every sharded item its own
    exchange), plus the round constant on every rank that runs something. The same figure, in
    the same arithmetic, as ``balancer.planning.hybrid.estimate(plan, ...).step_time``."""
    comp, expo, busy = round_loads(plan, table)
    load = comp + expo + table.round_constant * busy
    return float((load.max(axis=1) if plan.n_rounds else np.zeros(0)).sum())


def _megatron_if_faster(plan: HybridPlan, lengths, model: CPCostModel, n_ranks: int,
                        table: CPCostTable) -> HybridPlan:
    """``plan``, or Megatron-LM's plan of the same documents (none cut) where it is estimated
    faster and runnable here (counted in ``megatron_steps``)."""
    P = int(n_ranks)
    if (plan.documents_cut or P & (P - 1) or lengths.shape[0] == 0
            or int(lengths.sum()) > P * model.rank_capacity):   # see the module docstring
        return plan
    # by its registry name: megatron_hybrid builds on this module (one global batch: the budget
    # is the batch's tokens)
    rule = registry.get("megatron_hybrid", "hybrid")
    alt, _ = rule(lengths, model, P, int(lengths.sum()),
                  registry.configure("hybrid", strategy="megatron_hybrid"))
    if alt.documents_cut or not runnable(alt, table.tokens):
        return plan
    if step_time(alt, table) < step_time(plan, table):
        return alt._replace(megatron_steps=1)
    return plan


# ---- planners ---------------------------------------------------------------------------------
@renamed(over_limit="over_length")
def plan_hybrid(lengths, model: CPCostModel, n_ranks: int, *, over_length: OverLimit = "error",
                candidates: int = 2, local_search: int = 64,
                table: Optional[CPCostTable] = None, megatron: bool = True) -> HybridPlan:
    """Hybrid plan of one global batch (``lengths``: its documents) on ``n_ranks`` ranks.

    A document longer than the pool holds (``model.pool_limit(n_ranks)``: what its largest
    aligned group holds, or one rank at ``rank_capacity`` 1) is an error naming it, or with
    ``over_length="chunk"``
    (older name: ``over_limit``) is cut into pieces of that limit (counted in
    ``documents_cut``). ``table`` may pass the documents' cost table already computed (no cut
    documents then). ``megatron``: where the batch holds at most ``n_ranks x rank_capacity``
    tokens and Megatron-LM's rule plans it faster (estimated) and runnably, that plan is
    returned instead (``megatron_steps`` 1; see the module docstring); False: the hybrid
    planner's plan always."""
    lengths = as_sizes(lengths)
    limit, g = model.pool_limit(n_ranks)
    doc, start, length, cut = _items(lengths, limit, over_length, "the pool's limit",
                                     f" ({pool_group(g, n_ranks)} x rank_capacity "
                                     f"{model.rank_capacity}, CP padding included)")
    if table is None or cut:
        table = model.table(length, n_ranks)
    plan = plan_batch(table.time, table.tokens, model.rank_capacity, n_ranks,
                      candidates=candidates, local_search=local_search, doc_ids=doc,
                      lengths=length)
    plan = plan._replace(item_start=start, documents_cut=cut)
    return _megatron_if_faster(plan, lengths, model, n_ranks, table) if megatron else plan


# ---- the stream: consecutive global batches ----------------------------------------------------
def global_batches(lengths: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Consecutive ``[a, b)`` document ranges: a batch closes with the document that reaches
    ``budget`` tokens (the last one holds what is left)."""
    lengths = np.asarray(lengths, np.int64)
    if lengths.shape[0] == 0:
        return []
    cs = np.cumsum(lengths)
    cuts = np.searchsorted(cs, np.arange(budget, int(cs[-1]) + 1, budget), side="left") + 1
    bounds = np.unique(np.concatenate([[0], np.minimum(cuts, lengths.shape[0]),
                                       [lengths.shape[0]]]))
    return list(zip(bounds[:-1].tolist(), bounds[1:].tolist()))


def plan_batches(lengths: np.ndarray, budget: int,
                 plan_one: Callable[[np.ndarray], tuple[HybridPlan, float]]):
    """``(plan, seconds per batch)``: every global batch of the stream planned on its own by
    ``plan_one(documents) -> (plan, planning seconds)``, as one plan of many steps whose
    ``item_doc`` index ``lengths``."""
    plans, secs = [], []
    for a, b in global_batches(lengths, budget):
        p, t = plan_one(lengths[a:b])
        secs.append(t)
        plans.append(p._replace(item_doc=p.item_doc + a))
    if not plans:
        raise ValueError("no documents to plan")
    return concat_plans(plans), secs


@register("hybrid", "per-document CP degree on aligned groups of the pool (LPT over rounds, "
                    "local search), every global batch on its own", mode="hybrid",
          knobs=("over_length",))
def plan(lengths, cost, n_ranks, budget, config):
    P = int(n_ranks)
    limit, _ = cost.pool_limit(P)

    def one(docs):
        tab = cost.table(docs, P) if (docs <= limit).all() else None  # timed apart
        t0 = time.perf_counter()
        p = plan_hybrid(docs, cost, P, table=tab, over_length=config.over_length)
        return p, time.perf_counter() - t0
    return plan_batches(lengths, budget, one)


__all__ = ["OverLimit", "cut_documents", "global_batches", "plan_batches", "plan_hybrid",
           "round_loads", "step_time"]
