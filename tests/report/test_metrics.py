"""Report metrics (balancer.report.metrics) against hand-computed values and slow references."""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, strategies as st

from balancer import CostModel, Layout, PassCost, PlannerConfig, SampleTable, plan_epoch
from balancer.report import metrics
from balancer.strategies import registry as strategies
from balancer.planning.planner import Items, Plan
from packing.pipeline import simulate_1f1b
from tests.naive import core as naive

STRATEGIES = strategies.names()  # every registered strategy
# forward L + L^2/64K, backward twice that, in "seconds" so GPU-seconds are defined
SECONDS = CostModel(name="test-seconds", unit="seconds", forward=PassCost(a=1 / 65536, b=1.0),
                    backward=PassCost(a=2 / 65536, b=2.0))
LINEAR = CostModel(name="linear", unit="seconds", forward=PassCost(b=1.0),
                   backward=PassCost(b=2.0))


def make_plan(mbs, *, dp, step_mbs, pp=1, cp=1, capacity=1 << 20, n_samples=None,
              delays=None, cost=LINEAR) -> Plan:
    """A plan from ``mbs``: microbatches (step-major, rank-major) as lists of
    ``(sample, start, length)``; mb_fwd/mb_bwd are the cost model's."""
    ent = [e for mb in mbs for e in mb]
    sample = np.array([e[0] for e in ent], np.int64)
    start = np.array([e[1] for e in ent], np.int64)
    length = np.array([e[2] for e in ent], np.int64)
    offs = np.concatenate([[0], np.cumsum([len(mb) for mb in mbs])]).astype(np.int64)
    f = np.array([cost.microbatch_cost(np.array([e[2] for e in mb]))[0] for mb in mbs])
    b = np.array([cost.microbatch_cost(np.array([e[2] for e in mb]))[1] for mb in mbs])
    empty = np.zeros(0, np.int64)
    return Plan(layout=Layout(dp=dp, pp=pp, cp=cp, microbatches=max(step_mbs),
                              capacity=capacity),
                config=PlannerConfig(), cost_model=cost.name, epoch=0,
                n_samples=n_samples if n_samples is not None else int(sample.max()) + 1,
                dataset_fingerprint="test", entry_sample=sample, entry_start=start,
                entry_length=length,
                entry_delay=np.zeros(len(ent), np.int32) if delays is None else
                np.array(delays, np.int32),
                mb_offsets=offs, step_mbs=np.array(step_mbs, np.int64), mb_fwd=f, mb_bwd=b,
                leftover=Items(empty, empty, empty))


# ---- pipeline timeline (Gantt data) ----------------------------------------------------------
def test_timeline_hand_computed():
    # pp=2, m=2, forward 1, backward 2. Stage 0: F0 F1 (warm-up 1) B0 B1; stage 1: F0 B0 F1 B1
    t = metrics.pipeline_timeline([1.0, 1.0], [2.0, 2.0], 2)
    ops = {(int(s), int(k), int(j)): (a, b) for s, k, j, a, b in
           zip(t["stage"], t["kind"], t["mb"], t["start"], t["end"])}
    assert ops == {(0, 0, 0): (0, 1), (0, 0, 1): (1, 2), (1, 0, 0): (1, 2), (1, 1, 0): (2, 4),
                   (1, 0, 1): (4, 5), (1, 1, 1): (5, 7), (0, 1, 0): (4, 6), (0, 1, 1): (7, 9)}
    assert t["end"].max() == (2 + 2 - 1) * 3.0  # closed form (m + pp - 1) x (f + b)


def test_timeline_slow_late_forward_is_partly_hidden():
    # microbatch 1's stage-1 forward waits for stage 1's B0 (ends 4) anyway, so a forward
    # 1.0 longer on both stages costs 1.0 (on the last stage only), not 2.0 as for microbatch 0
    base = metrics.pipeline_timeline([1.0, 1.0], [2.0, 2.0], 2)["end"].max()
    late = metrics.pipeline_timeline([1.0, 2.0], [2.0, 2.0], 2)["end"].max()
    early = metrics.pipeline_timeline([2.0, 1.0], [2.0, 2.0], 2)["end"].max()
    assert (base, late, early) == (9.0, 10.0, 11.0)
    assert late == naive.simulate_1f1b([1.0, 2.0], [2.0, 2.0], 2)


@given(st.integers(1, 5), st.lists(st.tuples(st.floats(0.1, 10), st.floats(0.1, 10)),
                                   min_size=1, max_size=8))
def test_timeline_matches_simulator(pp, ops):
    f = np.array([a for a, _ in ops])
    b = np.array([c for _, c in ops])
    t = metrics.pipeline_timeline(f, b, pp)
    span, busy = simulate_1f1b(f, b, pp)
    assert np.isclose(t["end"].max(), span)
    dur = t["end"] - t["start"]
    assert np.allclose(np.bincount(t["stage"], weights=dur, minlength=pp), busy)
    # every (stage, kind, microbatch) exactly once, no two ops of a stage overlap
    assert len({(s, k, j) for s, k, j in zip(t["stage"], t["kind"], t["mb"])}) == 2 * len(f) * pp
    for s in range(pp):
        sel = t["stage"] == s
        o = np.argsort(t["start"][sel])
        assert (t["start"][sel][o][1:] >= t["end"][sel][o][:-1] - 1e-9).all()


# ---- pipeline times, order effect, GPU time ---------------------------------------------------
def test_equal_microbatches_give_the_closed_form():
    pp, m, dp = 4, 3, 2
    mbs = [[(i, 0, 100)] for i in range(dp * m)]
    plan = make_plan(mbs, dp=dp, step_mbs=[m], pp=pp)
    times, bubble = metrics.pipeline_times(plan, LINEAR)
    per_stage = 300.0 / pp  # (f + b) / pp
    assert np.allclose(times, (m + pp - 1) * per_stage)
    assert np.allclose(bubble, 1 - m / (m + pp - 1))
    g = metrics.gpu_time(times, bubble, plan.layout, LINEAR)
    assert g["dp_idle"] == 0
    assert np.isclose(g["useful"], dp * m * 300.0)
    assert np.isclose(g["total"], dp * pp * (m + pp - 1) * per_stage)


def test_order_effect_matches_resorted_simulation():
    pp, m = 2, 3
    lengths = [100, 700, 300, 50, 400, 200]
    plan = make_plan([[(i, 0, L)] for i, L in enumerate(lengths)], dp=2, step_mbs=[m], pp=pp)
    c = 3.0 * np.array(lengths, float)
    for order, key in (("descending", lambda x: -x), ("ascending", lambda x: x)):
        times, _ = metrics.pipeline_times(plan, LINEAR, order)
        for r in range(2):
            mine = c[r * m:(r + 1) * m]
            o = np.argsort(key(mine), kind="stable")
            ref, _ = simulate_1f1b(mine[o] / 3 / pp, 2 * mine[o] / 3 / pp, pp)
            assert np.isclose(times[0, r], ref)
    with pytest.raises(ValueError, match="order"):
        metrics.pipeline_times(plan, LINEAR, "random")


def test_gpu_time_dp_wait_by_hand():
    # dp=2, pp=1: rank 0 costs 3 x (1 + 1) = 6, rank 1 costs 3 x (2 + 2) = 12
    plan = make_plan([[(0, 0, 1)], [(1, 0, 1)], [(2, 0, 2)], [(3, 0, 2)]], dp=2, step_mbs=[2])
    times, bubble = metrics.pipeline_times(plan, LINEAR)
    assert times.tolist() == [[6.0, 12.0]]
    g = metrics.gpu_time(times, bubble, plan.layout, LINEAR)
    assert (g["total"], g["useful"], g["dp_idle"], g["pp_bubble"]) == (24.0, 18.0, 6.0, 0.0)
    assert g["unit"] == "GPU-seconds" and g["est_epoch_seconds"] == 12.0
    tokens = CostModel.quadratic(65536)
    assert metrics.gpu_time(times, bubble, plan.layout, tokens)["est_epoch_seconds"] is None


def test_lockstep_step_time_by_hand():
    # dp=2, pp=1, ranks in lockstep after every microbatch (sync='microbatch': FSDP, ZeRO-3):
    # rank 0 runs microbatches of 3 x 1 then 3 x 4, rank 1 of 3 x 3 then 3 x 2. Rank sums are
    # 15 each, but position 0 waits for 9 and position 1 for 12: the step lasts 21, not 15.
    plan = make_plan([[(0, 0, 1)], [(1, 0, 4)], [(2, 0, 3)], [(3, 0, 2)]], dp=2, step_mbs=[2])
    plan = dataclasses.replace(plan, layout=plan.layout.model_copy(update={"sync": "microbatch"}))
    sm = metrics.step_metrics(plan, LINEAR)
    assert sm["step_time"].tolist() == [21.0]
    assert sm["dp_imbalance"].tolist() == [21.0 / 15.0]
    assert sm["idle_time"].tolist() == [12.0]
    assert sm["rank_time"].tolist() == [[15.0, 15.0]]
    times, bubble = metrics.pipeline_times(plan, LINEAR)
    g = metrics.gpu_time(times, bubble, plan.layout, LINEAR, sm["step_time"])
    assert (g["total"], g["useful"], g["dp_idle"]) == (42.0, 30.0, 12.0)
    assert g["est_epoch_seconds"] == 21.0
    # the same microbatches with the ranks meeting once a step: the slowest rank's sum
    step = dataclasses.replace(plan, layout=plan.layout.model_copy(update={"sync": "step"}))
    assert metrics.step_metrics(step, LINEAR)["step_time"].tolist() == [15.0]


@pytest.mark.parametrize("pp,cp", [(1, 1), (4, 1), (2, 2)])
def test_gpu_time_splits_exactly(wlbllm, pp, cp):
    lay = Layout(dp=4, pp=pp, cp=cp, microbatches=4, capacity=131072)
    plan = plan_epoch(SampleTable(wlbllm[:20_000]), SECONDS, lay,
                      PlannerConfig(strategy="sequential", over_length="chunk"))
    times, bubble = metrics.pipeline_times(plan, SECONDS)
    g = metrics.gpu_time(times, bubble, lay, SECONDS)
    f, b = metrics.microbatch_costs(plan, SECONDS)
    assert np.isclose(g["useful"], (f + b).sum(), rtol=1e-9)  # busy GPU time = all work
    assert g["dp_idle"] >= 0 and g["pp_bubble"] >= 0
    assert np.isclose(g["est_epoch_seconds"], times.max(axis=1).sum() / cp)


# ---- padding, samples, bounds, delays -------------------------------------------------------
def test_padding_samples_and_bounds_by_hand():
    # cp=2 pads to multiples of 4; sample 1 is cut: its second piece (start 8) is in step 1
    mbs = [[(0, 0, 5), (1, 0, 8)], [(2, 0, 3)],         # step 0: rank 0, rank 1
           [(1, 8, 2)], [(3, 0, 7), (4, 0, 1)]]         # step 1
    plan = make_plan(mbs, dp=2, step_mbs=[1, 1], cp=2, capacity=16, delays=[0, 0, 2, 1, 0, 0])
    pw = metrics.padding_waste(plan)
    # padded: 8 + 8 | 4 | 4 | 8 + 4 = 36 of 4 x 16 = 64 slots; real tokens 26
    assert (pw["slots"], pw["tokens"], pw["cp_padding_tokens"], pw["unused_tokens"]) == \
        (64, 26, 10, 28)
    assert np.isclose(pw["waste_fraction"], 38 / 64)
    assert metrics.samples_per_step(plan).tolist() == [3, 2]  # the piece at 8 is not a sample
    # step 0: ranks hold 13 and 3 tokens, largest document 8 -> 13 / max(8, 8)
    # step 1: ranks hold 2 and 8 tokens, largest 7 -> 8 / max(5, 7)
    assert np.allclose(metrics.token_lower_bound_ratio(plan), [13 / 8, 8 / 7])
    lb = metrics.epoch_lower_bounds(plan, LINEAR)
    assert lb["steps_lower_bound"] == 2  # 36 padded tokens, 2 x 1 x 16 per step
    assert lb["time_lower_bound"] == 3 * 26 / 2
    assert metrics.delay_histogram(plan) == {"0": 4, "1": 1, "2": 1}
    early = dataclasses.replace(plan, entry_delay=np.array([-1, 0, 2, 0, 0, 0], np.int32))
    assert metrics.delay_histogram(early) == {"-1": 1, "0": 4, "1": 0, "2": 1}


def test_speedup():
    assert metrics.speedup(3.0, 2.0) == 1.5
    assert np.isnan(metrics.speedup(3.0, 0.0))


# ---- independence from the planner's own predictions ----------------------------------------
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_recomputed_costs_agree_with_planner(wlbllm, strategy):
    lay = Layout(dp=4, pp=2, cp=2, microbatches=4, capacity=65536)
    plan = plan_epoch(SampleTable(wlbllm[:30_000]), SECONDS, lay,
                      PlannerConfig(strategy=strategy, over_length="chunk"))
    assert metrics.prediction_error(plan, SECONDS) < 1e-12
    f, b = metrics.microbatch_costs(plan, SECONDS)
    assert np.allclose(f, plan.mb_fwd, rtol=1e-12) and np.allclose(b, plan.mb_bwd, rtol=1e-12)
    sm = metrics.step_metrics(plan, SECONDS)
    assert np.allclose(sm["microbatch_cost"], plan.mb_fwd + plan.mb_bwd, rtol=1e-12)
    # the simulated step times from recomputed costs equal those from the predictions
    times, _ = metrics.pipeline_times(plan, SECONDS)
    from packing.pipeline import rank_step_times
    pred, _ = rank_step_times(plan.mb_fwd, plan.mb_bwd, plan.step_mbs, lay.dp, lay.pp)
    assert np.allclose(times, pred, rtol=1e-12)
    # and the recomputation does not read the predictions: wrong predictions are caught
    wrong = dataclasses.replace(plan, mb_fwd=plan.mb_fwd * 1.01)
    assert metrics.prediction_error(wrong, SECONDS) > 0.009
    assert np.array_equal(metrics.pipeline_times(wrong, SECONDS)[0], times)


# ---- validity -------------------------------------------------------------------------------
def _small_plan():
    lengths = np.array([5, 9, 3, 7, 2, 8, 4, 6])
    plan = plan_epoch(SampleTable(lengths), LINEAR, Layout(dp=2, microbatches=2, capacity=16),
                      PlannerConfig(strategy="sequential", shuffle=False))
    return plan, lengths


def test_validate_ok_and_lost_and_duplicated():
    plan, lengths = _small_plan()
    ok = metrics.validate_plan(plan, lengths)
    assert ok["valid"] and ok["samples_planned"] == 8 and not ok["problems"]
    # lose the first entry of microbatch 0
    e0 = int(plan.entry_sample[0])
    lost = dataclasses.replace(plan, entry_sample=plan.entry_sample[1:],
                               entry_start=plan.entry_start[1:],
                               entry_length=plan.entry_length[1:],
                               entry_delay=plan.entry_delay[1:],
                               mb_offsets=np.maximum(plan.mb_offsets - 1, 0))
    v = metrics.validate_plan(lost, lengths)
    assert not v["valid"] and v["samples_lost"] == 1 and v["samples_duplicated"] == 0
    assert metrics.validate_plan(lost)["samples_lost"] == 1  # found without lengths too
    # duplicate it into the last microbatch instead (capacity is not the problem here)
    big = dataclasses.replace(plan, layout=plan.layout.model_copy(update={"capacity": 64}))
    dup = dataclasses.replace(big, entry_sample=np.append(big.entry_sample, e0),
                              entry_start=np.append(big.entry_start, 0),
                              entry_length=np.append(big.entry_length, lengths[e0]),
                              entry_delay=np.append(big.entry_delay, 0),
                              mb_offsets=np.concatenate([big.mb_offsets[:-1],
                                                         [big.mb_offsets[-1] + 1]]))
    v = metrics.validate_plan(dup, lengths)
    assert not v["valid"] and v["samples_duplicated"] == 1 and v["samples_lost"] == 0
    assert "1 duplicated" in v["problems"][-1]


def test_validate_structure():
    plan, lengths = _small_plan()
    oob = dataclasses.replace(plan, entry_sample=np.where(plan.entry_sample == 3, 99,
                                                          plan.entry_sample))
    v = metrics.validate_plan(oob, lengths)
    assert not v["valid"] and "out of range" in v["problems"][0] and "sample 99" in v["problems"][0]
    tight = dataclasses.replace(plan, layout=plan.layout.model_copy(update={"capacity": 8}))
    v = metrics.validate_plan(tight, lengths)
    assert not v["valid"] and "exceed the capacity 8" in v["problems"][0]
    wrong_n = metrics.validate_plan(plan, np.append(lengths, 5))
    assert not wrong_n["valid"] and "9" in wrong_n["problems"][0]


def _coverage_reference(plan, lengths):
    """check_coverage as first written: a lexsort of every entry (slow, obviously complete)."""
    n = lengths.shape[0]
    samp = np.concatenate([plan.entry_sample, plan.leftover.sample])
    start = np.concatenate([plan.entry_start, plan.leftover.start])
    length = np.concatenate([plan.entry_length, plan.leftover.length])
    covered = np.bincount(samp, weights=length, minlength=n)[:n]
    overlap = np.zeros(n, dtype=bool)
    for i in range(n):
        pieces = sorted((int(a), int(b)) for s, a, b in zip(samp, start, length) if s == i)
        for (a0, l0), (a1, _) in zip(pieces, pieces[1:]):
            if a1 < a0 + l0:
                overlap[i] = True
    dup = (covered > lengths) | overlap
    lost = (covered < lengths) & ~np.isin(np.arange(n), plan.leftover.sample)
    return {"samples_planned": int(n - lost.sum() - dup.sum()), "samples_lost": int(lost.sum()),
            "samples_duplicated": int(dup.sum())}


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 12), st.integers(1, 6)),
                min_size=1, max_size=14),
       st.lists(st.integers(1, 12), min_size=6, max_size=6))
def test_check_coverage_matches_reference(pieces, lens):
    lengths = np.array(lens, np.int64)
    plan = make_plan([pieces], dp=1, step_mbs=[1], n_samples=6)
    got = metrics.check_coverage(plan, lengths)
    ref = _coverage_reference(plan, lengths)
    assert {k: got[k] for k in ref} == ref
