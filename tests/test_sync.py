"""Layout.sync (issue #14 item 4): the balance target follows the trainer's synchronisation."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from balancer import Layout, PlannerConfig, SampleTable, plan_epoch, workloads
from balancer.integrations.sync import lockstep_imbalance, rank_sum_imbalance, sync_for
from balancer.strategies.balanced import rank_units
from tests.planning.test_planner import COST, STRATEGIES, _plan_or_carry, assert_valid

SYNCS = ("step", "microbatch")


def _lockstep_reference(plan, cost):
    """Plain loops: per step, the sum over microbatch positions of the slowest rank there, over
    the mean per-rank cost."""
    lay = plan.layout
    out = []
    for s in range(plan.n_steps):
        per_rank = []
        for r in range(lay.dp):
            row = []
            for mb in plan.microbatch_ids(s, r):
                c = cost.microbatch_constant[0] + cost.microbatch_constant[1]
                for i in range(plan.mb_offsets[mb], plan.mb_offsets[mb + 1]):
                    f, b = cost.doc_costs(plan.entry_length[i:i + 1])
                    c += float(f[0] + b[0])
                row.append(c)
            per_rank.append(row)
        m = len(per_rank[0])
        wall = sum(max(per_rank[r][k] for r in range(lay.dp)) for k in range(m))
        mean = sum(sum(row) for row in per_rank) / lay.dp
        out.append(wall / mean)
    return np.array(out)


def test_rank_units_follow_sync():
    for dp, pp in ((1, 1), (8, 1), (8, 4), (1, 4)):
        for sync in SYNCS:
            lay = Layout(dp=dp, pp=pp, microbatches=4, capacity=1024, sync=sync)
            want = dp > 1 and pp == 1 and sync == "step"
            assert rank_units(lay, PlannerConfig()) is want, (dp, pp, sync)
            assert rank_units(lay, PlannerConfig(balance="microbatch")) is False
    assert rank_units(Layout(dp=8, capacity=8), PlannerConfig(balance="rank")) is True
    with pytest.raises(ValueError, match="balance='rank'.*sync='microbatch'"):
        rank_units(Layout(dp=8, capacity=8, sync="microbatch"), PlannerConfig(balance="rank"))
    with pytest.raises(ValueError, match="sync"):
        Layout(dp=2, capacity=8, sync="every")


def test_default_layout_dumps_as_before():
    """Plans, store manifests and sampler checkpoints written before the field existed hash and
    compare equal to a default layout; a non-default sync is part of the dump."""
    lay = Layout(dp=2, pp=1, cp=1, microbatches=3, capacity=64)
    assert lay.sync == "step"
    assert list(lay.model_dump()) == ["dp", "pp", "cp", "microbatches", "capacity"]
    assert lay.model_dump_json() == '{"dp":2,"pp":1,"cp":1,"microbatches":3,"capacity":64}'
    mb = lay.model_copy(update={"sync": "microbatch"})
    assert mb.model_dump()["sync"] == "microbatch"
    assert Layout.model_validate(mb.model_dump()) == mb
    assert Layout.model_validate(lay.model_dump()) == lay
    with pytest.raises(ValueError):
        Layout(dp=2, capacity=8, sync_mode="step")  # unknown keys stay errors


def test_auto_with_microbatch_sync_balances_microbatches_placed_for_lockstep():
    """sync='microbatch' balances every microbatch (as balance='microbatch' does), and since
    2026-12-07 places a step's microbatches for the least lockstep time: by cost, dp to a
    position. balance='microbatch' under sync='step' keeps the balanced split over ranks (its
    ranks meet once a step, so their sums count), so the two plans are no longer the same."""
    lengths = workloads.synthetic("lognormal-4k", n=3000, seed=1)
    s = SampleTable(lengths)
    lay = Layout(dp=4, microbatches=4, capacity=32768)
    mb_sync = lay.model_copy(update={"sync": "microbatch"})
    assert not rank_units(mb_sync, PlannerConfig())
    a = plan_epoch(s, COST, mb_sync, PlannerConfig(over_length="chunk"))
    c = plan_epoch(s, COST, lay, PlannerConfig(over_length="chunk"))
    assert a.fingerprint() != c.fingerprint()  # the layout (and the plan) differ
    f, b = COST.doc_costs(a.entry_length)
    mb = np.add.reduceat(f + b, a.mb_offsets[:-1])
    so = a.step_offsets
    for st_ in range(a.n_steps):
        x = mb[so[st_]:so[st_ + 1]].reshape(4, int(a.step_mbs[st_]))
        # every position's costliest microbatch is the least it can be: the k-th of every dp
        assert np.array_equal(np.sort(x.max(axis=0))[::-1], np.sort(x.ravel())[::-1][::4])
    assert lockstep_imbalance(a, COST).mean() < lockstep_imbalance(c, COST).mean()


@given(lengths=st.lists(st.integers(1, 900), min_size=8, max_size=160),
       dp=st.integers(1, 4), m=st.integers(1, 3), pp=st.sampled_from([1, 2]),
       strategy=st.sampled_from(STRATEGIES), sync=st.sampled_from(SYNCS))
def test_every_strategy_valid_with_both_syncs(lengths, dp, m, pp, strategy, sync):
    lengths = np.array(lengths, dtype=np.int64)
    lay = Layout(dp=dp, pp=pp, microbatches=m, capacity=1000, sync=sync)
    plan = _plan_or_carry(lengths, lay, PlannerConfig(strategy=strategy, max_delay=2))
    assert_valid(plan, lengths, strict_delay=strategy != "kk_tokens")
    assert plan.layout.sync == sync
    assert np.allclose(lockstep_imbalance(plan, COST), _lockstep_reference(plan, COST),
                       rtol=1e-12)
    assert (lockstep_imbalance(plan, COST) >= 1 - 1e-12).all()
    assert (rank_sum_imbalance(plan, COST) <= lockstep_imbalance(plan, COST) + 1e-12).all()


@pytest.mark.parametrize("name,n,capacity", [("wlbllm", 12000, 131072),
                                             ("bimodal-sft", 60000, 16384)])
def test_microbatch_sync_lowers_lockstep_imbalance(name, n, capacity):
    lengths = np.asarray(workloads.load(name, n=n, seed=0), dtype=np.int64)
    s = SampleTable(lengths)
    out = {}
    for sync in SYNCS:
        lay = Layout(dp=8, microbatches=4, capacity=capacity, sync=sync)
        plan = plan_epoch(s, COST, lay, PlannerConfig(over_length="chunk"))
        assert_valid(plan, lengths, strict_delay=False)
        out[sync] = lockstep_imbalance(plan, COST).mean()
    assert out["microbatch"] < out["step"], out


def test_sync_for():
    assert sync_for("ddp") == "step" and sync_for("fsdp") == "microbatch"
    with pytest.raises(ValueError, match="unknown trainer 'x'"):
        sync_for("x")


def test_store_keeps_sync(tmp_path):
    from balancer.store.plan_store import check_compatible, load_plan, save_plan
    lengths = workloads.synthetic("lognormal-4k", n=400, seed=2)
    lay = Layout(dp=2, microbatches=2, capacity=32768, sync="microbatch")
    plan = plan_epoch(SampleTable(lengths), COST, lay, PlannerConfig(over_length="chunk"))
    save_plan(plan, tmp_path / "mb")
    back, manifest = load_plan(tmp_path / "mb")
    assert back.layout == lay and back.fingerprint() == plan.fingerprint()
    assert manifest["layout"]["sync"] == "microbatch"
    check_compatible(manifest, layout=lay)
    # a plan balanced for per-step sync is refused by a job that syncs every microbatch
    step = plan_epoch(SampleTable(lengths), COST, lay.model_copy(update={"sync": "step"}),
                      PlannerConfig(over_length="chunk"))
    save_plan(step, tmp_path / "step")
    _, manifest = load_plan(tmp_path / "step")
    assert "sync" not in manifest["layout"]
    with pytest.raises(ValueError, match="layout sync: plan has sync=.step., the job has "
                                         "sync='microbatch'"):
        check_compatible(manifest, layout=lay)
