"""The tight no-cut lower bound of hybrid DP x CP plans (issue #15): each document charged its
least area (group size x per-rank time, forced exposed exchange included) on any group it fits.
It must hold for every planner's plan (hybrid, fixed CP without cuts, Megatron's rule), never
be below the old bound, and equal a slow per-document recomputation."""
import numpy as np
from hypothesis import given, settings, strategies as st

from balancer.cost.model import CostModel, ModelSpec
from balancer.cost.cp import CPCostModel, CPHardware
from balancer.planning.hybrid import (doc_bounds, estimate, plan_fixed_cp, plan_hybrid,
                                      plan_megatron_hybrid, tight_lower_bound)

SPEC = ModelSpec(hidden=256, layers=4, heads=4, kv_heads=2, ffn=688, vocab=1000)


def tiny_model(cap, overlap):
    cost = CostModel.from_model(SPEC, name="tiny", flops_per_second=1e12)
    return CPCostModel(cost=cost, spec=SPEC, rank_capacity=cap,
                       hardware=CPHardware(overlap=overlap, inter_node_bandwidth=1e9,
                                           intra_node_bandwidth=4e9, gpus_per_node=2))


def slow_bound(model, lengths, P):
    """One document at a time, one group size at a time (no vectorised table)."""
    cap = model.rank_capacity
    area_sum, fastest = 0.0, 0.0
    for L in lengths.tolist():
        best_a, best_t = np.inf, np.inf
        g = 1
        while g <= P:
            row = model.table(np.array([L]), P)
            k = g.bit_length() - 1
            if row.tokens[0, k] <= cap:
                best_a = min(best_a, g * row.time[0, k])
                best_t = min(best_t, row.time[0, k])
            g *= 2
        area_sum += best_a
        fastest = max(fastest, best_t)
    return max(area_sum / P, fastest)


@st.composite
def batch(draw):
    P = draw(st.sampled_from([1, 2, 4, 8]))
    cap = draw(st.sampled_from([64, 256]))
    n = draw(st.integers(1, 40))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 16)))
    limit = cap if P == 1 else P * cap
    long = rng.random(n) < draw(st.floats(0, 0.4))
    lengths = np.where(long, rng.integers(1, limit + 1, n),
                       rng.integers(1, max(2, cap // 4), n)).astype(np.int64)
    return lengths, P, cap, draw(st.sampled_from([1.0, 0.5, 0.0]))


@settings(max_examples=40, deadline=None)
@given(batch())
def test_every_plan_is_above_the_tight_bound(b):
    lengths, P, cap, overlap = b
    m = tiny_model(cap, overlap)
    plans = [plan_hybrid(lengths, m, P), plan_megatron_hybrid(lengths, P, cap)]
    no_cut = next(c for c in (1, 2, 4, 8) if c <= P and m.doc_limit(c) >= lengths.max())
    plans.append(plan_fixed_cp(lengths, m, P, no_cut))
    ref = slow_bound(m, lengths, P)
    for plan in plans:
        e = estimate(plan, m, lengths)
        assert e.documents_cut == 0
        assert np.isclose(e.tight_lower_bound, ref, rtol=1e-9, atol=0)
        assert (e.step_tight_bounds >= e.step_lower_bounds * (1 - 1e-12)).all()
        assert (e.step_times >= e.step_tight_bounds * (1 - 1e-9)).all(), (
            e.step_times, e.step_tight_bounds)


def test_forced_exposure_raises_the_bound():
    # a document of 3 ranks' worth must run on >= 4 ranks and, at overlap 0, pays its exchange
    m = tiny_model(256, 0.0)
    lengths = np.array([700, 10, 10, 10])
    tab = m.table(lengths, 8)
    area, fast = doc_bounds(tab, 8)
    k = 2  # 4 ranks: the smallest group holding 700 tokens at 256 per rank
    assert tab.tokens[0, 1] > 256 >= tab.tokens[0, 2]
    assert area[0] == min(4 * tab.time[0, 2], 8 * tab.time[0, 3])
    assert tab.exposed[0, k] > 0 and area[0] > tab.work[0]
    assert area[1] == tab.work[1] and fast[1] == tab.time[1].min() <= tab.time[1, 0]
    tb = tight_lower_bound(tab, 8, np.array([0, 0, 1, -1]), 2)
    assert tb[0] == max((area[0] + area[1]) / 8, fast[0])
    assert tb[1] == max(area[2] / 8, fast[2])
