"""The pure planning part of run-time balancing (no process group): hypothesis properties of
:class:`balancer.runtime.StepPlanner` -- every offer exactly once, capacity and equal counts,
the offline planner's plan for the same step contents, the carry bound over many steps -- and
the policies' errors."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from balancer import CostModel, Layout, PlannerConfig, SampleTable, plan_epoch
from balancer.planning.planner import padded_sizes
from balancer.runtime import Offers, StepPlanner, imbalance

COST = CostModel.quadratic(2048)


def offers_strategy(max_dp=6, cap=512, max_n=30):
    @st.composite
    def build(draw):
        dp = draw(st.integers(1, max_dp))
        per, ident = [], 0
        for r in range(dp):
            n = draw(st.integers(0, max_n))
            lengths = draw(st.lists(st.integers(1, cap), min_size=n, max_size=n))
            ages = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
            per.append((np.arange(ident, ident + n), np.array(lengths, np.int64),
                        np.array(ages, np.int64)))
            ident += n
        return dp, per
    return build()


@given(offers_strategy(max_n=8))
@settings(max_examples=60, deadline=None)
def test_offers_canonical_order(case):
    """Offers.from_ranks: carried first (oldest first), then by rank, then by position -- the
    lexsort of its definition."""
    _, per = case
    o = Offers.from_ranks(per)
    n = [len(p[0]) for p in per]
    rank = np.repeat(np.arange(len(per)), n)
    index = np.concatenate([np.arange(k) for k in n]) if per else np.zeros(0, np.int64)
    cat = lambda j: np.concatenate([p[j] for p in per]) if per else np.zeros(0, np.int64)  # noqa
    order = np.lexsort((index, rank, -cat(2)))
    for got, want in zip((o.rank, o.index, o.sample_id, o.length, o.age),
                         (rank, index, cat(0), cat(1), cat(2))):
        assert got.dtype == np.int64 and np.array_equal(got, want[order])


def check_partition(plan):
    k = len(plan.offers)
    parts = np.concatenate([plan.entry, plan.carried, plan.unplanned, plan.skipped])
    assert np.array_equal(np.sort(parts), np.arange(k))  # every offer exactly once


def check_shape(plan):
    m = plan.microbatches
    assert plan.mb_offsets.shape[0] == plan.dp * m + 1
    if m:
        assert (np.diff(plan.mb_offsets) > 0).all()  # no empty microbatch
        assert plan.mb_tokens().max() <= plan.layout.capacity
    assert plan.mb_offsets[-1] == plan.entry.shape[0]


def check_transfers(plan):
    """What every rank sends to every other one (the exchange's order) covers each rank's
    entries exactly, in its entry order; ``dest`` agrees."""
    dest = plan.dest()
    for d in range(plan.dp):
        mine = plan.entry[plan.rank_entries(d)] if plan.microbatches else np.zeros(0, np.int64)
        assert (dest[mine] == d).all()
        parts = [plan.transfers(s, d) for s in range(plan.dp)] if plan.microbatches else []
        for s, part in enumerate(parts):
            assert (plan.offers.rank[part] == s).all()
            assert np.array_equal(part, mine[plan.offers.rank[mine] == s])  # entry order
        got = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        assert np.array_equal(np.sort(got), np.sort(mine))
    assert (dest >= 0).sum() == plan.entry.shape[0]


def check_offline(plan):
    """The step is the first step of plan_epoch over the planned offers, in order."""
    if plan.entry.size == 0:
        return
    ref = plan_epoch(SampleTable(plan.offers.length[plan.stream]), COST, plan.layout, plan.config)
    n0 = plan.dp * int(ref.step_mbs[0])
    assert np.array_equal(plan.stream[ref.entry_sample[:ref.mb_offsets[n0]]], plan.entry)
    assert np.array_equal(ref.mb_offsets[:n0 + 1], plan.mb_offsets)
    assert np.allclose(ref.mb_fwd[:n0], plan.mb_fwd) and np.allclose(ref.mb_bwd[:n0], plan.mb_bwd)


@given(offers_strategy(), st.integers(1, 3), st.sampled_from([None, "auto"]), st.booleans(),
       st.sampled_from([1, 2]))
@settings(max_examples=60, deadline=None)
def test_step_plan_properties(case, m, mode, final, cp):
    dp, per = case
    offers = Offers.from_ranks(per)
    lay = Layout(dp=dp, cp=cp, microbatches=m, capacity=512 + 2 * cp)
    planner = StepPlanner(COST, lay, microbatches=mode)
    n = len(offers)
    if n < dp and mode == "auto":
        with pytest.raises(ValueError, match="cannot fill"):
            planner.plan(offers, final=final)
        return
    try:
        plan = planner.plan(offers, final=final)
    except ValueError as e:
        # one step may be infeasible when the ranks get only a sample or two each: every rank
        # must run the same number of non-empty microbatches
        assert mode == "auto" and n < 2 * dp and "cannot be placed in one step" in str(e), e
        return
    check_partition(plan)
    check_shape(plan)
    check_transfers(plan)
    assert plan.fingerprint() == planner.plan(offers, final=final).fingerprint()
    if mode == "auto":
        assert plan.carried.size == 0 and plan.unplanned.size == 0  # the whole step, now
        assert plan.stats["trained"] == n
    if plan.unplanned.size:
        assert final and n < dp
    if plan.stats["pinned"] == 0:
        assert np.array_equal(plan.stream, np.arange(n))
    check_offline(plan)
    # canonical order: carried first (oldest first), then rank, then position
    o = plan.offers
    assert (np.diff(-o.age) >= 0).all()
    if n:
        r = imbalance(plan, COST)
        assert r["max_over_bound"] >= 1 - 1e-9 if plan.entry.size else True


@given(st.integers(1, 8), st.integers(1, 4), st.integers(64, 4096), st.data())
@settings(max_examples=60, deadline=None)
def test_one_batch_that_fits_stays_in_one_step(dp, m, cap, data):
    """Default config, fixed microbatches: a batch whose documents are at most half a
    microbatch and whose tokens are at most half the step is planned in one step, nothing
    carried (the fix of f344a39: one global batch planned alone was split into two steps)."""
    budget = dp * m * cap
    n = data.draw(st.integers(dp, max(dp, 200)))
    lengths = np.array(data.draw(st.lists(st.integers(1, cap // 2), min_size=n, max_size=n)))
    while lengths.sum() > budget // 2 and lengths.shape[0] > dp:
        lengths = lengths[:-1]
    if lengths.sum() > budget // 2:
        return
    per = [(np.arange(r, lengths.shape[0], dp), lengths[r::dp]) for r in range(dp)]
    plan = StepPlanner(COST, Layout(dp=dp, microbatches=m, capacity=cap)).plan(
        Offers.from_ranks(per))
    assert plan.carried.size == 0 and plan.stats["trained"] == lengths.shape[0]


@given(st.integers(2, 5), st.integers(0, 2 ** 31), st.integers(1, 3))
@settings(max_examples=25, deadline=None)
def test_many_steps_every_sample_once_and_carry_bounded(dp, seed, max_carry):
    """A stream of steps with carry: every sample trained once or reported, none carried more
    than ``max_carry`` times unless counted in ``carry_bound_exceeded``."""
    rng = np.random.default_rng(seed)
    lay = Layout(dp=dp, microbatches=2, capacity=300)
    planner = StepPlanner(CostModel.quadratic(256), lay, max_carry=max_carry)
    held = [([], [], []) for _ in range(dp)]
    seen, nid, exceeded = [], 0, 0
    for step in range(100):
        final = step >= 9
        if final and not sum(len(h[0]) for h in held):
            break
        per = []
        for r in range(dp):
            ids, lens, ages = (list(x) for x in held[r])
            if not final:
                k = int(rng.integers(0, 8))
                ids += list(range(nid, nid + k))
                lens += rng.integers(1, 300, k).tolist()
                ages += [0] * k
                nid += k
            per.append((np.array(ids, np.int64), np.array(lens, np.int64), np.array(ages, np.int64)))
        plan = planner.plan(Offers.from_ranks(per), final=final)
        check_partition(plan)
        check_shape(plan)
        o = plan.offers
        exceeded += plan.stats["carry_bound_exceeded"]
        if plan.stats["carry_bound_exceeded"] == 0:
            assert (o.age[plan.carried] < max_carry).all()
        seen += o.sample_id[plan.entry].tolist() + o.sample_id[plan.unplanned].tolist()
        held = [(o.sample_id[c], o.length[c], o.age[c] + 1) for c in
                (plan.carried[o.rank[plan.carried] == r] for r in range(dp))]
    assert sum(len(h[0]) for h in held) == 0  # flushed
    assert sorted(seen) == list(range(nid))


def test_over_capacity_sample_is_named():
    per = [(np.array([10, 11]), np.array([5, 7])), (np.array([20]), np.array([900]))]
    lay = Layout(dp=2, microbatches=1, capacity=512)
    with pytest.raises(ValueError, match=r"rank 1 sample 20: length 900 exceeds the microbatch "
                                         r"capacity 512"):
        StepPlanner(COST, lay).plan(Offers.from_ranks(per))
    lay2 = Layout(dp=2, cp=2, microbatches=1, capacity=512)
    per2 = [(np.array([1, 2]), np.array([5, 511]))]
    with pytest.raises(ValueError, match=r"sample 2: length 511 \(padded to 512"):
        StepPlanner(COST, lay2.model_copy(update={"capacity": 510})).plan(Offers.from_ranks(per2))
    plan = StepPlanner(COST, lay, over_length="skip", microbatches="auto").plan(Offers.from_ranks(per))
    assert plan.offers.sample_id[plan.skipped].tolist() == [20]
    assert plan.stats["skipped"] == 1 and plan.stats["trained"] == 2
    with pytest.raises(ValueError, match="length 0 is not positive"):
        StepPlanner(COST, lay).plan(Offers.from_ranks([(np.array([3]), np.array([0]))]))


def test_policies_refuse_by_name():
    lay = Layout(dp=3, microbatches=1, capacity=100)
    few = Offers.from_ranks([(np.array([1]), np.array([5])), (np.array([2]), np.array([5]))])
    with pytest.raises(ValueError, match="2 sample\\(s\\) cannot fill 3 DP ranks"):
        StepPlanner(COST, lay, microbatches="auto").plan(few)
    # carried (not final) or unplanned (final) when fewer samples than ranks
    assert StepPlanner(COST, lay).plan(few).carried.size == 2
    assert StepPlanner(COST, lay).plan(few, final=True).unplanned.size == 2
    many = Offers.from_ranks([(np.arange(10), np.full(10, 90))] * 3)
    with pytest.raises(ValueError, match="do not fit 3 ranks x 1 microbatches"):
        StepPlanner(COST, lay, carry=False).plan(many)
    with pytest.raises(ValueError, match="over_length='chunk' is not supported"):
        StepPlanner(COST, lay, PlannerConfig(over_length="chunk"))
    # infeasible in one step: three documents that each need their own microbatch, 2 ranks
    big = Offers.from_ranks([(np.array([1, 2]), np.array([90, 90])), (np.array([3]), np.array([90]))])
    with pytest.raises(ValueError, match="cannot be placed in one step of 2 ranks"):
        StepPlanner(COST, Layout(dp=2, microbatches=1, capacity=100), microbatches="auto").plan(big)


def test_auto_grows_microbatches_until_everything_fits():
    rng = np.random.default_rng(3)
    per = [(np.arange(r * 100, r * 100 + 50), rng.integers(1, 1000, 50)) for r in range(4)]
    plan = StepPlanner(COST, Layout(dp=4, microbatches=1, capacity=1024),
                       microbatches="auto").plan(Offers.from_ranks(per))
    total = int(padded_sizes(plan.offers.length, 1).sum())
    assert plan.microbatches >= -(-total // (4 * 1024))
    assert plan.stats["trained"] == 200 and plan.mb_tokens().max() <= 1024
    check_offline(plan)
    r = imbalance(plan, COST)
    assert 1 <= r["max_over_bound"] < 1.05



def _flush(dp, seed, high):
    """Final steps offering back what the last one carried, from ``n`` samples on rank 0
    (lengths 1..high-1, capacity 256, 2 microbatches per rank): the ids trained, in order of
    steps, and the ids left unplanned."""
    g = np.random.default_rng(seed)
    planner = StepPlanner(CostModel.quadratic(1024), Layout(dp=dp, microbatches=2, capacity=256))
    n = int(g.integers(dp, 40))
    ids, lens, ages = np.arange(n), g.integers(1, high, n), np.zeros(n, np.int64)
    seen, unplanned, none = [], [], np.zeros(0, np.int64)
    for _ in range(60):
        if not len(ids):
            break
        plan = planner.plan(Offers.from_ranks([(ids, lens, ages)] + [(none, none)] * (dp - 1)),
                            final=True)
        check_partition(plan)
        check_shape(plan)
        o, c = plan.offers, plan.carried
        seen += o.sample_id[plan.entry].tolist()
        unplanned += o.sample_id[plan.unplanned].tolist()
        ids, lens, ages = o.sample_id[c], o.length[c], o.age[c] + 1
    assert sorted(seen + unplanned) == list(range(n))
    return seen, unplanned


@pytest.mark.parametrize("dp, seed", [(2, 150), (2, 275), (3, 16), (3, 36), (4, 9), (4, 133)])
def test_final_steps_train_the_whole_tail(dp, seed):
    """At the end of a stream every sample is trained (issue 29 item 3: 510 of 511 trained, one
    'unplanned'): a final step never carries what the steps after it cannot train -- fewer
    samples than DP ranks, or a tail no step of equal microbatch counts can place. Each case
    left 1 or 2 samples unplanned before."""
    _, unplanned = _flush(dp, seed, 220)
    assert unplanned == []


@given(st.integers(2, 4), st.integers(0, 10_000))
@settings(max_examples=100, deadline=None)
def test_final_steps_of_light_samples_train_everything(dp, seed):
    """Samples of at most half the capacity: the flush always ends with nothing unplanned.
    (Heavier tails can be unplaceable at any split: 5 samples of 94..175 tokens on 3 ranks
    under 256 -- those are counted as unplanned, by id.)"""
    _, unplanned = _flush(dp, seed, 129)
    assert unplanned == []


@given(st.integers(2, 4), st.integers(1, 3), st.integers(0, 10_000))
@settings(max_examples=60, deadline=None)
def test_keep_carries_for_the_next_step(dp, keep, seed):
    """``keep``: the next step brings fewer new samples than ranks (a stream whose other ranks
    have ended: only the rows read ahead come), so this one carries at least ``keep`` whenever
    a prefix of its offers can be planned without them (issue 29 item 3: the last row read
    ahead was left alone in a step of its own, untrained)."""
    g = np.random.default_rng(seed)
    n = int(g.integers(dp + keep, 40))
    per = [(np.arange(n), g.integers(1, 129, n))] + [(np.zeros(0, np.int64),) * 2] * (dp - 1)
    planner = StepPlanner(COST, Layout(dp=dp, microbatches=2, capacity=256))
    for final in (False, True):
        plan = planner.plan(Offers.from_ranks(per), final=final, keep=keep)
        check_partition(plan)
        check_shape(plan)
        assert plan.carried.size >= keep and plan.unplanned.size == 0
        check_offline(plan)
