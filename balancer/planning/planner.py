"""The step planner: the epoch stream (:mod:`.stream`: order, items, sizes, costs) -> a
strategy's packing per window -> a :class:`~.plan.Plan` (step -> DP rank -> microbatch ->
samples) with per-microbatch costs (:func:`balancer.cost.blocks.microbatch_costs`).

Everything is a pure function of (lengths, cost model, layout, config, epoch, carried-in items):
every process that calls :func:`plan_epoch` with the same inputs gets a bit-identical plan, with
no communication.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import numpy as np

from packing.gather import take3

from ..config import Layout, PlannerConfig, check_budget, check_fixed_mode, step_budget
from ..cost.blocks import doc_totals, microbatch_costs
from ..cost.model import CostModel
from ..samples import SampleTable
from ..strategies import registry as strategies
from .plan import Items, Plan, microbatch_step_rank, step_offsets  # noqa: F401 (planner.Plan: the old home)
from .stream import (EpochStream, EpochWindows, epoch_order, epoch_stream,  # noqa: F401 (old home)
                     make_items, padded_sizes, window_ranges, zeros_view)


def plan_window(stream: EpochStream, layout: Layout, config: PlannerConfig, lo: int, hi: int,
                last: bool):
    """Plan items ``[lo, hi)`` of the stream on their own (a ``packing.StreamPlan`` whose item
    ids are absolute). Windows other than the last end with a partial step, never a carry."""
    import packing
    fn = strategies.get(config.strategy)
    cfg = config if last or config.tail == "partial" else config.model_copy(update={"tail": "partial"})
    w = None if stream.weights is None else stream.weights[lo:hi]
    sp = fn(stream.sizes[lo:hi], stream.costs[lo:hi], layout, cfg, stream.budget, w)
    if lo == 0:
        return sp
    return packing.StreamPlan(sp.entry_item + lo, sp.entry_delay, sp.mb_offsets, sp.step_mbs,
                              sp.leftover + lo)


def merge_windows(parts):
    """Concatenate window plans in order into one StreamPlan."""
    import packing
    parts = list(parts)
    if len(parts) == 1:
        return parts[0]
    offs, base = [], 0
    for p in parts:
        offs.append(p.mb_offsets[:-1] + base)
        base += int(p.mb_offsets[-1])
    offs.append(np.array([base], np.int64))
    return packing.StreamPlan(np.concatenate([p.entry_item for p in parts]),
                              np.concatenate([p.entry_delay for p in parts]),
                              np.concatenate(offs),
                              np.concatenate([p.step_mbs for p in parts]),
                              np.concatenate([p.leftover for p in parts]))


def build_plan(samples: SampleTable, cost: CostModel, layout: Layout, config: PlannerConfig,
               epoch: int, stream: EpochStream, sp) -> Plan:
    """Wrap a (merged) StreamPlan into a :class:`Plan` with per-microbatch costs. The stream's
    arrays are released as they are gathered (the stream is consumed)."""
    items = stream.items
    stream.costs = stream.sizes = None
    e = sp.entry_item
    left = sp.leftover
    leftover = Items(items.sample[left], items.start[left], items.length[left])
    if items.start.strides == (0,):  # nothing chunked: every start is 0
        # np.take: the same arrays as fancy indexing, faster
        entry_sample = np.take(items.sample, e)
        entry_start = zeros_view(e.shape[0])
        entry_length = np.take(items.length, e)
    else:
        entry_sample, entry_start, entry_length = take3(e, items.sample, items.start,
                                                        items.length)
    stream.items = items = None
    del e
    mb_fwd, mb_bwd = microbatch_costs(cost, entry_length, sp.mb_offsets)
    stats = dict(stream.stats)
    stats["dropped"] = len(leftover) if config.tail == "drop" else 0
    stats["carried_out"] = len(leftover) if config.tail == "carry" else 0
    # a sample waits longer than max_delay only when the items due in a step cannot all fit it
    stats["delay_bound_exceeded"] = int((sp.entry_delay > config.max_delay).sum())
    return Plan(layout=layout, config=config, cost_model=cost.name, epoch=epoch,
                n_samples=len(samples), dataset_fingerprint=samples.fingerprint(),
                entry_sample=entry_sample, entry_start=entry_start, entry_length=entry_length,
                entry_delay=sp.entry_delay, mb_offsets=sp.mb_offsets, step_mbs=sp.step_mbs,
                mb_fwd=mb_fwd, mb_bwd=mb_bwd, leftover=leftover, stats=stats)


def plan_epoch(samples: SampleTable, cost: CostModel, layout: Layout,
               config: Optional[PlannerConfig] = None, epoch: int = 0,
               carry_in: Optional[Items] = None, *,
               sample_extra_cost: Optional[np.ndarray] = None) -> Plan:
    """Plan one epoch. ``carry_in`` are items left over by the previous epoch (tail='carry');
    they go first. ``sample_extra_cost`` (float64[n], optional) is balanced on top of every
    sample's cost (on its first piece), not counted in the plan's microbatch costs: the
    multimodal planner's encoder cost in its joint mode."""
    config = config or PlannerConfig()
    strategies.get(config.strategy)
    check_fixed_mode(layout, "plan_epoch", config)
    check_budget(layout, *step_budget(layout, config))  # before anything is built
    t0 = time.perf_counter()
    stream = epoch_stream(samples, cost, layout, config, epoch, carry_in,
                          sample_extra_cost=sample_extra_cost)
    wins = stream.windows(config, layout.dp)
    sp = merge_windows(plan_window(stream, layout, config, lo, hi, i == len(wins) - 1)
                       for i, (lo, hi) in enumerate(wins))
    plan = build_plan(samples, cost, layout, config, epoch, stream, sp)
    plan.stats["plan_seconds"] = time.perf_counter() - t0
    return plan


def plan_epoch_windows(samples: SampleTable, window_cost: Callable[[int], CostModel],
                       layout: Layout, config: Optional[PlannerConfig] = None, epoch: int = 0,
                       carry_in: Optional[Items] = None) -> tuple[Plan, np.ndarray]:
    """Plan one epoch with window ``i`` balanced under ``window_cost(i)`` (the closed loop's
    refit models: windows not yet handed out are re-planned with the newest coefficients).
    Returns the plan and ``window_steps`` (int64[W + 1]: window ``i`` holds steps
    ``window_steps[i]:window_steps[i + 1]``). Every window is planned on its own (as in
    :func:`plan_epoch`), so with one model for every window the plan is :func:`plan_epoch`'s,
    bit for bit; its ``cost_model`` names every distinct model in window order."""
    config = config or PlannerConfig()
    strategies.get(config.strategy)
    check_fixed_mode(layout, "plan_epoch", config)
    check_budget(layout, *step_budget(layout, config))
    t0 = time.perf_counter()
    base = window_cost(0)
    stream = epoch_stream(samples, base, layout, config, epoch, carry_in)
    wins = stream.windows(config, layout.dp)
    models = [base] + [window_cost(i) for i in range(1, len(wins))]
    for (lo, hi), m in zip(wins, models):
        if m != base:  # the balanced cost of the window's items under its own model
            stream.costs[lo:hi] = doc_totals(m, stream.items.length[lo:hi])
    parts = [plan_window(stream, layout, config, lo, hi, i == len(wins) - 1)
             for i, (lo, hi) in enumerate(wins)]
    window_steps = np.concatenate([[0], np.cumsum([p.step_mbs.shape[0] for p in parts])])
    n_mb = np.concatenate([[0], np.cumsum([p.mb_offsets.shape[0] - 1 for p in parts])])
    plan = build_plan(samples, base, layout, config, epoch, stream, merge_windows(parts))
    names = list(dict.fromkeys(m.name for m in models))
    if len(names) > 1:
        fwd, bwd = plan.mb_fwd.copy(), plan.mb_bwd.copy()
        for i, m in enumerate(models):
            if m != base:
                lo, hi = int(n_mb[i]), int(n_mb[i + 1])
                off = plan.mb_offsets[lo:hi + 1]
                fwd[lo:hi], bwd[lo:hi] = microbatch_costs(
                    m, plan.entry_length[off[0]:off[-1]], off - off[0])
        plan = dataclasses.replace(plan, cost_model="+".join(names), mb_fwd=fwd, mb_bwd=bwd)
    plan.stats["plan_seconds"] = time.perf_counter() - t0
    return plan, window_steps.astype(np.int64)


def plan_epochs(samples: SampleTable, cost: CostModel, layout: Layout,
                config: Optional[PlannerConfig] = None, epochs: int = 1) -> list[Plan]:
    """Plans for epochs ``0..epochs-1``, threading the carried tail from one to the next."""
    plans, carry = [], None
    for e in range(epochs):
        p = plan_epoch(samples, cost, layout, config, e, carry)
        carry = p.leftover if (config or PlannerConfig()).tail == "carry" else None
        plans.append(p)
    return plans
