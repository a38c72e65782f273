"""No global batch of at most one round of the pool's tokens is planned slower than Megatron-LM's
rule would plan it: ``plan_hybrid`` keeps Megatron's plan where it is estimated faster and
runnable here (aligned groups, no rank over its tokens), counts it in ``megatron_steps``, and
changes nothing elsewhere."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from balancer.cost.cp import CPCostModel
from balancer.planning.hybrid import (estimate, plan_hybrid, plan_hybrid_stream,
                                      plan_megatron_hybrid, plan_strategy)
from balancer.strategies.hybrid import step_time
from packing.hybrid_cp import check_plan, rank_tokens, runnable

#: a batch (found by search) on which the hybrid planner alone is slower than Megatron's rule
#: and Megatron's plan is runnable: 8 ranks, rank capacity 4096, llama-7b
KNOWN = np.array([27576, 1130, 164], dtype=np.int64)


def _model():
    return CPCostModel.from_preset("llama-7b", 4096)


def _docs(draw_seed, n, P, model):
    rng = np.random.default_rng(draw_seed)
    limit = model.doc_limit(1 << (P.bit_length() - 1))
    long = rng.random(n) < 0.3
    return np.where(long, rng.integers(2048, limit + 1, n),
                    rng.integers(16, 2048, n)).astype(np.int64)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2 ** 16), st.integers(1, 12), st.sampled_from([2, 4, 8, 16]))
def test_never_slower_than_megatron(seed, n, P):
    model = _model()
    docs = _docs(seed, n, P, model)
    tab = model.table(docs, P)
    plan = plan_hybrid(docs, model, P)
    alone = plan_hybrid(docs, model, P, megatron=False)
    meg = plan_megatron_hybrid(docs, P, model.rank_capacity)
    check_plan(plan, tab.tokens)
    t, t_alone, t_meg = (step_time(p, tab) for p in (plan, alone, meg))
    # the figure is the estimate's, in the same arithmetic
    assert t == estimate(plan, model, docs).step_time
    assert t_meg == estimate(meg, model, docs).step_time
    assert t <= t_alone
    if runnable(meg, tab.tokens) and docs.sum() <= P * model.rank_capacity:
        assert t <= t_meg
    if plan.megatron_steps:
        assert t_meg < t_alone and t == t_meg
    else:
        # nothing changes where Megatron's rule is no faster
        assert all(np.array_equal(a, b) for a, b in zip(plan[:10], alone[:10]))


def test_known_batch_takes_megatron():
    model = _model()
    tab = model.table(KNOWN, 8)
    alone = plan_hybrid(KNOWN, model, 8, megatron=False)
    meg = plan_megatron_hybrid(KNOWN, 8, model.rank_capacity)
    assert runnable(meg, tab.tokens)
    assert step_time(meg, tab) < step_time(alone, tab)
    plan = plan_hybrid(KNOWN, model, 8)
    assert plan.megatron_steps == 1 and alone.megatron_steps == 0
    assert step_time(plan, tab) == step_time(meg, tab)
    check_plan(plan, tab.tokens)
    # counted over a stream: the strategies add up their steps'
    stream, _ = plan_strategy("hybrid", np.tile(KNOWN, 3), model, 8, int(KNOWN.sum()))
    assert stream.megatron_steps == 3


def test_unrunnable_megatron_plan_is_refused():
    # Megatron's groups are consecutive ranks, not always aligned to their size
    model = _model()
    tab = model.table(KNOWN, 8)
    meg = plan_megatron_hybrid(KNOWN, 8, model.rank_capacity)
    assert (meg.group_size > 1).any()
    shifted = meg._replace(group_offset=np.where(meg.group_size > 1, 1, meg.group_offset))
    assert not runnable(shifted, tab.tokens)
    over = meg._replace(rank_capacity=int(rank_tokens(meg, tab.tokens).max()) - 1)
    assert not runnable(over, tab.tokens)


def test_rank_tokens_matches_check_plan():
    model = _model()
    tab = model.table(KNOWN, 8)
    plan = plan_hybrid(KNOWN, model, 8, megatron=False)
    rt = rank_tokens(plan, tab.tokens)
    assert rt.shape == (plan.n_rounds, 8) and rt.sum() > 0
    check_plan(plan._replace(rank_capacity=int(rt.max())), tab.tokens)
    with pytest.raises(AssertionError):
        check_plan(plan._replace(rank_capacity=int(rt.max()) - 1), tab.tokens)


def test_stream_default_counts_megatron_steps():
    model = _model()
    r = plan_hybrid_stream(np.tile(KNOWN, 4), model, 8, int(KNOWN.sum()), max_delay=0,
                           max_advance=0)
    assert r.plan.megatron_steps == 4
