"""The pure planning part of run-time balancing: what every DP rank offers for one step -> the
step's plan (which rank trains which sample in which microbatch, what is carried to a later
step). No torch, no collective: every rank calls :meth:`StepPlanner.plan` on the same gathered
:class:`Offers` and gets a bit-identical :class:`StepPlan`.

The plan of a step *is* the offline planner's plan: the offers, in their canonical order, are
planned by the strategy (``balanced`` by default) exactly as :func:`balancer.plan_epoch` plans
them with ``shuffle=False`` (so the stream order is the offer order), and the step is that
plan's first step. Samples of its later steps are carried: offered
again, first, at the next step, one step older.

Policies (all counted in ``StepPlan.stats``, nothing dropped):

* ``microbatches=None``: the layout's microbatches per rank, a token budget per step
  (``global_batch_tokens`` or dp x microbatches x capacity); what does not fit is carried.
  A sample carried ``max_carry`` times (default ``config.max_delay``) is *pinned*: if the plan
  would carry it again, the step is planned from the longest prefix of the offers (pinned ones
  lead) within the step's budget whose plan places every pinned sample -- one step reads such a
  prefix whole, so every heavy sample in it goes now; a pinned sample that no such plan places
  (it does not fit the capacity beside the others) waits again and is counted in
  ``carry_bound_exceeded``.
* ``microbatches="auto"`` (RL): the whole step in one step, nothing carried: the fewest
  microbatches per rank (at least ``min_microbatches``) whose plan places every sample; when
  that plan's slowest rank is more than ``slack`` (1%) above the lower bound (a step filled to
  the brim leaves no room to balance cost), up to ``extra_microbatches`` (2) more are tried and
  the smallest count within ``slack`` of the best is kept (per-microbatch constants of the
  cost model count against more microbatches).
* ``carry=False`` with a fixed count: a step that does not fit raises, naming the totals.
* ``final=True`` (end of a stream): the tail is merged into the step when it fits
  (``tail="partial"``); a step whose carried samples the following final steps could not all
  train (fewer than DP ranks left, or a tail no step can place) plans the longest prefix of
  its offers whose rest drains (the newest wait), or else the whole step in at most the
  layout's microbatches per rank (FFD on tokens when the strategy cannot). Only offers of
  fewer samples than DP ranks in all (or a tail no rule places) cannot make a step and are
  returned as ``unplanned`` (counted, by id).
* over-long samples (padded size over the capacity): ``over_length="error"`` raises naming the
  rank, the sample id, its length and the capacity; ``"skip"`` leaves them out, listed in
  ``skipped``.
"""
from __future__ import annotations

import time
from typing import Literal, Optional, Union

import numpy as np

from ..config import Layout, PlannerConfig
from ..cost.model import CostModel
from ..planning.planner import padded_sizes
from ..strategies.registry import get as strategy_fn
from .offers import I64, Offers, StepPlan

Microbatches = Union[None, int, Literal["auto"]]


class StepPlanner:
    """Plans one step from the gathered :class:`Offers` (see the module docstring for the
    policies). ``layout.dp`` is the number of ranks; ``layout.microbatches`` the fixed count
    (``microbatches=None``) or, with ``"auto"``, ignored in favour of ``min_microbatches``."""

    def __init__(self, cost: CostModel, layout: Layout, config: Optional[PlannerConfig] = None,
                 *, microbatches: Microbatches = None, min_microbatches: int = 1,
                 carry: bool = True, max_carry: Optional[int] = None,
                 over_length: Literal["error", "skip"] = "error", extra_microbatches: int = 2,
                 slack: float = 0.01):
        config = config or PlannerConfig()
        if config.over_length != "error":
            raise ValueError("run-time balancing moves whole samples: over_length='chunk' is not "
                             "supported (use over_length='skip' here, counted, or 'error')")
        if config.window_samples is not None:
            raise ValueError("window_samples does not apply to one step")
        if over_length not in ("error", "skip"):
            raise ValueError(f"over_length must be 'error' or 'skip', got {over_length!r}")
        if microbatches not in (None, "auto") and not (isinstance(microbatches, int)
                                                      and microbatches >= 1):
            raise ValueError(f"microbatches must be None, 'auto' or a positive int, got "
                             f"{microbatches!r}")
        if isinstance(microbatches, int) and not isinstance(microbatches, bool):
            layout = layout.model_copy(update={"microbatches": microbatches})
        if min_microbatches < 1:
            raise ValueError(f"min_microbatches {min_microbatches} must be >= 1")
        self.cost, self.layout = cost, layout
        self.auto = microbatches == "auto"
        self.min_microbatches = int(min_microbatches)
        self.carry = bool(carry) and not self.auto
        self.max_carry = config.max_delay if max_carry is None else int(max_carry)
        self.over_length = over_length
        self.extra_microbatches, self.slack = int(extra_microbatches), float(slack)
        base = config.model_copy(update={"shuffle": False})
        if self.auto:  # one step, read whole: look-ahead has nothing to see
            base = base.model_copy(update={"lookahead": False, "global_batch_tokens": None,
                                           "global_batch_samples": None, "tail": "partial"})
        self.config = base
        # built once, not per step (pydantic copies cost ~20 us each)
        self._ffd_config = base.model_copy(update={"strategy": "ffd_tokens"})
        self._layouts: dict = {}
        self._whole = None

    def _layout_with(self, m: int) -> Layout:
        lay = self._layouts.get(m)
        if lay is None:
            lay = self._layouts[m] = self.layout.model_copy(update={"microbatches": m})
        return lay

    # ---- helpers ----------------------------------------------------------------------------
    def _check(self, offers: Offers, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lay = self.layout
        n = len(offers)
        if n and int(offers.length.min()) > 0 and int(sizes.max()) <= lay.capacity:
            return np.arange(n, dtype=I64), np.zeros(0, I64)  # the common case, two reductions
        bad = np.flatnonzero(offers.length <= 0)
        if bad.size:
            k = int(bad[0])
            raise ValueError(f"{offers.describe(k)}: length {int(offers.length[k])} is not "
                             f"positive (every sample needs at least one token)")
        over = sizes > lay.capacity
        skipped = np.flatnonzero(over)
        if skipped.size and self.over_length == "error":
            k = int(skipped[0])
            pad = f" (padded to {int(sizes[k])} for cp={lay.cp})" if lay.cp > 1 else ""
            raise ValueError(f"{offers.describe(k)}: length {int(offers.length[k])}{pad} exceeds "
                             f"the microbatch capacity {lay.capacity}; {int(skipped.size)} such "
                             f"sample(s) this step (over_length='skip' leaves them out, counted)")
        return np.flatnonzero(~over), skipped

    def _plan(self, offers: Offers, stream: np.ndarray, layout: Layout, config: PlannerConfig):
        """Step 0 of the offline plan of ``stream``: (entries as offer indices, microbatch
        offsets, forward and backward costs, the offers of ``stream`` it leaves). The strategy
        is called as :func:`balancer.plan_epoch` calls it for ``SampleTable(offers.length[
        stream])`` with ``shuffle=False`` (same sizes, costs, budget), without re-validating
        lengths or building the whole epoch's arrays (tests compare the two)."""
        whole = stream is self._whole  # every offer, in order: no copies
        sizes = self._sizes if whole else self._sizes[stream]
        if config.global_batch_samples is not None:
            budget, weights = int(config.global_batch_samples), np.ones(stream.shape[0], I64)
        else:
            budget = int(config.global_batch_tokens or
                         layout.dp * layout.microbatches * layout.capacity)
            weights = None
        sp = strategy_fn(config.strategy)(sizes, self._costs if whole else self._costs[stream],
                                             layout, config, budget,
                                             weights)
        n_mb = layout.dp * (int(sp.step_mbs[0]) if sp.step_mbs.shape[0] else 0)
        offs = sp.mb_offsets[:n_mb + 1].copy()
        entry = stream[sp.entry_item[:int(offs[-1])]]
        if entry.shape[0] == stream.shape[0]:  # every offer placed (entries are distinct)
            rest = stream[:0]
        else:
            placed = np.zeros(len(offers), bool)
            placed[entry] = True
            rest = stream[~placed[stream]]
        cf, cb = self.cost.microbatch_constant
        if entry.shape[0]:
            f = np.add.reduceat(self._fwd[entry], offs[:-1]) + cf
            b = np.add.reduceat(self._bwd[entry], offs[:-1]) + cb
        else:
            f = b = np.zeros(0)
        return entry, offs, f, b, rest

    def _try(self, offers, stream, layout, config):
        """(slowest rank's cost, layout, plan arrays) when the plan places all of ``stream``
        in one step, else None."""
        try:
            entry, offs, f, b, rest = self._plan(offers, stream, layout, config)
        except ValueError:
            return None
        if rest.size:
            return None
        worst = float((f + b).reshape(layout.dp, -1).sum(1).max())
        return worst, layout, entry, offs, f, b

    def _pin(self, offers, stream, pinned, lay, cfg, first, stats):
        """Samples carried ``max_carry`` times go now if any plan can take them: plan a prefix
        of the offers (the pinned ones lead it) that one step reads whole, so every heavy
        sample in it goes now, the longest such prefix within the step's budget that places
        every pinned sample (bisection); else the plan that leaves the fewest pinned."""
        stats["pinned"] = int(pinned.size)
        if cfg.global_batch_samples is not None:
            k_hi = int(cfg.global_batch_samples)
        else:
            budget = cfg.global_batch_tokens or lay.dp * lay.microbatches * lay.capacity
            cum = np.cumsum(padded_sizes(offers.length[stream], lay.cp))
            k_hi = int(np.searchsorted(cum, budget, side="right"))
        k_lo = max(pinned.size, lay.dp)
        k_hi = min(max(k_hi, k_lo), stream.shape[0])

        def attempt(k):
            stats["replans"] += 1
            try:
                e, o, f, b, rest = self._plan(offers, stream[:k], lay, cfg)
            except ValueError:  # a tail the kernel cannot spread: no use
                return int(pinned.size) + 1, None
            rest = np.concatenate([rest, stream[k:]])
            return int(np.isin(pinned, rest).sum()), (stream[:k], (e, o, f, b, rest))

        best_left, best = int(np.isin(pinned, first[4]).sum()), (stream, first)
        left, cand = attempt(k_hi)  # the whole budget first
        if left == 0:
            return cand
        if left < best_left and cand is not None:
            best_left, best = left, cand
        found, lo, hi = None, k_lo, k_hi - 1  # the longest shorter prefix taking all pinned
        while lo <= hi:
            mid = (lo + hi + 1) // 2
            left, cand = attempt(mid)
            if left == 0:
                found, lo = cand, mid + 1
            else:
                if left < best_left and cand is not None:
                    best_left, best = left, cand
                hi = mid - 1
        return found or best

    def _drains(self, offers, rest, lay, cfg, limit: int = 64) -> bool:
        """Whether ``rest`` (offer indices, in offer order), offered alone in further final
        steps, is trained to the last sample: each step's plan places some, never leaving
        fewer than ``dp`` (nor an unplaceable tail). Carried samples come back in the same
        order (one step older each), so this is the next steps' plan unless other offers join."""
        for _ in range(limit):
            if rest.shape[0] == 0:
                return True
            if rest.shape[0] < lay.dp:
                return False
            try:
                e, _, _, _, rest = self._plan(offers, rest, lay, cfg)
            except ValueError:
                return False
            if e.shape[0] == 0:
                return False
        return False

    def _keep_back(self, offers, stream, lay, cfg, keep, first):
        """The longest prefix of the offers whose plan carries at least ``keep`` samples (the
        newest wait one step); the first plan when none does."""
        for k in range(stream.shape[0] - (keep - first[1][4].shape[0]), lay.dp - 1, -1):
            try:
                e, o, f, b, rest = self._plan(offers, stream[:k], lay, cfg)
            except ValueError:
                continue
            rest = np.concatenate([rest, stream[k:]])
            if e.shape[0] and rest.shape[0] >= keep:
                return stream[:k], (e, o, f, b, rest)
        return first

    def _drain_plan(self, offers, stream, lay, cfg, first):
        """A final step whose carried samples would not all be trained by the steps after it
        (fewer left than DP ranks, or a tail no step can place: they would end unplanned, issue
        29 item 3) plans instead the longest prefix of its offers whose rest drains (the newest
        offers wait), or, failing that, the whole step in at most the layout's microbatches
        per rank (the strategy, then FFD on tokens); the first plan when none does.
        ``first``: (the offers the first plan planned, its arrays); ``stream``: all the step's
        offers. Returns (the planned offers, the plan's layout and config, its arrays)."""
        for k in range(stream.shape[0] - 1, lay.dp - 1, -1):
            try:
                e, o, f, b, rest = self._plan(offers, stream[:k], lay, cfg)
            except ValueError:
                continue
            rest = np.concatenate([rest, stream[k:]])
            if e.shape[0] and self._drains(offers, rest, lay, cfg):
                return stream[:k], lay, cfg, (e, o, f, b, rest)
        ffd = self._ffd_config.model_copy(update={"tail": cfg.tail})
        for m in range(lay.microbatches, 0, -1):  # every rank needs m non-empty microbatches
            for c in (cfg, ffd):
                whole = self._try(offers, stream, self._layout_with(m), c)
                if whole is not None:
                    _, layout, e, o, f, b = whole
                    return stream, layout, c, (e, o, f, b, stream[:0])
        return first[0], lay, cfg, first[1]

    # ---- the plan ------------------------------------------------------------------------
    def plan(self, offers: Offers, *, final: bool = False, keep: int = 0) -> StepPlan:
        """The step's plan from every rank's offers (identical on every rank). ``final``: no
        more samples will be offered after these (the end of a stream) except ``keep`` > 0:
        the next step brings new samples, but fewer than ``dp``; this step then carries at
        least ``keep`` (when a shorter prefix of the offers allows it), so that the next has
        one for every rank."""
        t0 = time.perf_counter()
        lay = self.layout
        self._sizes = padded_sizes(offers.length, lay.cp)
        stream, skipped = self._check(offers, self._sizes)
        if skipped.size == 0:
            self._whole = stream  # _plan uses the arrays as they are for this stream
            self._fwd, self._bwd = self.cost.doc_costs(offers.length)
        else:  # costs of the samples that can be planned (over-long ones skipped)
            self._whole = None
            ok = np.zeros(len(offers), bool)
            ok[stream] = True
            self._fwd, self._bwd = np.zeros(len(offers)), np.zeros(len(offers))
            if stream.size:
                self._fwd[ok], self._bwd[ok] = self.cost.doc_costs(offers.length[ok])
        self._costs = self._fwd + self._bwd
        lay, cfg = self.layout, self.config
        stats = {"offered": len(offers), "skipped": int(skipped.size), "pinned": 0,
                 "carry_bound_exceeded": 0, "replans": 0}
        empty = np.zeros(0, I64)
        if stream.shape[0] < lay.dp:
            if self.auto or not self.carry:
                raise ValueError(f"{stream.shape[0]} sample(s) cannot fill {lay.dp} DP ranks: every "
                                 f"rank needs at least one sample per step")
            carried, unplanned = (empty, stream) if final else (stream, empty)
            # too few to give every rank one: overdue ones wait again, counted
            stats["carry_bound_exceeded"] = int((offers.age[carried] >= self.max_carry).sum())
            return self._finish(offers, lay, cfg, stream, empty, np.zeros(1, I64), carried,
                                unplanned, skipped, np.zeros(0), np.zeros(0), stats, t0)
        if self.auto:
            return self._plan_auto(offers, stream, skipped, stats, t0)
        cfg = cfg.model_copy(update={"tail": "partial" if final else "carry"})
        try:
            entry, offs, f, b, rest = self._plan(offers, stream, lay, cfg)
        except ValueError:  # a tail that fits neither one step nor two: leave it carried
            cfg = cfg.model_copy(update={"tail": "carry"})
            entry, offs, f, b, rest = self._plan(offers, stream, lay, cfg)
        planned = stream
        pinned = stream[offers.age[stream] >= self.max_carry]  # the first ones (age order)
        if np.isin(pinned, rest).any():
            planned, (entry, offs, f, b, rest) = self._pin(offers, stream, pinned, lay, cfg,
                                                           (entry, offs, f, b, rest), stats)
        if keep > 0 and rest.size < keep:
            planned, (entry, offs, f, b, rest) = self._keep_back(
                offers, stream, lay, cfg, keep, (planned, (entry, offs, f, b, rest)))
        elif final and keep <= 0 and rest.size and not self._drains(offers, rest, lay, cfg):
            planned, lay, cfg, (entry, offs, f, b, rest) = self._drain_plan(
                offers, stream, lay, cfg, (planned, (entry, offs, f, b, rest)))
        stats["carry_bound_exceeded"] = int((offers.age[rest] >= self.max_carry).sum())
        if rest.size and not self.carry:
            raise ValueError(
                f"the step's {stream.shape[0]} samples ({int(offers.length[stream].sum())} tokens) "
                f"do not fit {lay.dp} ranks x {lay.microbatches} microbatches x capacity "
                f"{lay.capacity}: {rest.size} left over (use microbatches='auto')")
        return self._finish(offers, lay, cfg, planned, entry, offs, rest, empty, skipped, f, b,
                            stats, t0)

    def _plan_auto(self, offers, stream, skipped, stats, t0):
        lay, cfg = self.layout, self.config
        whole = stream is self._whole
        sizes = self._sizes if whole else self._sizes[stream]
        total, k = int(sizes.sum()), stream.shape[0]
        m0 = max(self.min_microbatches, -(-total // (lay.dp * lay.capacity)))
        m_max = max(m0, -(-k // lay.dp))
        empty = np.zeros(0, I64)
        cf, cb = self.cost.microbatch_constant
        costs = self._costs if whole else self._costs[stream]
        bound = max(float(costs.sum()) / lay.dp, float(costs.max())) + m0 * (cf + cb)
        # the configured strategy first; if no count of microbatches lets it place the whole
        # step (a near-full step it cannot bin-pack), FFD on tokens, which packs tighter
        for c in (cfg, self._ffd_config):
            found = []
            for m in range(m0, m_max + 1):
                res = self._try(offers, stream, self._layout_with(m), c)
                if res is None:
                    stats["replans"] += 1
                    continue
                found.append(res)
                # a step filled to the brim cannot balance cost: a few more microbatches
                # (more room per rank) while the slowest rank is far from the bound
                if len(found) > self.extra_microbatches or res[0] <= (1 + self.slack) * bound:
                    break
                stats["replans"] += 1
            if found:
                best = min(r[0] for r in found)
                _, layout, entry, offs, f, b = next(r for r in found
                                                    if r[0] <= (1 + self.slack) * best)
                stats["fallback"] = c.strategy if c is not cfg else None
                return self._finish(offers, layout, c, stream, entry, offs, empty, empty,
                                    skipped, f, b, stats, t0)
            if cfg.strategy == "ffd_tokens":
                break
        raise ValueError(
            f"the step's {k} samples ({total} tokens, the largest {int(sizes.max())}) cannot be "
            f"placed in one step of {lay.dp} ranks under capacity {lay.capacity} with every rank "
            f"running the same number of non-empty microbatches (tried {m0}..{m_max} per rank, "
            f"strategies {cfg.strategy!r} and 'ffd_tokens')")

    def _finish(self, offers, layout, cfg, stream, entry, offs, carried, unplanned, skipped,
                f, b, stats, t0) -> StepPlan:
        stats.update(trained=int(entry.shape[0]), carried=int(carried.shape[0]),
                     unplanned=int(unplanned.shape[0]),
                     max_age=int(offers.age.max(initial=0)))
        plan = StepPlan(offers, layout, cfg, stream, entry, offs, carried, unplanned, skipped,
                        f, b, stats)
        stats["plan_seconds"] = time.perf_counter() - t0
        return plan


def imbalance(plan: StepPlan, cost: CostModel) -> dict:
    """Per-rank balance of a plan against a lower bound of the slowest rank: the larger of the
    mean rank cost and the dearest sample plus one rank's microbatch constants."""
    rc = plan.rank_costs()
    if rc.size == 0 or plan.entry.size == 0:
        return {"max_over_mean": 1.0, "max_over_bound": 1.0, "max_mb_tokens": 0}
    doc = cost.doc_total(plan.offers.length[plan.entry])
    cf, cb = cost.microbatch_constant
    bound = max(float(rc.mean()), float(doc.max()) + plan.microbatches * (cf + cb))
    return {"max_over_mean": float(rc.max() / rc.mean()), "max_over_bound": float(rc.max() / bound),
            "max_mb_tokens": int(plan.mb_tokens().max())}
