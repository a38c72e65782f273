"""The compiled ``balanced`` planner equals its plain-numpy reference step for step."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from packing.stream import plan_balanced
from tests.naive import balanced as naive_balanced


@st.composite
def stream(draw):
    n = draw(st.integers(1, 600))
    cap = draw(st.sampled_from([256, 1000, 4096]))
    heavy = draw(st.floats(0, 0.2))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    top = draw(st.sampled_from([cap // 4, cap]))
    sizes = np.where(rng.random(n) < heavy, rng.integers(cap // 8, top + 1, n),
                     rng.integers(1, max(2, cap // 16), n)).astype(np.int64)
    dp = draw(st.integers(1, 4))
    m = draw(st.integers(1, 4))
    if n < dp:
        dp = 1
    return sizes, dp, m, cap


@given(stream(), st.integers(1, 5), st.booleans(), st.booleans(),
       st.sampled_from([0.005, 0.02, 0.1]), st.booleans(), st.integers(0, 3),
       st.sampled_from([1, 1, 2, 4]))
def test_kernel_equals_reference(p, max_delay, rank_units, lookahead, lump_tol, by_count, adv,
                                 pp):
    sizes, dp, m, cap = p
    costs = sizes + sizes.astype(float) ** 2 / 4096
    if by_count:
        weights, budget = np.ones_like(sizes), 3 * dp * m
    else:
        weights, budget = None, dp * m * cap
    kw = dict(weights=weights, rank_units=rank_units, lump_tol=lump_tol, lookahead=lookahead,
              max_advance=adv if lookahead else 0, tail="carry", pp=pp)
    a = plan_balanced(sizes, costs, dp, m, cap, budget, max_delay, **kw)
    b = naive_balanced.plan_balanced(sizes, costs, dp, m, cap, budget, max_delay, **kw)
    for f in a._fields:
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    if sizes.max() <= cap // 4:
        # items a quarter of a microbatch or smaller can always be placed by their deadline
        assert a.entry_delay.max(initial=0) <= max_delay


def test_kernel_equals_reference_on_real_lengths(wlbllm):
    sizes = wlbllm[:20000]
    costs = 3 * (sizes + sizes.astype(float) ** 2 / 65536)
    for dp, m, ru, adv, pp in [(1, 4, False, 4, 4), (4, 2, False, 0, 1), (4, 2, True, 4, 2)]:
        a = plan_balanced(sizes, costs, dp, m, 131072, dp * m * 131072, 4, rank_units=ru,
                          max_advance=adv, pp=pp)
        b = naive_balanced.plan_balanced(sizes, costs, dp, m, 131072, dp * m * 131072, 4,
                                         rank_units=ru, max_advance=adv, pp=pp)
        for f in a._fields:
            assert np.array_equal(getattr(a, f), getattr(b, f)), (dp, m, ru, f)


@given(st.integers(1, 60), st.integers(1, 6), st.integers(1, 8), st.integers(0, 2**16))
def test_outlier_scheduler_matches_reference(k, horizon, units, seed):
    from packing.delay import schedule_lumps
    from tests.naive import core as naive
    rng = np.random.default_rng(seed)
    exc = np.round(rng.random(k) * 100, 1)  # ties on purpose
    size = rng.integers(1, 50, k)
    lo = rng.integers(0, horizon, k)
    hi = np.minimum(lo + rng.integers(0, horizon, k), horizon - 1)
    cap = int(rng.choice([50, 120, 1000]))
    tc = float(rng.choice([10.0, 100.0, 1000.0]))
    got = schedule_lumps(exc, size, lo, hi, horizon, units, cap, tc)
    ref = naive.schedule_lumps(exc, size, lo, hi, horizon, units, cap, tc)
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("seed", range(4))
def test_outlier_scheduler_with_far_more_lumps_than_room_matches_reference(seed):
    # The look-ahead can show far more lumps than the horizon holds (tiny light documents beside
    # heavy ones); the scheduler stops once no step has room for the smallest lump left and
    # lists each step's partner lumps only as far as it reads them: the same schedule.
    from packing.delay import schedule_lumps
    from tests.naive import core as naive
    rng = np.random.default_rng(seed)
    k = 400
    exc = np.round(rng.random(k) * 100, 1)
    size = rng.integers(30, 61, k)
    lo = rng.integers(0, 3, k)
    hi = np.minimum(lo + rng.integers(0, 5, k), 4)
    got = schedule_lumps(exc, size, lo, hi, 5, 4, 100, 100.0)
    ref = naive.schedule_lumps(exc, size, lo, hi, 5, 4, 100, 100.0)
    assert np.array_equal(got, ref)
    assert (got == -1).sum() > k // 2  # most lumps found no room


@pytest.mark.parametrize("seed", range(4))
def test_outlier_scheduler_skips_full_steps_by_their_largest_room(seed):
    # Long lumps, one a unit, fill every step; light small lumps placed last still fit the
    # rooms left, so the scheduler does not stop early and the long lumps left over skip the
    # full steps by the largest room kept for each (no scan of its units): the same schedule.
    from packing.delay import schedule_lumps
    from tests.naive import core as naive
    rng = np.random.default_rng(seed)
    k_long, k_small = 120, 40
    exc = np.concatenate([50 + np.round(rng.random(k_long) * 50, 1),
                          np.round(rng.random(k_small) * 5, 1)])
    size = np.concatenate([rng.integers(55, 101, k_long), rng.integers(1, 20, k_small)])
    k = k_long + k_small
    lo = rng.integers(0, 5, k)
    hi = np.minimum(lo + rng.integers(0, 5, k), 4)
    got = schedule_lumps(exc, size, lo, hi, 5, 8, 100, 100.0)
    ref = naive.schedule_lumps(exc, size, lo, hi, 5, 8, 100, 100.0)
    assert np.array_equal(got, ref)
    assert (got[:k_long] == -1).sum() > k_long // 2  # most long lumps found every step full
    assert (got[k_long:] >= 0).any()  # while small ones still found room


def test_overdue_lump_holds_room_in_the_schedule():
    # Regression (found by hypothesis): a lump that found no room by its deadline is emitted
    # now, so the outlier scheduler must count it in step 0; the reference once left it out of
    # the schedule and scheduled a fresh lump into the room the overdue one takes.
    sizes = np.array([4, 242, 102, 14, 100, 2, 10, 13, 221, 232, 183, 12, 13, 173, 197, 170, 15,
                      8], dtype=np.int64)
    costs = sizes + sizes.astype(float) ** 2 / 4096
    kw = dict(lump_tol=0.005, lookahead=False, tail="carry")
    a = plan_balanced(sizes, costs, 1, 1, 256, 256, 1, **kw)
    b = naive_balanced.plan_balanced(sizes, costs, 1, 1, 256, 256, 1, **kw)
    assert a.entry_delay.max() > 1  # the case does hold an overdue lump
    for f in a._fields:
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert np.array_equal(np.sort(a.entry_item), np.arange(sizes.shape[0]))


def _one_batch(wlbllm, seed):
    rng = np.random.default_rng(seed)
    sizes = rng.choice(wlbllm, 2048).astype(np.int64)
    cap = 131072
    m = int(-(-sizes.sum() // (64 * cap)))  # enough microbatches to hold them
    costs = 3 * (sizes + sizes.astype(float) ** 2 / 65536)
    return sizes, costs, cap, m


def test_one_global_batch_planned_alone_stays_one_step(wlbllm):
    # Regression (issue #13 item 10): once the intake has read the whole stream, the look-ahead
    # lumps scheduled for reading ahead were already in the pool and were counted a second
    # time, so the step looked overfull and the give-back moved samples into a second step.
    for seed in range(8):
        sizes, costs, cap, m = _one_batch(wlbllm, seed)
        for adv in (12, 0):
            kw = dict(max_advance=adv, tail="partial", pp=1)
            a = plan_balanced(sizes, costs, 64, m, cap, 64 * m * cap, 4, **kw)
            assert a.step_mbs.shape[0] == 1, (seed, adv, a.step_mbs)
            assert np.array_equal(np.sort(a.entry_item), np.arange(2048))
            b = naive_balanced.plan_balanced(sizes, costs, 64, m, cap, 64 * m * cap, 4, **kw)
            for f in a._fields:
                assert np.array_equal(getattr(a, f), getattr(b, f)), (seed, f)


@given(stream(), st.integers(1, 4), st.booleans(), st.integers(0, 3),
       st.sampled_from(["tokens-min", "tokens-small", "tokens-half", "samples-min"]),
       st.sampled_from(["partial", "carry"]), st.sampled_from([1, 2]))
def test_kernel_equals_reference_under_small_budgets(p, max_delay, rank_units, adv, budget_kind,
                                                     tail, pp):
    # Regression (issue #13 item 1): a budget below dp x microbatches x capacity left steps with
    # fewer candidates than microbatches (empty microbatches, or a bare AssertionError); every
    # step now reads on until each microbatch has an item, and the reference does the same
    sizes, dp, m, cap = p
    costs = sizes + sizes.astype(float) ** 2 / 4096
    weights = None
    budget = {"tokens-min": dp * m, "tokens-small": dp * m * max(1, cap // 64),
              "tokens-half": dp * m * cap // 2, "samples-min": dp * m}[budget_kind]
    if budget_kind.startswith("samples"):
        weights = np.ones_like(sizes)
    kw = dict(weights=weights, rank_units=rank_units, max_advance=adv, tail=tail, pp=pp)
    try:
        a = plan_balanced(sizes, costs, dp, m, cap, budget, max_delay, **kw)
    except ValueError as e:  # a genuinely infeasible tail, refused by name
        assert "tail='carry'" in str(e) and tail == "partial"
        return
    b = naive_balanced.plan_balanced(sizes, costs, dp, m, cap, budget, max_delay, **kw)
    for f in a._fields:
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert (np.diff(a.mb_offsets) > 0).all()
    assert np.array_equal(np.sort(np.concatenate([a.entry_item, a.leftover])),
                          np.arange(sizes.shape[0]))
    full = a.step_mbs == m
    per_step = np.diff(a.mb_offsets[np.concatenate([[0], np.cumsum(a.step_mbs * dp)])])
    assert (per_step >= a.step_mbs * dp).all()
    assert full.sum() >= a.step_mbs.shape[0] - 2 or tail == "carry"


def _step_measures(costs, items, counts, dp, m, rank_units):
    """Slowest rank sum and (microbatch units) the lockstep time: the sum over microbatch
    positions of the slowest rank there."""
    c = np.add.reduceat(costs[items], np.concatenate([[0], np.cumsum(counts)[:-1]]))
    c = c.reshape(dp, m)
    return [c.sum(1).max()] + ([] if rank_units else [c.max(0).sum()])


def _rl_batch(seed, n):
    rng = np.random.default_rng(seed)
    return (rng.integers(64, 1025, n)
            + np.clip(rng.lognormal(np.log(1200), 0.9, n), 16, 15360)).astype(np.int64)


def test_short_last_step_never_costs_balance():
    # Regression (issue 27 item 5): a global batch planned alone is the epoch's last step, and
    # the tail gave it only the microbatches it needs (2 of 3 here, 99% full), where the step
    # was slower than with the 3 requested: a step packed to the brim leaves no room to balance
    # cost. Fewer microbatches only where that is no worse by any measure.
    from packing.step_assembly import _pack_exact
    dp, m = 64, 3
    for seed in range(3):
        sizes = _rl_batch(seed, 2048)
        cap = int(sizes.sum() / (dp * 1.98)) + 1
        costs = 3 * (sizes + sizes.astype(float) ** 2 / 65536)
        for ru in (True, False):
            a = plan_balanced(sizes, costs, dp, m, cap, dp * m * cap, 4, rank_units=ru,
                              max_advance=12, tail="partial")
            assert a.step_mbs.shape[0] == 1
            mm = int(a.step_mbs[0])
            got = _step_measures(costs, a.entry_item, np.diff(a.mb_offsets), dp, mm, ru)
            order = np.lexsort((-costs, np.zeros_like(sizes)))
            out, counts, _, rest = _pack_exact(order, sizes, costs, dp, m, cap, ru, True)
            assert rest.shape[0] == 0
            want = _step_measures(costs, out, counts, dp, m, ru)
            assert all(g <= w * (1 + 1e-9) for g, w in zip(got, want)), (seed, ru, mm, got, want)


@given(stream(), st.booleans(), st.sampled_from([1, 1, 2]), st.integers(0, 3))
def test_tail_with_fewer_microbatches_equals_reference(p, rank_units, pp, adv):
    # the epoch's last step has fewer microbatches than requested only where it is no slower
    # (reference: tests.naive.steps.pack_fewest), step for step as the reference plans it
    sizes, dp, m, cap = p
    costs = sizes + sizes.astype(float) ** 2 / 4096
    kw = dict(rank_units=rank_units, max_advance=adv, tail="carry", pp=pp)
    a = plan_balanced(sizes, costs, dp, m, cap, dp * m * cap, 4, **kw)
    b = naive_balanced.plan_balanced(sizes, costs, dp, m, cap, dp * m * cap, 4, **kw)
    for f in a._fields:
        assert np.array_equal(getattr(a, f), getattr(b, f)), f


@pytest.mark.parametrize("scale", [65536.0, 4096.0])
@pytest.mark.parametrize("rank_units", [True, False])
def test_long_items_faster_than_microbatches_equal_reference(rank_units, scale):
    # half the items 0.6-1.0 of a microbatch: the intake stops once the pool holds one for every
    # microbatch (and the top-up at two steps' worth); kernel and reference alike, every delay
    # within the bound (before: the queue of long items grew without bound)
    r = np.random.default_rng(11)
    n, cap, dp, m = 3000, 4096, 4, 2
    sizes = np.where(r.random(n) < 0.5, r.integers(int(0.6 * cap), cap + 1, n),
                     r.integers(1, cap // 10 + 1, n)).astype(np.int64)
    costs = sizes + sizes.astype(float) ** 2 / (scale / 16)
    for adv in (0, 12):
        kw = dict(rank_units=rank_units, max_advance=adv)
        a = plan_balanced(sizes, costs, dp, m, cap, dp * m * cap, 4, **kw)
        b = naive_balanced.plan_balanced(sizes, costs, dp, m, cap, dp * m * cap, 4, **kw)
        for f in a._fields:
            assert np.array_equal(getattr(a, f), getattr(b, f)), (adv, f)
        assert a.entry_delay.max() <= 4, adv
        assert np.array_equal(np.sort(a.entry_item), np.arange(n))


def test_feasible_tail_is_planned_not_refused():
    # Regression (issue 26 item 3): the last items of a stream go alone (no two share a
    # microbatch) and are fewer than the ranks; re-planning the steps before with them only
    # ping-ponged until the guard ("1 items cannot be spread over 2 DP ranks"), though an
    # emitted microbatch had room for the item. It now goes there (or, without room anywhere,
    # the cheapest item of a microbatch of two or more joins it in a final step).
    sizes = np.array([31, 12, 10, 10, 7, 12, 3, 13, 55, 64, 38, 22, 61, 6, 1, 55, 14, 26, 2, 1,
                      60, 1, 26, 35, 46, 44, 37, 38, 33])
    costs = sizes + sizes.astype(float) ** 2 / 4096
    dp, m, cap = 2, 1, 64
    for ru in (True, False):
        kw = dict(rank_units=ru, max_advance=6, tail="partial")
        a = plan_balanced(sizes, costs, dp, m, cap, dp * m * cap, 4, **kw)
        b = naive_balanced.plan_balanced(sizes, costs, dp, m, cap, dp * m * cap, 4, **kw)
        for f in a._fields:
            assert np.array_equal(getattr(a, f), getattr(b, f)), f
        assert np.array_equal(np.sort(a.entry_item), np.arange(sizes.shape[0]))
        assert a.leftover.shape[0] == 0
        assert (np.diff(a.mb_offsets) > 0).all()
        assert np.add.reduceat(sizes[a.entry_item], a.mb_offsets[:-1]).max() <= cap
        assert (a.step_mbs >= 1).all() and (a.step_mbs <= m).all()
        assert a.mb_offsets.shape[0] - 1 == int(a.step_mbs.sum()) * dp


def test_an_infeasible_tail_is_still_refused_by_name():
    # 5 items of which no two share a microbatch of 2048 tokens: every step of 2 ranks holds an
    # even number of microbatches, so no plan exists with tail='partial'
    sizes = np.array([1813, 1813, 600, 1600, 1600])
    costs = sizes.astype(float)
    with pytest.raises(ValueError, match="tail='carry'"):
        plan_balanced(sizes, costs, 2, 2, 2048, 8192, 4, rank_units=True, tail="partial")


@pytest.mark.parametrize("adv", [3, 12])
@pytest.mark.parametrize("scale", [4096, 65536])
def test_token_first_steps_equal_the_reference(adv, scale):
    # Uniform lengths up to the capacity: about half the documents are longer than half a
    # microbatch, LPT on cost leaves holes, and the token-first step (packing.balanced_fill)
    # packs for tokens and fills the holes with light items read ahead of their turn.
    rng = np.random.default_rng(11)
    cap = 4096
    sizes = rng.integers(1, cap + 1, 3000).astype(np.int64)
    costs = 3 * (sizes + sizes.astype(float) ** 2 / scale)
    kw = dict(rank_units=True, max_advance=adv, tail="carry")
    a = plan_balanced(sizes, costs, 4, 2, cap, 4 * 2 * cap, 4, **kw)
    b = naive_balanced.plan_balanced(sizes, costs, 4, 2, cap, 4 * 2 * cap, 4, **kw)
    for f in a._fields:
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    every = np.sort(np.concatenate([a.entry_item, a.leftover]))  # the tail carries the rest
    assert np.array_equal(every, np.arange(sizes.shape[0]))
    assert a.entry_delay.max() <= 4 and a.entry_delay.min() >= -adv
    cpt = naive_balanced.reference_cost_per_token(sizes, costs)
    light = (costs - sizes * cpt) <= 0.02 * 2 * cap * cpt
    assert (a.entry_delay[light[a.entry_item]] < 0).sum() > 50  # light items were read ahead


@pytest.mark.parametrize("dp,pp,lockstep", [(4, 1, False), (4, 1, True), (1, 1, False),
                                             (2, 2, False)])
@pytest.mark.parametrize("scale", [4096, 65536])
def test_token_first_steps_of_microbatch_units_equal_the_reference(dp, pp, lockstep, scale):
    # Microbatch units (pipeline stages, or ranks in lockstep after every microbatch) try the
    # token-first step too, kept only when no less balanced and leaving no more waiting tokens
    # behind (packing.balanced_fill._keep_microbatches).
    rng = np.random.default_rng(13)
    cap = 4096
    sizes = rng.integers(1, cap + 1, 3000).astype(np.int64)
    costs = 3 * (sizes + sizes.astype(float) ** 2 / scale)
    m = 4 if dp > 1 else 8
    kw = dict(rank_units=False, max_advance=12, tail="carry", pp=pp, lockstep=lockstep)
    a = plan_balanced(sizes, costs, dp, m, cap, dp * m * cap, 4, **kw)
    b = naive_balanced.plan_balanced(sizes, costs, dp, m, cap, dp * m * cap, 4, **kw)
    for f in a._fields:
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    every = np.sort(np.concatenate([a.entry_item, a.leftover]))
    assert np.array_equal(every, np.arange(sizes.shape[0]))
    assert a.entry_delay.max() <= 4 and a.entry_delay.min() >= -12
    cpt = naive_balanced.reference_cost_per_token(sizes, costs)
    light = (costs - sizes * cpt) <= 0.02 * cap * cpt
    assert (a.entry_delay[light[a.entry_item]] < 0).sum() > 20  # light items were read ahead


@pytest.mark.parametrize("tail", ["partial", "carry"])
def test_lockstep_steps_are_placed_for_the_least_lockstep_time(tail):
    # Ranks that wait for each other after every microbatch (FSDP, ZeRO-3) take, per step, the
    # sum over positions of the costliest microbatch there. The balanced split over ranks with
    # each rank's microbatches by cost left that 0.02-0.7% above the least any placement gives
    # (the microbatches by cost, dp to a position), which lockstep placement now reaches on
    # every step, the tail's included; the reference places them alike.
    rng = np.random.default_rng(17)
    cap = 4096
    sizes = rng.integers(1, cap + 1, 2500).astype(np.int64)
    costs = 3 * (sizes + sizes.astype(float) ** 2 / 4096)
    dp, m = 4, 3
    kw = dict(rank_units=False, max_advance=12, tail=tail, lockstep=True)
    a = plan_balanced(sizes, costs, dp, m, cap, dp * m * cap, 4, **kw)
    b = naive_balanced.plan_balanced(sizes, costs, dp, m, cap, dp * m * cap, 4, **kw)
    for f in a._fields:
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    mb = np.add.reduceat(costs[a.entry_item], a.mb_offsets[:-1])
    start = 0
    for s_m in a.step_mbs:
        c = mb[start:start + dp * s_m].reshape(dp, s_m)
        start += dp * s_m
        least = np.sort(c.ravel())[::-1][::dp]
        assert np.array_equal(np.sort(c.max(axis=0))[::-1], least)
    with pytest.raises(ValueError, match="lockstep"):
        plan_balanced(sizes, costs, dp, m, cap, dp * m * cap, 4, rank_units=True, lockstep=True)


def test_token_first_steps_leave_huge_capacities_to_lpt():
    # The token-first step's best fit keeps a count tree over rooms 0..capacity; above
    # binpack.BFD_MAX_CAPACITY (4M tokens) that would be gigabytes a step, so those steps keep
    # LPT's packing (found by review: a 2^30-token capacity asked for an 8 GiB tree).
    rng = np.random.default_rng(5)
    cap = 1 << 30
    sizes = rng.integers(1, cap + 1, 120).astype(np.int64)
    costs = 3 * (sizes + sizes.astype(float) ** 2 / cap)
    kw = dict(rank_units=True, max_advance=4, tail="carry")
    a = plan_balanced(sizes, costs, 2, 2, cap, 2 * 2 * cap, 4, **kw)
    b = naive_balanced.plan_balanced(sizes, costs, 2, 2, cap, 2 * 2 * cap, 4, **kw)
    for f in a._fields:
        assert np.array_equal(getattr(a, f), getattr(b, f)), f


def _kernel_and_reference(sizes, costs, dp, m, cap, max_delay, kernel=True, budget=None,
                          **options):
    """The kernel's and the reference's plans of one stream (by default whole-rank units,
    look-ahead 12, a token budget of the whole capacity, tail carried; ``options`` override),
    asserted equal and holding every item exactly once; ``kernel=False``: the reference's only
    (None for the kernel's)."""
    kw = dict(rank_units=True, max_advance=12, tail="carry") | options
    budget = dp * m * cap if budget is None else budget
    b = naive_balanced.plan_balanced(sizes, costs, dp, m, cap, budget, max_delay, **kw)
    if not kernel:
        return None, b
    a = plan_balanced(sizes, costs, dp, m, cap, budget, max_delay, **kw)
    for f in a._fields:
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert np.array_equal(np.sort(np.concatenate([a.entry_item, a.leftover])),
                          np.arange(sizes.shape[0]))
    return a, b


def test_lookahead_lumps_are_cut_by_their_tokens(monkeypatch):
    # Regression: the look-ahead's window is light weight, so where light items are tiny and
    # lumps many it held every lump of the stream, and every step scheduled all of them (plan
    # time quadratic in the stream: 100K samples of this mix at 8 x 4 x 32K took 7.6 s, 50K
    # 1.8 s). The lumps it sees now stop at LOOK_LUMP_STEPS times its steps' capacity of
    # tokens; the kernel and the reference cut alike, and the cut changes this plan.
    rng = np.random.default_rng(3)
    n = 3000
    sizes = np.where(rng.random(n) < 0.55, rng.integers(1, 4, n),
                     rng.integers(520, 1001, n)).astype(np.int64)
    costs = sizes + sizes.astype(float) ** 2 / 256
    a, b = _kernel_and_reference(sizes, costs, 2, 2, 1000, 4)
    assert a.entry_delay.max() <= 4
    monkeypatch.setattr(naive_balanced, "LOOK_LUMP_STEPS", 10 ** 6)
    _, c = _kernel_and_reference(sizes, costs, 2, 2, 1000, 4, kernel=False)
    assert not all(np.array_equal(getattr(b, f), getattr(c, f)) for f in b._fields)


@pytest.mark.parametrize("seed", [0, 1])
def test_short_lumps_beside_tiny_documents_are_read_by_their_tokens(seed):
    # Regression: lumps shorter than half a microbatch were read without bound where the light
    # items beside them are tiny (70% of items 1-19 tokens, the rest 750-1124 at capacity
    # 4096): the intake and the top-up read until the light weight covered the step, which
    # took the stream's every lump, and they waited up to 54 steps (611-654 of 3000 items
    # beyond the delay bound). Now the pool's lumps stop at a step's capacity of tokens (the
    # top-up's at two): none waits more than a step beyond the bound, at most two items do,
    # and the kernel and the reference read alike.
    rng = np.random.default_rng(seed)
    n = 3000
    sizes = np.where(rng.random(n) < 0.7, rng.integers(1, 20, n),
                     rng.integers(750, 1125, n)).astype(np.int64)
    costs = sizes + sizes.astype(float) ** 2 / 512
    a, _ = _kernel_and_reference(sizes, costs, 2, 2, 4096, 4)
    assert a.entry_delay.max() <= 4 + 1
    assert (a.entry_delay > 4).sum() <= 2


@given(st.lists(st.integers(1, 200), min_size=0, max_size=40))
def test_room_structure_is_left_empty_for_the_next_step(rooms):
    # The token-first step's room structure is made once a plan and emptied after each step
    # (making it each step cost O(capacity): 24 MB filled a step at a capacity of 1M tokens);
    # emptied, it equals a fresh one, so the next step's best fit reads no stale room.
    from packing.balanced_fill import _rooms_clear, _rooms_push
    p = 256  # rooms 0..200 fit
    tree = np.zeros(2 * p, dtype=np.int32)
    head = np.full(p, -1, dtype=np.int64)
    nxt = np.empty(max(len(rooms), 1), dtype=np.int64)
    for b, r in enumerate(rooms):
        _rooms_push(tree, head, nxt, np.int64(p), np.int64(b), np.int64(r))
    assert tree[1] == len(rooms)
    _rooms_clear(tree, head, np.int64(p))
    assert not tree.any()
    assert (head == -1).all()


def test_lookahead_cut_counts_lumps_from_the_stream_position():
    # Regression (found by a randomised comparison with the reference): the look-ahead's cut
    # counts the lumps' tokens from the stream's position on. Where the intake had read past
    # the look-ahead's end, the look-ahead went on from there with its base still at a lump
    # the intake had read, so it stopped ~3 lumps short of the reference's cut (step 64 of this
    # stream pulled another lump than the reference).
    rng = np.random.default_rng(256)
    n = int(rng.integers(500, 2500))
    sizes = np.where(rng.random(n) < 0.55, rng.integers(1, 4, n),
                     rng.integers(300, 1001, n)).astype(np.int64)
    costs = sizes + sizes.astype(float) ** 2 / 2048
    _kernel_and_reference(sizes, costs, 4, 1, 1000, 1, budget=2000, max_advance=3)


@pytest.mark.parametrize("rank_units", [True, False])
def test_no_lookahead_reads_nothing_ahead_in_kernel_and_reference(rank_units):
    # Regression (randomised comparison): without the look-ahead nothing is read ahead of its
    # turn (packing.stream.plan_balanced passes max_advance 0 to the kernel), but the reference
    # still read light documents ahead for the token-first step when given max_advance > 0.
    # The runtime planner plans with lookahead off and the default max_advance (3 x max_delay).
    rng = np.random.default_rng(7)
    n = 1500
    sizes = rng.integers(1, 1001, n).astype(np.int64)
    costs = sizes + sizes.astype(float) ** 2 / 256
    a, _ = _kernel_and_reference(sizes, costs, 2, 2, 1000, 2, rank_units=rank_units,
                                 lookahead=False)
    assert (a.entry_delay >= 0).all()  # nothing read early
