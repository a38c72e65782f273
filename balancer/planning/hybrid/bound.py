"""The step time of a hybrid DP x CP plan under the CP cost model, and the lower bounds it is
measured against: :func:`estimate` (per rank and round compute and exposed exchange,
barrier per round or none), :class:`HybridEstimate`, :func:`doc_bounds` and
:func:`tight_lower_bound` (each document at its least area on a group that holds it).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from packing.hybrid_cp import HybridPlan
from packing.validate import as_sizes

from ...cost.cp import CPCostModel, CPCostTable
from ...strategies.hybrid import round_loads


# ---- the estimate --------------------------------------------------------------------------------
class HybridEstimate(NamedTuple):
    """Step time of a plan under a CP cost model (seconds).

    * ``step_time``: sum over rounds of the slowest rank's time in the round (a barrier ends every
      round: what Megatron-LM runs, and what FSDP's per-microbatch collectives impose);
    * ``step_time_async``: no barrier: a group starts when all its ranks finished their previous
      round, the step ends with the slowest rank (DDP-style gradient accumulation); for a fixed
      partition this is the slowest group's sum over rounds;
    * ``lower_bound``: the documents' compute whole on one rank (no padding, no exchange, not cut)
      over the pool, or the longest document's fastest no-exchange time on any group if larger;
    * ``exposed_comm_fraction``: exposed exchange over all busy time of all ranks;
    * ``documents_cut``; ``attention_removed``: the fraction of the documents' causal query-key
      pairs that cutting removed (0 without cuts);
    * ``round_time`` float64[R]; ``compute``/``exposed`` float64[R, P]: per rank and round;
    * ``tight_lower_bound`` (and per step ``step_tight_bounds``): :func:`tight_lower_bound`, the
      no-cut bound that charges each document its least area on any group it fits, forced
      exposed exchange included (valid for the per-document exchange of this estimate).
    """

    step_time: float
    step_time_async: float
    lower_bound: float
    exposed_comm_fraction: float
    documents_cut: int
    attention_removed: float
    round_time: np.ndarray
    compute: np.ndarray
    exposed: np.ndarray
    step_times: np.ndarray
    step_times_async: np.ndarray
    step_lower_bounds: np.ndarray
    tight_lower_bound: float = 0.0
    step_tight_bounds: Optional[np.ndarray] = None

    @property
    def ratio(self) -> float:
        return self.step_time / self.lower_bound if self.lower_bound > 0 else 1.0

    @property
    def tight_ratio(self) -> float:
        return self.step_time / self.tight_lower_bound if self.tight_lower_bound > 0 else 1.0


def doc_bounds(table: CPCostTable, n_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Per document (float64[n] each): the least **area** (group size x per-rank time,
    compute plus exposed exchange) and the least **per-rank time** over the group sizes it fits
    (``tokens <= rank_capacity``). A document longer than one rank holds must run on a group
    of at least ``ceil(L / rank_capacity)`` ranks (rounded up to a power of two) and so pays
    that group's padding, small-shard attention and exposed exchange: no planner avoids them.
    A document no group holds falls back to its whole work and whole time."""
    feas = table.tokens <= table.rank_capacity
    size = table.sizes[None, :].astype(np.float64)
    area = np.where(feas, table.time * size, np.inf).min(axis=1)
    fast = np.where(feas, table.time, np.inf).min(axis=1)
    area = np.where(np.isfinite(area), area, table.work)
    fast = np.where(np.isfinite(fast), fast, table.time[:, 0])
    return area, fast


def tight_lower_bound(table: CPCostTable, n_ranks: int, doc_step: np.ndarray,
                      n_steps: int) -> np.ndarray:
    """float64[S]: a lower bound on each step's time (barrier per round, per-document
    exchange) of ANY plan that trains the documents of ``doc_step == s`` whole in step ``s``:
    ``max(sum of their least areas / P, their largest least per-rank time + the round
    constant)`` (:func:`doc_bounds`). Every rank-second of a step is some document's time on
    some rank, and a step lasts at least as long as its slowest document on its fastest group.
    It is the old no-cut bound (whole-document work over the pool, zero exposure) raised by the
    forced cost of documents longer than a rank holds."""
    area, fast = doc_bounds(table, n_ranks)
    out = np.zeros(int(n_steps))
    ok = doc_step >= 0
    s = doc_step[ok]
    a = np.bincount(s, weights=area[ok], minlength=n_steps)[:n_steps] / int(n_ranks)
    f = np.zeros(int(n_steps))
    np.maximum.at(f, s, fast[ok] + table.round_constant)
    has = np.bincount(s, minlength=n_steps)[:n_steps] > 0
    out[has] = np.maximum(a, f)[has]
    return out


def estimate(plan: HybridPlan, model: CPCostModel, lengths, *,
             exchange: str = "document") -> HybridEstimate:
    """Evaluate ``plan`` (of the documents ``lengths``, indexed by ``plan.item_doc``) under
    ``model``: per rank and round, the sum of its items' compute and exposed exchange (a sharded
    item counts on every rank of its group, a whole one on its owner), plus the per-microbatch
    constant on every rank that runs something.

    ``exchange="document"`` (the planner's model) charges every sharded document its own
    exchange (latency included), as when each runs its own pass (Megatron's schedule);
    ``exchange="group"`` charges one exchange per group and round for all the documents sharded
    there together (their bytes summed, one latency, hidden behind their summed attention:
    :meth:`CPCostModel.group_exposed`), as a ring or all-gather over a packed group microbatch
    runs."""
    if exchange not in ("document", "group"):
        raise ValueError(f"exchange {exchange!r}: expected 'document' or 'group'")
    lengths = as_sizes(lengths)
    P = plan.n_ranks
    R = plan.n_rounds
    items = plan.item_length if plan.item_length.any() else lengths[plan.item_doc]
    tab = model.table(items, P)
    it = plan.entry_item

    def grouped(g_of, k, sh):
        # one exchange per (round, group) for its sharded documents together
        parts = model.exchange_parts(items, P)
        G = plan.group_size.shape[0]
        gs = g_of[sh]
        ks = k[sh]
        sums = [np.bincount(gs, weights=a[it[sh], ks], minlength=G)
                for a in (parts.bytes_s, parts.attn_f, parts.attn_b)]
        has = np.bincount(gs, minlength=G) > 0
        gk = np.log2(plan.group_size).astype(np.int64)
        grp_x = np.zeros(G)
        for gi in np.flatnonzero(has).tolist():
            grp_x[gi] = model.group_exposed(sums[0][gi], sums[1][gi], sums[2][gi], int(gk[gi]),
                                            parts.latency)
        grnd = plan.round_of_group()
        dgx = np.zeros((R, P + 1))
        hg = np.flatnonzero(has)
        np.add.at(dgx, (grnd[hg], plan.group_offset[hg]), grp_x[hg])
        np.add.at(dgx, (grnd[hg], plan.group_offset[hg] + plan.group_size[hg]), -grp_x[hg])
        return np.maximum(np.cumsum(dgx, axis=1)[:, :P], 0.0)

    comp, expo, busy = round_loads(plan, tab, grouped if exchange == "group" else None)
    rnd = plan.round_of_group()[plan.group_of_entry()]
    load = comp + expo + tab.round_constant * busy
    round_time = load.max(axis=1) if R else np.zeros(0)
    # per step
    S = plan.n_steps
    sr = plan.step_rounds
    step_t = np.array([round_time[sr[s]:sr[s + 1]].sum() for s in range(S)])
    step_a = np.array([_async_time(plan, load, sr[s], sr[s + 1]) for s in range(S)])
    # lower bound per step from the documents of that step (whole, not cut)
    doc_tab = model.table(lengths, P)
    item_step = np.searchsorted(sr, rnd, side="right") - 1
    doc_step = np.full(lengths.shape[0], -1, dtype=np.int64)
    doc_step[plan.item_doc[it]] = item_step
    step_lb = np.zeros(S)
    for s in range(S):
        docs = np.flatnonzero(doc_step == s)
        if docs.size == 0:
            continue
        lb = doc_tab.work[docs].sum() / P
        feas = doc_tab.tokens[docs] <= model.rank_capacity
        fastest = np.where(feas, doc_tab.compute[docs], np.inf).min(axis=1).max()
        step_lb[s] = max(lb, fastest if np.isfinite(fastest) else 0.0)
    step_tb = tight_lower_bound(doc_tab, P, doc_step, S)
    total_busy = float(load.sum())
    # attention removed by cutting: query-key pairs of whole documents vs of their pieces
    used = np.unique(plan.item_doc)
    lf = lengths[used].astype(np.float64)
    pairs_whole = float((lf * (lf + 1) / 2).sum())
    pf = items.astype(np.float64)
    pairs_items = float((pf * (pf + 1) / 2).sum())
    removed = 1.0 - pairs_items / pairs_whole if pairs_whole > 0 else 0.0
    return HybridEstimate(float(step_t.sum()), float(step_a.sum()), float(step_lb.sum()),
                          float(expo.sum() / total_busy) if total_busy > 0 else 0.0,
                          int(plan.documents_cut), max(0.0, removed), round_time, comp, expo,
                          step_t, step_a, step_lb, float(step_tb.sum()), step_tb)


def _async_time(plan: HybridPlan, load: np.ndarray, r0: int, r1: int) -> float:
    """Step time without barriers: every group of a round starts when its slowest member is
    ready; each member is then busy for its own load."""
    ready = np.zeros(plan.n_ranks)
    for r in range(r0, r1):
        for g in range(plan.round_groups[r], plan.round_groups[r + 1]):
            o, s = plan.group_offset[g], plan.group_size[g]
            start = ready[o:o + s].max()
            ready[o:o + s] = start + load[r, o:o + s]
    return float(ready.max())



__all__ = ["HybridEstimate", "doc_bounds", "estimate", "tight_lower_bound"]
