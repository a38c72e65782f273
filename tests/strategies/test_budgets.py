"""Step budgets and short steps (issue #13 items 1 and 9).

* Every registered strategy plans a valid epoch -- no empty microbatch, every sample exactly
  once, no microbatch over the capacity, the same microbatch count on every DP rank of a step --
  for any budget that can hold one sample per microbatch, and honours the budget (a step takes
  at most its budget, plus the sample that crosses it, unless it needs more samples to give
  every microbatch one). A smaller budget is refused before anything is planned, naming the
  budget, the layout and the minimum.
* The last step of an epoch gets only the microbatches it needs (fewer per rank, the same on
  every rank), and such a plan runs end to end: sampler (2 ranks), store round trip, metrics,
  report.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from balancer import CostModel, Layout, PlannerConfig, SampleTable, plan_epoch
from balancer.strategies import registry as strategies
from balancer.report.metrics import plan_summary, validate_plan
from balancer.planning.planner import padded_sizes

COST = CostModel.quadratic(65536)
STRATEGIES = strategies.names()
K128 = 131072


def _wlb(wlbllm, n):
    return np.asarray(wlbllm[:n], dtype=np.int64)


def check_valid(plan, lengths):
    """The invariants every plan must keep."""
    lay = plan.layout
    counts = np.diff(plan.mb_offsets)
    assert (counts > 0).all(), f"{int((counts == 0).sum())} empty microbatches"
    # every sample exactly once (tail 'partial': nothing is left over)
    assert len(plan.leftover) == 0
    assert np.array_equal(np.sort(plan.entry_sample), np.arange(len(lengths)))
    assert np.array_equal(plan.entry_length, lengths[plan.entry_sample])
    # capacity, CP padding included
    padded = padded_sizes(plan.entry_length, lay.cp)
    assert np.add.reduceat(padded, plan.mb_offsets[:-1]).max() <= lay.capacity
    # equal microbatch count on every rank of a step, between 1 and the layout's
    assert plan.step_mbs.dtype == np.int64
    assert (plan.step_mbs >= 1).all() and (plan.step_mbs <= lay.microbatches).all()
    assert int((plan.step_mbs * lay.dp).sum()) == plan.n_microbatches
    for s in (0, plan.n_steps - 1):
        ids = [plan.microbatch_ids(s, r) for r in range(lay.dp)]
        assert {len(i) for i in ids} == {int(plan.step_mbs[s])}
    assert validate_plan(plan, lengths)["valid"]


def step_totals(plan):
    """(tokens int64[S] CP padding included, samples int64[S]) of every step."""
    mb_step = np.repeat(np.arange(plan.n_steps), plan.step_mbs * plan.layout.dp)
    ent_step = np.repeat(mb_step, np.diff(plan.mb_offsets))
    padded = padded_sizes(plan.entry_length, plan.layout.cp)
    return (np.bincount(ent_step, weights=padded, minlength=plan.n_steps).astype(np.int64),
            np.bincount(ent_step, minlength=plan.n_steps))


def check_budget(plan, lengths, budget, by_samples):
    """The budget is honoured: a step takes at most its budget plus the sample that crosses it
    (a merged tail, or heavy samples at their deadline, may add about one sample per rank),
    unless it holds exactly one sample per microbatch -- the fewest it can hold, which a step
    whose budget-worth of samples is fewer than its microbatches takes instead."""
    lay = plan.layout
    tokens, samples = step_totals(plan)
    used = samples if by_samples else tokens
    biggest = 1 if by_samples else int(padded_sizes(lengths, lay.cp).max())
    slack = biggest * (1 + lay.dp)
    min_fill = samples == plan.step_mbs * lay.dp
    over = (used > budget + slack) & ~min_fill
    assert not over.any(), (budget, np.flatnonzero(over)[:5], used[over][:5])
    # the budget is not ignored: the epoch takes about total / budget steps (or more)
    assert plan.n_steps >= int(used.sum()) // (budget + slack)


# (name, layout, budget kind, budget, samples)
CASES = [
    ("8dp-4mb-128K-512K", Layout(dp=8, microbatches=4, capacity=K128), "tokens", 512 * 1024,
     20000),
    ("8dp-4mb-128K-256K", Layout(dp=8, microbatches=4, capacity=K128), "tokens", 256 * 1024,
     8000),
    ("8dp-4mb-128K-64K", Layout(dp=8, microbatches=4, capacity=K128), "tokens", 64 * 1024,
     4000),
    ("8dp-4mb-128K-minimum", Layout(dp=8, microbatches=4, capacity=K128), "tokens", 32, 1500),
    ("8dp-4mb-128K-default", Layout(dp=8, microbatches=4, capacity=K128), "tokens", None,
     20000),
    ("8dp-4mb-128K-twice-a-step", Layout(dp=8, microbatches=4, capacity=K128), "tokens",
     2 * 32 * K128, 20000),
    ("2dp-2pp-2cp-4mb-64K-48K", Layout(dp=2, pp=2, cp=2, microbatches=4, capacity=65536),
     "tokens", 48 * 1024, 6000),
    ("2dp-2pp-2cp-4mb-64K-minimum", Layout(dp=2, pp=2, cp=2, microbatches=4, capacity=65536),
     "tokens", 2 * 4 * 4, 600),
    ("4dp-1pp-2mb-32K-samples-minimum", Layout(dp=4, microbatches=2, capacity=32768),
     "samples", 8, 1200),
    ("4dp-1pp-2mb-32K-samples-20", Layout(dp=4, microbatches=2, capacity=32768), "samples", 20,
     3000),
    ("1dp-4pp-4mb-128K-128K", Layout(dp=1, pp=4, microbatches=4, capacity=K128), "tokens",
     K128, 6000),
]


def _config(strategy, kind, budget, **kw):
    if kind == "tokens":
        return PlannerConfig(strategy=strategy, global_batch_tokens=budget, **kw)
    return PlannerConfig(strategy=strategy, global_batch_samples=budget, **kw)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_strategy_plans_every_feasible_budget(wlbllm, strategy, case):
    _, layout, kind, budget, n = case
    lengths = np.minimum(_wlb(wlbllm, n), layout.capacity // (2 * layout.cp) * (2 * layout.cp))
    plan = plan_epoch(SampleTable(lengths), COST, layout, _config(strategy, kind, budget))
    check_valid(plan, lengths)
    b = budget if budget is not None else layout.dp * layout.microbatches * layout.capacity
    check_budget(plan, lengths, b, kind == "samples")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_budget_strategies_follow_the_budget(wlbllm, strategy):
    # a smaller budget means more, smaller steps (sequential included: it no longer ignores it)
    lengths = _wlb(wlbllm, 8000)
    layout = Layout(dp=8, microbatches=4, capacity=K128)
    steps = {b: plan_epoch(SampleTable(lengths), COST, layout,
                           PlannerConfig(strategy=strategy, global_batch_tokens=b)).n_steps
             for b in (None, 1024 * 1024, 256 * 1024)}
    total = int(lengths.sum())
    assert steps[256 * 1024] >= total // (256 * 1024 + K128) > steps[None]
    assert steps[256 * 1024] > steps[1024 * 1024] > steps[None]


def _refused(strategy, layout, kind, budget, lengths):
    with pytest.raises(ValueError) as e:
        plan_epoch(SampleTable(lengths), COST, layout, _config(strategy, kind, budget))
    return str(e.value)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_budget_below_one_sample_per_microbatch_is_refused(wlbllm, strategy):
    lengths = _wlb(wlbllm, 400)
    lay = Layout(dp=8, microbatches=4, capacity=K128)
    msg = _refused(strategy, lay, "tokens", 31, lengths)
    assert msg == ("global_batch_tokens=31 cannot give every microbatch of a step a sample: "
                   "the layout dp=8 x microbatches=4 has 32 microbatches per step and a sample "
                   "takes at least 1 token, so the smallest budget is 32 tokens; raise "
                   "global_batch_tokens to at least 32, or use fewer DP ranks or microbatches")
    msg = _refused(strategy, lay, "samples", 31, lengths)
    assert msg == ("global_batch_samples=31 cannot give every microbatch of a step a sample: "
                   "the layout dp=8 x microbatches=4 has 32 microbatches per step, so the "
                   "smallest budget is 32 samples; raise global_batch_samples to at least 32, "
                   "or use fewer DP ranks or microbatches")
    # under CP every document is padded to a multiple of 2 x cp tokens
    cp = Layout(dp=2, pp=2, cp=2, microbatches=4, capacity=65536)
    msg = _refused(strategy, cp, "tokens", 31, lengths)
    assert "dp=2 x microbatches=4 has 8 microbatches per step and a sample takes at least 4 " \
           "tokens (padded to a multiple of 2 x cp=2), so the smallest budget is 32 tokens" in msg


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_budget_is_refused_before_any_planning(strategy, monkeypatch):
    # refused up front: neither the epoch's items nor its costs are built, and the strategy
    # function refuses it too when called directly (the runtime and precompute call it so)
    import balancer.planning.planner as P

    def boom(*a, **k):  # pragma: no cover - must not be reached
        raise AssertionError("the epoch stream was built for a budget that is refused")

    monkeypatch.setattr(P, "epoch_stream", boom)
    lay = Layout(dp=4, microbatches=2, capacity=4096)
    with pytest.raises(ValueError, match=r"global_batch_tokens=7 .* smallest budget is 8 tokens"):
        plan_epoch(SampleTable(np.full(100, 10)), COST, lay,
                   PlannerConfig(strategy=strategy, global_batch_tokens=7))
    sizes = np.full(100, 10, np.int64)
    fn = strategies.get(strategy)
    with pytest.raises(ValueError, match=r"global_batch_samples=7 .* smallest budget is 8 "):
        fn(sizes, sizes.astype(float), lay, PlannerConfig(strategy=strategy), 7,
           np.ones(100, np.int64))
    with pytest.raises(ValueError, match=r"global_batch_tokens=7 .* smallest budget is 8 "):
        fn(sizes, sizes.astype(float), lay, PlannerConfig(strategy=strategy), 7, None)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_minimum_budget_steps_hold_one_sample_per_microbatch(wlbllm, strategy):
    lengths = _wlb(wlbllm, 1000)
    lay = Layout(dp=8, microbatches=4, capacity=K128)
    for kind in ("tokens", "samples"):
        plan = plan_epoch(SampleTable(lengths), COST, lay, _config(strategy, kind, 32))
        check_valid(plan, lengths)
        _, samples = step_totals(plan)
        full = plan.step_mbs == lay.microbatches
        # every full step takes the fewest samples it can: one per microbatch
        assert (samples[full][:-1] == 32).all(), samples[:10]


# ---- the tail ---------------------------------------------------------------------------


def _tail_layouts():
    return [Layout(dp=16, microbatches=4, capacity=K128), Layout(dp=8, microbatches=8,
                                                                 capacity=K128),
            Layout(dp=1, pp=4, microbatches=64, capacity=K128)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_tail_step_uses_only_the_microbatches_it_needs(wlbllm, strategy):
    lengths = np.asarray(wlbllm, dtype=np.int64)
    for lay in _tail_layouts():
        plan = plan_epoch(SampleTable(lengths), COST, lay, PlannerConfig(strategy=strategy))
        check_valid(plan, lengths)
        tokens, _ = step_totals(plan)
        m = int(plan.step_mbs[-1])
        # the last step holds fewer than a full step: it gets no more microbatches per rank
        # than its tokens need, plus one for packing slack (and the pipeline depth when pp > 1)
        need = -(-int(tokens[-1]) // (lay.dp * lay.capacity))
        assert tokens[-1] < lay.dp * lay.microbatches * lay.capacity
        assert m <= max(need + 1, min(lay.pp, lay.microbatches)), (lay, m, need)
        assert m < lay.microbatches
        # only the last step is short (one window, tail 'partial')
        assert (plan.step_mbs[:-1] == lay.microbatches).all() or strategy == "sequential"


def test_tail_packing_efficiency_on_wlbllm(wlbllm):
    # issue #13 item 9: 16 DP x 4 microbatches x 128K, 48 steps; the last one held ~2-7
    # capacities spread over 64 microbatches and the epoch's packing efficiency was 0.979
    lengths = np.asarray(wlbllm, dtype=np.int64)
    lay = Layout(dp=16, microbatches=4, capacity=K128)
    plan = plan_epoch(SampleTable(lengths), COST, lay, PlannerConfig())
    s = plan_summary(plan, COST, lengths)
    assert s["valid"] and s["packing_efficiency"] > 0.99
    # the epoch as a whole needs no more microbatches than its tokens do (the last step holds
    # what the full steps before it leave: how full it is depends on where the stream ends)
    tokens = int(plan.entry_length.sum())
    fewest = -(-(-(-tokens // lay.capacity)) // lay.dp) * lay.dp
    assert plan.mb_offsets.shape[0] - 1 == fewest


def test_short_steps_run_end_to_end(wlbllm, tmp_path):
    """A plan whose last step has fewer microbatches per rank than the layout: the sampler (two
    DP ranks), the store (save, load, verify), metrics and the report all take it."""
    from balancer.report import build as R
    from balancer.store import plan_store as store
    from balancer.loader.sampler import PackedBatchSampler

    lengths = np.asarray(wlbllm[:6000], dtype=np.int64)
    lay = Layout(dp=2, pp=1, microbatches=8, capacity=32768)
    lengths = np.minimum(lengths, lay.capacity)
    plan = plan_epoch(SampleTable(lengths), COST, lay, PlannerConfig())
    check_valid(plan, lengths)
    assert plan.step_mbs[-1] < lay.microbatches  # the case under test
    # sampler: each rank gets sum(step_mbs) microbatches, step by step, and the short step
    # says how many microbatches it has on this rank (the same on both)
    seen, per_rank = [], []
    for r in range(2):
        smp = PackedBatchSampler(plan=plan, layout=lay, dp_rank=r)
        refs = list(smp)
        assert len(refs) == len(smp) == int(plan.step_mbs.sum())
        steps = [ref.step for ref in refs]
        assert steps == sorted(steps)
        assert all(ref.step_microbatches == int(plan.step_mbs[ref.step]) for ref in refs)
        assert all(len(ref) > 0 for ref in refs)
        last = [ref for ref in refs if ref.step == plan.n_steps - 1]
        assert len(last) == int(plan.step_mbs[-1]) and last[-1].slot == len(last) - 1
        per_rank.append(steps)
        seen.extend(s for ref in refs for s in ref)
    assert per_rank[0] == per_rank[1]
    assert sorted(seen) == list(range(len(lengths)))
    # store round trip, verified (checks step_mbs in 1..microbatches and the rank layout)
    path = store.save_plan(plan, tmp_path / "plan", cost=COST)
    back, _ = store.load_plan(path, 0, verify=True)
    assert np.array_equal(back.step_mbs, plan.step_mbs)
    assert back.fingerprint() == plan.fingerprint()
    smp = PackedBatchSampler(plan=back, layout=lay, dp_rank=1)
    assert [list(r) for r in smp] == [list(r) for r in
                                      PackedBatchSampler(plan=plan, layout=lay, dp_rank=1)]
    # metrics and report
    s = plan_summary(back, COST, lengths)
    assert s["valid"] and s["steps"] == plan.n_steps
    rep, details = R.build_report(lengths, COST, lay, PlannerConfig(), ["balanced"],
                                  plans={"stored": back})
    assert rep["strategies"]["stored"]["valid"]
    assert rep["strategies"]["balanced"]["valid"]
    assert rep["strategies"]["stored"]["steps"] == plan.n_steps
    R.write_report(rep, details, tmp_path / "rep", lengths, COST, plots=False)
    assert "INVALID" not in R.format_summary(rep)


def test_plan_names_its_short_steps():
    # the per-step microbatch counts are part of the Plan (step_mbs) and of every ref
    doc = plan_epoch.__module__
    import balancer.planning.planner as P
    assert re.search(r"step_mbs", P.Plan.__doc__) and "fewer" in P.Plan.__doc__, doc


def test_sequential_keeps_arrival_order_under_a_budget(wlbllm):
    # sequential honours the budget by cutting its next-fit runs (never reordering): every
    # step but the tail is the next stretch of the epoch order, in order, rank after rank
    from balancer.planning.planner import epoch_order
    lengths = _wlb(wlbllm, 5000)
    lay = Layout(dp=4, microbatches=4, capacity=K128)
    for budget in (64 * 1024, 300 * 1024, None):
        cfg = PlannerConfig(strategy="sequential", global_batch_tokens=budget, seed=3)
        plan = plan_epoch(SampleTable(lengths), COST, lay, cfg)
        check_valid(plan, lengths)
        cut = int(plan.mb_offsets[plan.step_offsets[-2]])  # entries before the last step
        assert np.array_equal(plan.entry_sample[:cut], epoch_order(len(lengths), 3, 0)[:cut])
    # the default budget keeps the plain next fit: runs of dp x m bins of one next fit
    from packing.binpack import next_fit
    order = epoch_order(len(lengths), 3, 0)
    bin_of, _ = next_fit(lengths[order], lay.capacity)
    full = plan.step_offsets[-2]
    assert np.array_equal(np.diff(plan.mb_offsets)[:full], np.bincount(bin_of)[:full])
