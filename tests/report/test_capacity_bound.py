"""The capacity-aware per-step lower bound (metrics.step_capacity_bound): never above the best
assignment of a step's documents to token-capped ranks (brute force on small steps), never below
the simple bound, and above it where token-full ranks force it; no real plan beats it."""
import itertools

import numpy as np
import pytest

from balancer import workloads
from balancer.config import Layout, PlannerConfig
from balancer.cost.model import CostModel
from balancer.planning.planner import plan_epoch
from balancer.report.metrics import (capacity_lower_bound_ratio, step_capacity_bound,
                                     step_metrics)
from balancer.samples import SampleTable


def _best(L, c, dp, rank_tokens):
    """Least max rank cost over every assignment of the documents to dp ranks of
    rank_tokens tokens (inf when none fits)."""
    best = np.inf
    for a in itertools.product(range(dp), repeat=len(L)):
        a = np.array(a)
        tok = np.bincount(a, weights=L, minlength=dp)
        if (tok <= rank_tokens).all():
            best = min(best, np.bincount(a, weights=c, minlength=dp).max())
    return best


@pytest.mark.parametrize("seed", range(60))
def test_the_bound_is_never_above_the_best_assignment(seed):
    rng = np.random.default_rng(seed)
    dp = int(rng.integers(2, 4))
    n = int(rng.integers(dp + 1, 8))
    cap = int(rng.integers(8, 40))
    L = rng.integers(1, cap + 1, n)
    # a step that (nearly) fills its ranks, the case the bound is for
    rank_tokens = max(int(L.max()), int(np.ceil(L.sum() / dp)) + int(rng.integers(0, 3)))
    c = L + L.astype(float) ** 2 / float(rng.choice([4, 16, 64]))
    opt = _best(L, c, dp, rank_tokens)
    if not np.isfinite(opt):
        pytest.skip("no assignment fits")
    lb = step_capacity_bound(L, c, dp, rank_tokens)
    assert max(c.sum() / dp, c.max()) <= lb * (1 + 1e-12)
    assert lb <= opt * (1 + 1e-12)
    assert step_capacity_bound(L, c, dp, rank_tokens, 5.0) == pytest.approx(lb + 5.0)


def test_token_full_ranks_raise_the_bound():
    # two ranks of 10 tokens, documents 6, 4, 5, 5: the rank holding the 6 must hold 4 more
    # tokens and the 5s cannot go with it, so the best split is {6, 4} / {5, 5} at cost
    # 36 + 16 = 52 (cost L^2) while total / dp = 51
    L = np.array([6, 4, 5, 5])
    c = L.astype(float) ** 2
    assert step_capacity_bound(L, c, 2, 10) == pytest.approx(52.0)
    assert _best(L, c, 2, 10) == pytest.approx(52.0)
    assert step_capacity_bound(L, c, 2, 100) == pytest.approx(51.0)   # ranks not token-full


def test_more_documents_than_ranks_raise_the_bound():
    # five equal documents on two ranks: one rank holds three of them, 30, where total / dp is
    # 25 and a pair 20 (the pigeonhole bound: of the k * dp + 1 costliest documents a rank
    # holds k + 1, so it costs at least the k + 1 cheapest of them)
    L = np.ones(5, dtype=np.int64)
    c = np.full(5, 10.0)
    assert _best(L, c, 2, 100) == pytest.approx(30.0)
    assert step_capacity_bound(L, c, 2, 100) == pytest.approx(30.0)
    # seven documents on three ranks, costs 9 8 7 6 5 4 3: some rank holds three of the top
    # seven, at least 5 + 4 + 3 = 12 (total / dp = 14 binds here); with 2 ranks, three of the
    # top five: 7 + 6 + 5 = 18 < total / dp = 21; on 4 ranks 1 + 1 + 1 of 9 equal ones: 3
    c = np.array([9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0])
    assert step_capacity_bound(np.ones(7, dtype=np.int64), c, 3, 100) == pytest.approx(14.0)
    assert step_capacity_bound(np.ones(7, dtype=np.int64), c, 2, 100) == pytest.approx(21.0)
    assert step_capacity_bound(np.ones(9, dtype=np.int64), np.ones(9), 4, 100) == pytest.approx(3.0)


def test_no_plan_beats_the_bound():
    L = workloads.load("pareto", n=20_000, seed=3)
    cost = CostModel.quadratic(4096)
    for balance in ("rank", "microbatch"):
        plan = plan_epoch(SampleTable(L), cost, Layout(dp=4, microbatches=3, capacity=65536),
                          PlannerConfig(over_length="chunk", balance=balance))
        tight = capacity_lower_bound_ratio(plan, cost)
        simple = step_metrics(plan, cost)["lower_bound_ratio"]
        assert tight.shape == simple.shape
        assert (tight >= 1 - 1e-9).all() and (tight <= simple * (1 + 1e-12)).all()
