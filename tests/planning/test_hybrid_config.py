"""One config vocabulary for both CP modes: the hybrid mode is configured with the fixed mode's
PlannerConfig and names (``cost``, ``over_length``, ``global_batch_tokens``, ``max_delay``),
takes its first API's names as aliases (``model``, ``over_limit``, ``batch_tokens``), keeps its
own defaults where they differ for a reason (``balancer.config.MODE_DEFAULTS``) and plans
bit-identically whichever spelling is used."""
from __future__ import annotations

import json

import numpy as np
import pytest

from balancer import cli
from balancer.config import MODE_DEFAULTS, Layout, PlannerConfig
from balancer.cost.cp import CPCostModel
from balancer.cost.model import CostModel
from balancer.loader.hybrid import HybridBatchSampler
from balancer.planning.hybrid import (HYBRID_MAX_DELAY, hybrid_config, plan_hybrid,
                                      plan_hybrid_epoch, plan_hybrid_stream, plan_megatron_hybrid,
                                      plan_strategy)
from balancer.planning.planner import plan_epoch
from balancer.samples import SampleTable
from balancer.store.hybrid import load_hybrid_manifest, precompute_hybrid
from balancer.strategies import registry as strategies

CAP = 1024
COST = CPCostModel.from_preset("llama-7b", CAP)
LAYOUT = Layout(dp=2, cp=2, microbatches=2, capacity=2 * CAP, cp_mode="hybrid",
                rank_capacity=CAP)


def mixed(n=160, seed=0):
    rng = np.random.default_rng(seed)
    short = rng.integers(8, CAP // 2, n)
    return np.where(rng.random(n) < 0.1, rng.integers(CAP, 5 * CAP, n), short).astype(np.int64)


L = mixed()
SAMPLES = SampleTable(L)


def same(a, b) -> bool:
    """Two plans (or StreamResults) hold the same arrays and figures."""
    return all(same(x, y) if hasattr(x, "_fields") else np.array_equal(np.asarray(x),
                                                                         np.asarray(y))
               for x, y in zip(a, b))


@pytest.mark.parametrize("strategy", strategies.names("hybrid", n_ranks=4))
def test_a_config_plans_what_the_old_keywords_plan(strategy):
    old = HybridBatchSampler(SAMPLES, COST, LAYOUT, strategy=strategy, seed=3, max_delay=1,
                             over_limit="chunk", batch_tokens=3 * CAP, rank=1)
    cfg = PlannerConfig(strategy=strategy, seed=3, max_delay=1, over_length="chunk",
                        global_batch_tokens=3 * CAP)
    new = HybridBatchSampler(SAMPLES, COST, LAYOUT, cfg, rank=1)
    named = HybridBatchSampler(SAMPLES, cost=COST, layout=LAYOUT, strategy=strategy, seed=3,
                               max_delay=1, over_length="chunk", batch_tokens=3 * CAP, rank=1)
    assert same(old.plan, new.plan) and same(old.plan, named.plan)
    assert old.state_dict() == new.state_dict() == named.state_dict()
    assert [list(r) for r in old] == [list(r) for r in new]
    assert same(plan_hybrid_epoch(L, COST, 4, 3 * CAP, cfg), old.plan)
    assert same(plan_hybrid_epoch(L, COST, 4, 3 * CAP, strategy=strategy, seed=3, max_delay=1,
                                  over_limit="chunk"), old.plan)
    # the figures' dispatch plans the same stream the same way under either spelling
    a, _ = plan_strategy(strategy, L, COST, 4, 3 * CAP, max_delay=1, over_limit="chunk")
    b, _ = plan_strategy(strategy, L, COST, 4, 3 * CAP, cfg)
    assert same(a, b)


def test_unset_fields_take_the_hybrid_modes_defaults():
    assert HYBRID_MAX_DELAY == MODE_DEFAULTS["hybrid"]["max_delay"] == 2
    for s in (HybridBatchSampler(SAMPLES, COST, LAYOUT, rank=0),
              HybridBatchSampler(SAMPLES, COST, LAYOUT, PlannerConfig(), rank=0)):
        assert (s.strategy, s.seed, s.max_delay, s.over_limit) == \
            (strategies.default("hybrid"), 0, 2, "error")
        assert s.batch_tokens == 2 * 2 * 2 * CAP   # dp x cp x microbatches x rank_capacity
    # a value the config sets is kept, even when it is the fixed mode's default
    assert HybridBatchSampler(SAMPLES, COST, LAYOUT, PlannerConfig(max_delay=4),
                              rank=0).max_delay == 4
    assert PlannerConfig().max_delay == 4 and PlannerConfig().strategy == "balanced"
    c = hybrid_config()
    assert hybrid_config(c) == c and c.model_fields_set >= {"strategy", "max_delay"}


def test_old_names_are_aliases_and_a_disagreement_is_an_error():
    s = HybridBatchSampler(SAMPLES, model=COST, layout=LAYOUT, over_limit="chunk", rank=0)
    assert s.cost is COST and s.model is COST and s.over_limit == "chunk"
    assert HybridBatchSampler(SAMPLES, COST, LAYOUT, model=COST, over_limit="chunk",
                              over_length="chunk", rank=0).over_limit == "chunk"
    other = CPCostModel.from_preset("llama-70b", CAP)
    with pytest.raises(ValueError, match=r"cost=.* and model=.* disagree \(model is the older "
                                         r"name of cost\)"):
        HybridBatchSampler(SAMPLES, COST, LAYOUT, model=other, rank=0)
    with pytest.raises(ValueError, match=r"over_length='error' and over_limit='chunk' disagree"):
        HybridBatchSampler(SAMPLES, COST, LAYOUT, over_length="error", over_limit="chunk")
    with pytest.raises(ValueError, match=r"seed=2 disagrees with the config's seed=1"):
        HybridBatchSampler(SAMPLES, COST, LAYOUT, PlannerConfig(seed=1), seed=2, rank=0)
    with pytest.raises(ValueError, match=r"global_batch_tokens=4096 disagrees with the config's "
                                         r"global_batch_tokens=2048"):
        HybridBatchSampler(SAMPLES, COST, LAYOUT, PlannerConfig(global_batch_tokens=2048),
                           batch_tokens=4096, rank=0)
    # a field the hybrid mode does not read is refused, never ignored
    with pytest.raises(ValueError, match=r"cp_mode 'hybrid' does not use tail='carry'"):
        HybridBatchSampler(SAMPLES, COST, LAYOUT, PlannerConfig(tail="carry"), rank=0)
    with pytest.raises(ValueError, match=r"strategy 'balanced' is not a hybrid-mode strategy"):
        HybridBatchSampler(SAMPLES, COST, LAYOUT, PlannerConfig(strategy="balanced"), rank=0)
    with pytest.raises(TypeError, match="config must be a PlannerConfig"):
        HybridBatchSampler(SAMPLES, COST, LAYOUT, {"seed": 1}, rank=0)
    # the planners take both spellings of the over-length policy
    docs = np.array([3 * CAP, 100, 7 * CAP, 5], np.int64)
    for fn, args in ((plan_hybrid, (docs, COST, 4)), (plan_megatron_hybrid, (docs, 4, CAP)),
                     (plan_hybrid_stream, (docs, COST, 4, 4 * CAP))):
        a, b = fn(*args, over_limit="chunk"), fn(*args, over_length="chunk")
        assert same(a, b), fn.__name__
        with pytest.raises(ValueError, match="disagree"):
            fn(*args, over_limit="chunk", over_length="error")
        with pytest.raises(ValueError, match=r"exceeds the pool's limit .* over_length='chunk' "
                                             r"\(over_limit\)"):
            fn(*args)


def test_precompute_hybrid_takes_the_config(tmp_path):
    a = precompute_hybrid(SAMPLES, COST, LAYOUT, tmp_path / "a", strategy="hybrid", seed=3,
                          max_delay=1, over_limit="chunk", epochs=2)
    b = precompute_hybrid(SAMPLES, COST, LAYOUT, tmp_path / "b", epochs=2,
                          config=PlannerConfig(strategy="hybrid", seed=3, max_delay=1,
                                               over_length="chunk"))
    ma, mb = load_hybrid_manifest(a), load_hybrid_manifest(b)
    assert ma == mb and ma["over_limit"] == "chunk" and ma["max_delay"] == 1   # the JSON keys
    own = HybridBatchSampler(SAMPLES, COST, LAYOUT, PlannerConfig(
        strategy="hybrid", seed=3, max_delay=1, over_length="chunk"), rank=2, epoch=1)
    stored = HybridBatchSampler(SAMPLES, COST, LAYOUT, PlannerConfig(
        strategy="hybrid", seed=3, max_delay=1, over_length="chunk"), rank=2, epoch=1, plan=b)
    assert [list(r) for r in own] == [list(r) for r in stored]
    c = precompute_hybrid(SAMPLES, model=COST, layout=LAYOUT, out=tmp_path / "c",
                          over_limit="chunk")
    assert load_hybrid_manifest(c)["max_delay"] == 2   # the hybrid default, as the sampler's


def test_the_fixed_mode_refuses_a_zero_delay_and_hybrid_strategies(tmp_path, capsys):
    """max_delay=0 is the hybrid mode's 'no document moves'; the fixed mode's strategies let a
    sample wait at least one step and refuse it by name, as before the field allowed 0."""
    cost = CostModel.quadratic(4096)
    lay = Layout(dp=2, microbatches=2, capacity=4096)
    small = SampleTable(np.arange(1, 200, dtype=np.int64) * 7)
    with pytest.raises(ValueError, match=r"max_delay=0: the fixed mode .* needs max_delay >= 1"):
        plan_epoch(small, cost, lay, PlannerConfig(max_delay=0))
    with pytest.raises(ValueError, match=r"strategy 'hybrid' plans cp_mode 'hybrid', not "
                                         r"'fixed'"):
        plan_epoch(small, cost, lay, PlannerConfig(strategy="hybrid"))
    f = tmp_path / "l.npy"
    np.save(f, small.lengths)
    assert cli.main(["report", "--lengths", str(f), "--capacity", "4096", "--dp", "2",
                     "--max-delay", "0", "--no-plots", "--out", str(tmp_path / "r")]) == 2
    assert "max_delay=0: the fixed mode" in capsys.readouterr().err


def test_the_hybrid_report_plans_with_the_delay_training_uses(tmp_path):
    """``report --cp-mode hybrid`` (and ``tools/bench.py --cp-mode hybrid``) without
    ``--max-delay`` planned hybrid_stream with the fixed mode's default, 4, while
    HybridBatchSampler and ``precompute --cp-mode hybrid`` train with 2: the report showed
    another plan than the one trained. Without the flag it now takes the hybrid default; the
    flag still sets it (test first)."""
    f = tmp_path / "l.npy"
    np.save(f, L)
    base = ["--cp-mode", "hybrid", "--lengths", str(f), "--dp", "2", "--cp", "2",
            "--rank-capacity", str(CAP), "--over-length", "chunk", "--cost-model", "llama-7b"]
    got = {}
    for extra in ([], ["--max-delay", "4"]):
        out = tmp_path / f"r{len(extra)}"
        assert cli.main(["report", *base, "--strategies", "hybrid_stream", "--no-plots",
                         "--out", str(out), *extra]) == 0
        got[len(extra)] = json.loads((out / "report.json").read_text())["max_delay"]
    assert cli.main(["precompute", *base, "--out", str(tmp_path / "p")]) == 0
    stored = json.loads((tmp_path / "p" / "manifest.json").read_text())["max_delay"]
    assert got == {0: stored, 2: 4} and stored == 2


def test_precompute_takes_strategies_of_its_mode(tmp_path, capsys):
    """``precompute --strategies NAME`` checked the name among the fixed mode's strategies only,
    so ``--cp-mode hybrid --strategies hybrid`` was 'unknown strategy' while ``--strategy
    hybrid`` worked; a fixed job naming a hybrid strategy is told which mode it serves (test
    first)."""
    f = tmp_path / "l.npy"
    np.save(f, L)
    base = ["precompute", "--lengths", str(f), "--dp", "2", "--cp", "2"]
    hyb = ["--cp-mode", "hybrid", "--rank-capacity", str(CAP), "--over-length", "chunk",
           "--cost-model", "llama-7b"]
    assert cli.main([*base, *hyb, "--strategies", "hybrid", "--out", str(tmp_path / "h")]) == 0
    assert json.loads((tmp_path / "h" / "manifest.json").read_text())["strategy"] == "hybrid"
    assert cli.main([*base, "--strategies", "hybrid", "--out", str(tmp_path / "f")]) == 2
    assert "strategy 'hybrid' plans cp_mode 'hybrid', not 'fixed'" in capsys.readouterr().err
