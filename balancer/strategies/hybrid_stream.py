"""``hybrid_stream``, ours and the hybrid mode's default: hybrid DP x CP plans of a stream of
global batches where tall documents move to a nearby step so that several share one tall round
(:func:`plan_hybrid_stream`, the movement compiled in :mod:`packing.hybrid_move`); every batch
planned on its own is :func:`plan_stream`. Knobs: ``max_delay`` (the steps a document may move,
late or early), ``over_length`` (older name: ``over_limit``).
"""
from __future__ import annotations

import time
from typing import NamedTuple, Optional

import numpy as np

from packing.hybrid_cp import HybridPlan, concat_plans
from packing.hybrid_move import move_tall
from packing.validate import as_sizes

from ..config import renamed
from ..cost.cp import CPCostModel, CPCostTable
from .fixed_cp import plan_fixed_cp
from .hybrid import OverLimit, plan_hybrid
from .megatron_hybrid import plan_megatron_hybrid
from .registry import register


def plan_stream(lengths, model: CPCostModel, n_ranks: int, batch_tokens: int, planner="hybrid",
                **kw) -> tuple[HybridPlan, np.ndarray]:
    """Consecutive global batches of about ``batch_tokens`` tokens (a batch closes at the first
    document that reaches the budget), each planned by ``planner`` (``"hybrid"``,
    ``"megatron"``, or ``("fixed", cp)``), as one plan of many steps; also returns the first
    document of every batch (int64[S + 1])."""
    lengths = as_sizes(lengths)
    cs = np.cumsum(lengths)
    cuts = np.searchsorted(cs, np.arange(batch_tokens, int(cs[-1]), batch_tokens), side="left")
    bounds = np.unique(np.concatenate([[0], cuts + 1, [lengths.shape[0]]]))
    bounds = bounds[bounds <= lengths.shape[0]]
    plans = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        docs = lengths[a:b]
        if planner == "hybrid":
            p = plan_hybrid(docs, model, n_ranks, **kw)
        elif planner == "megatron":
            p = plan_megatron_hybrid(docs, n_ranks, model.rank_capacity, **kw)
        else:
            p = plan_fixed_cp(docs, model, n_ranks, planner[1], **kw)
        plans.append(p._replace(item_doc=p.item_doc + a))
    return concat_plans(plans), bounds


class StreamResult(NamedTuple):
    """A multi-step plan of a stream: ``plan`` (steps one after another), ``doc_step``
    int64[n] (the step each document trains in), ``delay`` int64[n] (that step minus the step
    the document would train in without moving: > 0 waited, < 0 read early)."""

    plan: HybridPlan
    doc_step: np.ndarray
    delay: np.ndarray


def stream_steps(lengths, model: CPCostModel, n_ranks: int, batch_tokens: int, *,
                 max_delay: int = 2, max_advance: int = 2,
                 table: Optional[CPCostTable] = None) -> tuple[np.ndarray, np.ndarray,
                                                               CPCostTable]:
    """``(home, step_of, table)`` of :func:`plan_hybrid_stream`: int64[n] each, the step every
    document trains in without moving and with tall documents moved (numbers of the stream's
    steps; a step that no document trains in is left out of the plan), and the cost table of
    the documents (cut to the pool's limit) that planned it. ``table`` may pass that table already built (``model.table(np.minimum(lengths,
    limit), n_ranks)``, ``limit`` the pool's: :meth:`CPCostModel.pool_limit`)."""
    lengths = as_sizes(lengths)
    P = int(n_ranks)
    budget = int(batch_tokens)
    if budget < 1 or max_delay < 0 or max_advance < 0:
        raise ValueError("batch_tokens must be positive and max_delay, max_advance >= 0")
    cs = np.cumsum(lengths)
    before = cs - lengths
    home = before // budget  # the step of every document without moving
    limit, _ = model.pool_limit(P)
    if table is None:
        table = model.table(np.minimum(lengths, limit), P)
    elif table.time.shape[0] != lengths.shape[0]:
        raise ValueError(f"table of {table.time.shape[0]} documents for {lengths.shape[0]}")
    tab = table
    cap = model.rank_capacity
    short = lengths * 2 <= cap
    full = (tab.work[short].sum() / lengths[short].sum() * cap) if short.any() else np.inf
    feas = tab.tokens <= cap
    fastest = np.where(feas, tab.time, np.inf).min(axis=1)
    tall = np.flatnonzero(fastest > full)
    rho = full / cap if np.isfinite(full) else 0.0
    step_of = home.copy()
    if tall.shape[0] and max_delay + max_advance > 0:
        step_of[tall] = move_tall(tab.time, tab.tokens, cap, P, tall, home[tall], rho,
                                  max_delay, max_advance)
    return home, step_of, tab


@renamed(over_limit="over_length")
def plan_hybrid_stream(lengths, model: CPCostModel, n_ranks: int, batch_tokens: int, *,
                       max_delay: int = 2, max_advance: int = 2, over_length: OverLimit = "error",
                       candidates: int = 2, local_search: int = 64,
                       table: Optional[CPCostTable] = None,
                       step_seconds: Optional[list] = None) -> StreamResult:
    """Hybrid plans of consecutive global batches of about ``batch_tokens`` tokens, where
    **tall** documents (slower on any group than a round of short documents filling a rank's
    memory) may move to a nearby step so that several share one tall round: a document trains
    at most ``max_delay`` steps after and ``max_advance`` steps before its own step.

    Tall documents start in their own step, or in consecutive clusters (at most 8, within the
    window) chosen by dynamic programming, each at its members' mean step, whichever scores
    lower summed over steps; then each, in stream order (two passes), moves to the
    step in its window where the tall-round scores (:func:`packing.hybrid_cp.shelf_cost`) of
    the step it leaves and the step it joins drop most, if they drop; only documents of steps
    with at most 4 tall ones move, into steps with at most 8 (fuller steps already share tall
    rounds). The movement is one compiled kernel (:func:`packing.hybrid_move.move_tall`).
    Every other document trains in its own step (so a step that takes tall documents holds
    more tokens than the budget and one that gives them fewer; the loss is normalised by each
    step's own token count). ``max_delay = max_advance = 0`` is :func:`plan_stream`.

    A document longer than the pool holds is an error naming it, or cut into pieces (counted)
    with ``over_length="chunk"`` (older name: ``over_limit``).

    ``table`` may pass ``model.table(lengths, n_ranks)`` (built once per epoch, timed apart);
    ``step_seconds``, a list, receives the planning seconds of every step (the movement's
    time spread evenly over the steps)."""
    lengths = as_sizes(lengths)
    n = lengths.shape[0]
    P = int(n_ranks)
    limit, _ = model.pool_limit(P)
    if table is None or (lengths > limit).any():   # built before the clock starts
        table = model.table(np.minimum(lengths, limit), P)
    t0 = time.perf_counter()
    home, step_of, tab = stream_steps(lengths, model, P, batch_tokens, max_delay=max_delay,
                                      max_advance=max_advance, table=table)
    order = np.argsort(step_of, kind="stable")
    steps = np.split(order, np.flatnonzero(np.diff(step_of[order])) + 1)
    t_move = time.perf_counter() - t0
    plans = []
    secs = []
    doc_step = np.empty(n, dtype=np.int64)
    for s, docs in enumerate(steps):
        t1 = time.perf_counter()
        doc_step[docs] = s
        rows = None if (lengths[docs] > limit).any() else CPCostTable(
            tab.sizes, tab.time[docs], tab.compute[docs], tab.exposed[docs], tab.tokens[docs],
            tab.work[docs], tab.round_constant, tab.rank_capacity)
        p = plan_hybrid(lengths[docs], model, P, over_length=over_length, candidates=candidates,
                        local_search=local_search, table=rows)
        plans.append(p._replace(item_doc=docs[p.item_doc]))
        secs.append(time.perf_counter() - t1)
    if step_seconds is not None:
        step_seconds.extend(s_ + t_move / len(secs) for s_ in secs)
    return StreamResult(concat_plans(plans), doc_step, doc_step - home)

@register("hybrid_stream", "ours: hybrid per global batch, tall documents moved at most "
                           "max_delay steps (late or early) to share tall rounds",
          mode="hybrid", knobs=("max_delay", "over_length"), default=True)
def plan(lengths, cost, n_ranks, budget, config):
    secs: list = []   # per step, the movement's share included; the cost table apart
    sr = plan_hybrid_stream(lengths, cost, n_ranks, budget, max_delay=config.max_delay,
                            max_advance=config.max_delay, over_length=config.over_length,
                            step_seconds=secs)
    return sr.plan, secs


__all__ = ["StreamResult", "plan_hybrid_stream", "plan_stream", "stream_steps"]
