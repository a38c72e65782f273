"""Multimodal planning: coverage of every text token and media item, the post-balancing kernel
against brute force, per-phase metrics against a slow recomputation, the over-capacity policy."""
import itertools

import numpy as np
import pytest
from hypothesis import given, strategies as st

from balancer import Layout, PlannerConfig
from balancer.report.metrics import check_coverage
from balancer.multimodal.cost import load_mm_cost_model
from balancer.multimodal.plan import (MMConfig, check_media_coverage, mm_summary, phase_metrics,
    plan_multimodal)
from balancer.multimodal.workloads import generate
from balancer.multimodal.table import MediaRules, MultimodalTable
from packing.mm_partition import post_balance

COST = load_mm_cost_model("omni-7b")


def random_table(rng, n, rules=COST.rules, max_side=2000):
    n_img = rng.integers(0, 4, n)
    n_vid = (rng.random(n) < 0.2).astype(np.int64)
    n_aud = (rng.random(n) < 0.2).astype(np.int64)
    ki, kv, ka = (int(x.sum()) for x in (n_img, n_vid, n_aud))

    def off(c):
        return np.concatenate([[0], np.cumsum(c)])
    return MultimodalTable.build(
        rng.integers(1, 3000, n), rules,
        images=(off(n_img), rules.vision.image_grids(rng.integers(28, max_side, ki),
                                                     rng.integers(28, max_side, ki))),
        videos=(off(n_vid), rules.vision.video_grids(rng.integers(2, 32, kv),
                                                     np.full(kv, 336), np.full(kv, 448))),
        audios=(off(n_aud), rules.audio.grids(rng.integers(100, 6000, ka))))


@given(st.integers(0, 10_000), st.sampled_from(["home", "joint", "post"]),
       st.sampled_from(["sequential", "balanced", "kk_tokens"]), st.integers(1, 4),
       st.integers(1, 3), st.sampled_from(["partial", "carry"]))
def test_every_token_and_item_exactly_once(seed, mode, strategy, dp, m, tail):
    rng = np.random.default_rng(seed)
    table = random_table(rng, int(rng.integers(dp * m, 300)))
    layout = Layout(dp=dp, microbatches=m, capacity=COST.capacity())
    mp = plan_multimodal(table, COST, layout, PlannerConfig(strategy=strategy, seed=seed, tail=tail),
                         MMConfig(mode=mode, over_capacity="downscale"))
    cov = check_coverage(mp.plan, mp.table.lengths)
    assert cov["samples_lost"] == 0 and cov["samples_duplicated"] == 0
    assert check_media_coverage(mp) == {"media_lost": 0, "media_duplicated": 0}
    # every item sits in the microbatch of its own sample, on that microbatch's rank
    plan = mp.plan
    for j in range(0, mp.media_id.shape[0], 7):
        s = mp.table.media_sample[mp.media_id[j]]
        assert s in plan.microbatch_samples(int(mp.media_mb[j]))
        assert mp.media_mb[j] in plan.microbatch_ids(int(mp.media_step[j]), int(mp.media_home[j]))
    if mode != "post":
        assert np.array_equal(mp.media_rank, mp.media_home)
    assert ((mp.media_rank >= 0) & (mp.media_rank < dp)).all()


def _brute_opt(c, dp):
    best = np.inf
    for a in itertools.product(range(dp), repeat=len(c)):
        best = min(best, np.bincount(a, weights=c, minlength=dp).max())
    return best


@given(st.lists(st.floats(0.1, 100), min_size=1, max_size=7), st.integers(2, 3),
       st.integers(0, 1000))
def test_post_balance_near_optimal(costs, dp, seed):
    c = np.array(costs)
    home = np.random.default_rng(seed).integers(0, dp, c.shape[0])
    rank = post_balance(c, home, np.array([0, c.shape[0]]), dp, slack=0.01)
    loads = np.bincount(rank, weights=c, minlength=dp)
    lb = max(c.sum() / dp, c.max())
    opt = _brute_opt(c, dp)
    assert loads.max() <= max(1.01 * lb, 4 / 3 * opt) + 1e-9


def test_post_balance_keeps_balanced_items_home_and_steps_apart():
    c = np.array([5.0, 5.0, 5.0, 5.0, 9.0, 1.0, 1.0, 1.0])
    home = np.array([0, 1, 0, 1, 0, 0, 0, 0])
    off = np.array([0, 4, 8])
    rank = post_balance(c, home, off, 2)
    assert rank[:4].tolist() == [0, 1, 0, 1]  # already balanced: nothing moves
    loads = np.bincount(rank[4:], weights=c[4:], minlength=2)
    assert sorted(loads.tolist()) == [3.0, 9.0]  # step 2: the lower bound (largest item)
    assert rank[4] == 0  # the big item stays home; the small ones travel
    with pytest.raises(ValueError, match="item 1: home rank 5 is outside 0..1"):
        post_balance(c[:2], np.array([0, 5]), np.array([0, 2]), 2)


def test_phase_metrics_match_slow_recomputation():
    rng = np.random.default_rng(7)
    table = random_table(rng, 400)
    layout = Layout(dp=3, microbatches=2, capacity=COST.capacity())
    mp = plan_multimodal(table, COST, layout, PlannerConfig(), MMConfig(over_capacity="downscale"))
    pm = phase_metrics(mp, COST)
    plan, t = mp.plan, mp.table
    f, b = COST.table_media_costs(t)
    for step in range(plan.n_steps):
        for r in range(3):
            llm = sum(sum(COST.llm.microbatch_cost(plan.entry_length[plan.entries(int(mb))]))
                      for mb in plan.microbatch_ids(step, r))
            assert np.isclose(pm["llm_rank"][step, r], llm)
            mine = mp.encoded_by(step, r)
            enc = sum(f[mp.media_id[j]] + b[mp.media_id[j]] for j in mine)
            assert np.isclose(pm["encoder_rank"][step, r], enc)


def test_post_balancing_reaches_both_lower_bounds_on_the_mix():
    table = generate("multimodal-mix", COST.rules, n=6000, seed=1)
    layout = Layout(dp=8, microbatches=2, capacity=COST.capacity())
    cfg = PlannerConfig(strategy="balanced", shuffle=False)
    res = {mode: mm_summary(plan_multimodal(table, COST, layout, cfg,
                                            MMConfig(mode=mode, over_capacity="downscale")), COST)
           for mode in ("home", "post")}
    assert res["post"]["encoder"]["lower_bound_ratio"]["mean"] <= 1.05
    assert res["post"]["llm"]["lower_bound_ratio"]["mean"] <= 1.05
    assert res["home"]["encoder"]["lower_bound_ratio"]["mean"] > \
        res["post"]["encoder"]["lower_bound_ratio"]["mean"] + 0.1


def test_over_capacity_policy():
    r = MediaRules()
    big = MultimodalTable.build([10, 100], r, images=(np.array([0, 0, 3]), r.vision.image_grids(
        [2000, 2000, 2000], [2000, 2000, 2000])))  # 3 x 5184 tokens + 100 text
    layout = Layout(dp=1, microbatches=1, capacity=12000)
    with pytest.raises(ValueError, match=r"sample 1: 15552 media tokens \+ 100 text tokens = "
                                         r"15652 exceed the LLM capacity 12000"):
        plan_multimodal(big, COST, layout, mm=MMConfig(encoder_capacity=10**6))
    mp = plan_multimodal(big, COST, layout,
                         mm=MMConfig(over_capacity="downscale", encoder_capacity=10**6))
    assert mp.table.lengths[1] <= 12000 and mp.stats["samples_downscaled"] == 1
    assert mp.stats["media_downscaled"] == 3
    with pytest.raises(ValueError, match=r"sample 1: image \(media item 0\) has 20736 encoder "
                                         r"positions, over the encoder capacity 20000"):
        plan_multimodal(big, COST, Layout(dp=1, capacity=10**5),
                        mm=MMConfig(encoder_capacity=20000))
    mp = plan_multimodal(big, COST, Layout(dp=1, capacity=10**5),
                         mm=MMConfig(encoder_capacity=20000, over_capacity="downscale"))
    assert mp.table.media_positions.max() <= 20000


def test_lockstep_layouts_time_the_llm_phase_in_lockstep():
    """``sync: microbatch`` with pp 1 (FSDP / ZeRO-3): ranks wait for each other after every
    microbatch, so the LLM phase of a step lasts sum_k max_r cost[r, k] on every rank, as the
    text report (``Plan.lockstep_times``) times it, not the costliest rank's sum."""
    rng = np.random.default_rng(3)
    table = random_table(rng, 400)
    layout = Layout(dp=3, microbatches=2, capacity=COST.capacity(), sync="microbatch")
    for mode in ("home", "post"):
        mp = plan_multimodal(table, COST, layout, PlannerConfig(),
                             MMConfig(mode=mode, over_capacity="downscale"))
        pm = phase_metrics(mp, COST)
        plan = mp.plan
        slow = np.zeros(plan.n_steps)
        for step in range(plan.n_steps):
            per_rank = [[sum(COST.llm.microbatch_cost(plan.entry_length[plan.entries(int(mb))]))
                         for mb in plan.microbatch_ids(step, r)] for r in range(3)]
            slow[step] = np.max(per_rank, axis=0).sum()
            assert np.allclose(pm["llm_time"][step], slow[step])
            assert slow[step] >= pm["llm_rank"][step].max() * (1 - 1e-12)
        assert np.allclose(pm["step_time"], pm["encoder_rank"].max(1) + slow)
        summary = mm_summary(mp, COST, min_step_fraction=0.0)
        want = slow / pm["llm_rank"].mean(1)
        assert np.isclose(summary["llm"]["dp_imbalance"]["mean"], want.mean())
