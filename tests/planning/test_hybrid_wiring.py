"""Hybrid DP x CP in the product (issue #15 items 2-3): ``tools/bench.py`` and ``python -m
balancer report`` with ``--cp-mode`` and ``--rank-capacity``, fixed-mode plans as CP rounds,
the report's figures against a slow recomputation from the plan."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from balancer import cli
from balancer.config import Layout, PlannerConfig
from balancer.cost.cp import CPCostModel, CPHardware
from balancer.planning.hybrid import check_pool_limit, estimate, fixed_to_rounds, plan_strategy
from balancer.report.hybrid import coverage
from balancer.planning.planner import epoch_order, plan_epoch
from balancer.samples import SampleTable
from packing.hybrid_cp import check_plan

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_tool", ROOT / "tools" / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def mixed_lengths(n=300, seed=0, cap=4096, pool=8):
    rng = np.random.default_rng(seed)
    short = rng.integers(16, cap // 2, n)
    long = rng.integers(cap, pool * cap, n)
    return np.where(rng.random(n) < 0.05, long, short).astype(np.int64)


def slow_estimate(plan, model, lengths):
    """Per-rank, per-round loads by walking every rank's items (no vectorisation)."""
    P = plan.n_ranks
    items = plan.item_length if plan.item_length.any() else lengths[plan.item_doc]
    tab = model.table(items, P)
    comp = np.zeros((plan.n_rounds, P))
    expo = np.zeros((plan.n_rounds, P))
    busy = np.zeros((plan.n_rounds, P), bool)
    for r in range(plan.n_rounds):
        for g in range(plan.round_groups[r], plan.round_groups[r + 1]):
            off, size = int(plan.group_offset[g]), int(plan.group_size[g])
            for e in range(plan.group_entries[g], plan.group_entries[g + 1]):
                it, own = int(plan.entry_item[e]), int(plan.entry_owner[e])
                ranks = range(off, off + size) if own < 0 else [off + own]
                k = int(np.log2(size)) if own < 0 else 0
                for p in ranks:
                    comp[r, p] += tab.compute[it, k]
                    expo[r, p] += tab.exposed[it, k]
                    busy[r, p] = True
    load = comp + expo + tab.round_constant * busy
    return load.max(axis=1).sum(), comp, expo, load


def test_fixed_plan_as_rounds_matches_slow_reference():
    model = CPCostModel.from_preset("llama-7b", 4096, hardware=CPHardware(gpus_per_node=4))
    lengths = mixed_lengths(400, cap=4096, pool=4)
    layout = Layout(dp=4, cp=2, microbatches=3, capacity=2 * 4096)
    plan = plan_epoch(SampleTable(lengths), model.cost, layout,
                      PlannerConfig(over_length="chunk", seed=3))
    rounds = fixed_to_rounds(plan, lengths.shape[0])
    check_plan(rounds, aligned=True)
    assert rounds.n_rounds == int(plan.step_mbs.sum())
    assert (rounds.group_size == 2).all() and (rounds.entry_owner == -1).all()
    assert rounds.documents_cut == plan.stats["samples_chunked"] > 0
    assert coverage(rounds, lengths)["valid"]
    # every microbatch is one group: its documents exactly
    for mb in range(plan.n_microbatches):
        step = int(np.searchsorted(plan.step_offsets, mb, side="right") - 1)
        local = mb - plan.step_offsets[step]
        m = plan.step_mbs[step]
        r = rounds.step_rounds[step] + local % m
        items, _ = rounds.rank_items(int(r), int(local // m) * 2)
        assert sorted(rounds.item_doc[items].tolist()) == sorted(
            plan.microbatch_samples(mb).tolist())
    e = estimate(rounds, model, lengths)
    ref, comp, expo, _ = slow_estimate(rounds, model, lengths)
    assert e.step_time == pytest.approx(ref, rel=1e-12)
    np.testing.assert_allclose(e.compute, comp, rtol=1e-12, atol=0)
    np.testing.assert_allclose(e.exposed, expo, rtol=1e-12, atol=0)


def test_coverage_finds_lost_and_duplicated_tokens():
    model = CPCostModel.from_preset("llama-7b", 4096)
    lengths = mixed_lengths(120, cap=4096, pool=8)
    plan, _ = plan_strategy("fixed_cp2", lengths, model, 8, 8 * 2 * 4096)
    assert coverage(plan, lengths)["valid"]
    cut = np.flatnonzero(plan.item_start > 0)[0]
    shorter = plan.item_length.copy()
    shorter[cut] -= 1
    c = coverage(plan._replace(item_length=shorter), lengths)
    assert not c["valid"] and c["samples_lost"] == 1
    later = plan.item_start.copy()
    later[cut] -= 1
    c = coverage(plan._replace(item_start=later), lengths)
    assert not c["valid"] and c["samples_duplicated"] == 1
    c = coverage(plan, np.append(lengths, 5))
    assert c["samples_lost"] == 1


def test_report_hybrid_numbers_match_the_plan(tmp_path):
    lengths = mixed_lengths(500, seed=1, cap=4096, pool=8)
    f = tmp_path / "lengths.npy"
    np.save(f, lengths)
    out = tmp_path / "rep"
    argv = ["report", "--cp-mode", "hybrid", "--lengths", str(f), "--dp", "4", "--cp", "2",
            "--rank-capacity", "4096", "--microbatches", "2", "--cost-model", "llama-7b",
            "--seed", "5", "--strategies", "hybrid,megatron_hybrid,fixed_cp1,fixed_cp8",
            "--max-delay", "2", "--out", str(out)]
    assert cli.main(argv) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["cp_mode"] == "hybrid" and rep["layout"]["pool"] == 8
    for png in ("hybrid_rank_time.png", "hybrid_group_sizes.png", "hybrid_step_time.png"):
        assert (out / png).stat().st_size > 1000
    assert "hybrid against the baselines" in (out / "report.md").read_text()
    # re-plan independently (planning is deterministic) and recompute slowly
    model = CPCostModel.from_preset("llama-7b", 4096)
    order = epoch_order(lengths.shape[0], 5, 0)
    for name in ("hybrid", "megatron_hybrid", "fixed_cp1", "fixed_cp8"):
        b = rep["strategies"][name]
        plan, _ = plan_strategy(name, lengths[order], model, 8, 8 * 2 * 4096)
        plan = plan._replace(item_doc=order[plan.item_doc])
        t, comp, expo, load = slow_estimate(plan, model, lengths)
        assert b["valid"]
        assert b["est_step_time_total"] == pytest.approx(t, rel=1e-9)
        np.testing.assert_allclose(b["per_rank"]["compute_seconds"], comp.sum(axis=0),
                                   rtol=1e-9)
        np.testing.assert_allclose(b["per_rank"]["exposed_seconds"], expo.sum(axis=0),
                                   rtol=1e-9, atol=1e-12)
        assert b["exposed_comm_fraction"] == pytest.approx(expo.sum() / load.sum(), rel=1e-9,
                                                           abs=1e-15)
        sizes = plan.group_size[np.diff(plan.group_entries) > 0]
        assert b["group_size_histogram"] == {str(s): int((sizes == s).sum())
                                             for s in np.unique(sizes)}
        assert b["documents_cut"] == int((lengths > model.doc_limit(
            int(name.removeprefix("fixed_cp")) if name.startswith("fixed") else 8)).sum())
        assert b["rounds"] == plan.n_rounds
    assert rep["strategies"]["hybrid"]["documents_cut"] == 0
    assert rep["strategies"]["fixed_cp1"]["documents_cut"] > 0
    assert rep["baselines"]["megatron_hybrid"] == pytest.approx(
        rep["strategies"]["hybrid"]["est_step_time_total"]
        / rep["strategies"]["megatron_hybrid"]["est_step_time_total"])


def test_bench_json_keys_in_both_modes(tmp_path):
    bench = _bench()
    lengths = mixed_lengths(300, seed=2, cap=4096, pool=8)
    f = tmp_path / "l.npy"
    np.save(f, lengths)
    js = tmp_path / "h.json"
    assert bench.main(["--cp-mode", "hybrid", "--lengths", str(f), "--dp", "2", "--cp", "4",
                       "--rank-capacity", "4096", "--microbatches", "2", "--cost-model",
                       "llama-7b", "--json", str(js)]) == 0
    h = json.loads(js.read_text())
    assert h["cp_mode"] == "hybrid" and set(h["strategies"]) >= {
        "hybrid", "megatron_hybrid", "fixed_cp1", "fixed_cp8"}
    for b in h["strategies"].values():
        assert {"documents_cut", "exposed_comm_fraction", "est_step_time_total"} <= set(b)
    assert h["strategies"]["hybrid"]["documents_cut"] == 0
    # fixed mode, same pool and budget: capacity = cp x rank capacity, same unit of time
    jf = tmp_path / "f.json"
    assert bench.main(["--lengths", str(f), "--dp", "2", "--cp", "4", "--rank-capacity",
                       "4096", "--microbatches", "2", "--cost-model", "llama-7b",
                       "--over-length", "chunk", "--strategies", "balanced", "--repeats", "1",
                       "--json", str(jf)]) == 0
    fx = json.loads(jf.read_text())
    b = fx["strategies"]["balanced"]
    assert fx["layout"]["capacity"] == 4 * 4096
    assert b["documents_cut"] == b["samples_chunked"]
    assert 0 <= b["exposed_comm_fraction"] < 1
    # both est_step_time_total are seconds per GPU of the same pool: within a small factor
    ratio = b["est_step_time_total"] / h["strategies"]["fixed_cp4"]["est_step_time_total"]
    assert 0.5 < ratio < 2.0


@pytest.mark.parametrize("argv, needle", [
    (["--cp-mode", "hybrid", "--dp", "2", "--cp", "2"], "--rank-capacity"),
    (["--dp", "2", "--cp", "2", "--rank-capacity", "100", "--capacity", "300"], "capacity 300"),
    (["--cp-mode", "hybrid", "--dp", "2", "--rank-capacity", "100", "--cost-model",
      "quadratic-64k"], "--cost-model"),
    (["--cp-mode", "hybrid", "--dp", "2", "--rank-capacity", "100", "--cost-model", "llama-7b",
      "--strategies", "balanced"], "balanced"),
    (["--cp-mode", "hybrid", "--dp", "2", "--rank-capacity", "100", "--cost-model", "llama-7b",
      "--gpus-per-node", "3"], "--gpus-per-node"),
])
def test_bad_flags_are_one_line_naming_the_flag(tmp_path, capsys, argv, needle):
    f = tmp_path / "l.npy"
    np.save(f, np.array([10, 20, 30, 400], np.int64))
    assert _bench().main(argv + ["--lengths", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and needle in err and "\n" not in err


def test_layout_cp_mode_and_rank_capacity():
    from pydantic import ValidationError
    lay = Layout(dp=4, cp=2, capacity=8192, cp_mode="hybrid", rank_capacity=4096)
    assert lay.model_dump()["cp_mode"] == "hybrid" and lay.model_dump()["rank_capacity"] == 4096
    assert Layout(**lay.model_dump()) == lay
    # defaults dump exactly as before the fields existed (stored plans still match)
    assert set(Layout(dp=2, capacity=10).model_dump()) == {"dp", "pp", "cp", "microbatches",
                                                           "capacity"}
    assert "cp_mode" not in Layout(dp=2, cp=2, capacity=8, rank_capacity=4).model_dump()
    with pytest.raises(ValidationError, match="needs rank_capacity"):
        Layout(dp=2, capacity=10, cp_mode="hybrid")
    with pytest.raises(ValidationError, match="cp x rank_capacity"):
        Layout(dp=2, cp=2, capacity=10, rank_capacity=4)
    with pytest.raises(ValidationError):
        Layout(dp=2, capacity=10, cp_mode="dynamic")
    with pytest.raises(ValidationError):
        Layout(dp=2, capacity=10, rank_capacity=0)


def test_group_exchange_estimate_against_a_slow_reference():
    """exchange='group': one exchange per group and round for its sharded documents."""
    from balancer.cost.cp import _exposed
    model = CPCostModel.from_preset("llama-7b", 4096)
    lengths = mixed_lengths(300, seed=4, cap=4096, pool=8)
    for name in ("hybrid", "fixed_cp4"):
        plan, _ = plan_strategy(name, lengths, model, 8, 8 * 2 * 4096)
        items = plan.item_length
        tab = model.table(items, 8)
        parts = model.exchange_parts(items, 8)
        hw = model.hardware
        load = np.zeros((plan.n_rounds, 8))
        busy = np.zeros((plan.n_rounds, 8), bool)
        for r in range(plan.n_rounds):
            for g in range(plan.round_groups[r], plan.round_groups[r + 1]):
                off, size = int(plan.group_offset[g]), int(plan.group_size[g])
                k = int(np.log2(size))
                b = af = ab = 0.0
                n_sh = 0
                for e in range(plan.group_entries[g], plan.group_entries[g + 1]):
                    it, own = int(plan.entry_item[e]), int(plan.entry_owner[e])
                    if own < 0 and size > 1:
                        load[r, off:off + size] += tab.compute[it, k]
                        busy[r, off:off + size] = True
                        b += parts.bytes_s[it, k]
                        af += parts.attn_f[it, k]
                        ab += parts.attn_b[it, k]
                        n_sh += 1
                    else:
                        load[r, off + max(own, 0)] += tab.compute[it, 0]
                        busy[r, off + max(own, 0)] = True
                if n_sh:
                    t_f = b + parts.latency[k]
                    t_b = hw.backward_exchange * t_f
                    load[r, off:off + size] += _exposed(t_f, af, hw.overlap) + _exposed(
                        t_b, ab, hw.overlap)
        want = (load + tab.round_constant * busy).max(axis=1).sum()
        got = estimate(plan, model, lengths, exchange="group")
        assert got.step_time == pytest.approx(want, rel=1e-9)
        per_doc = estimate(plan, model, lengths)
        assert got.step_time <= per_doc.step_time * (1 + 1e-12)
    with pytest.raises(ValueError, match="exchange"):
        estimate(plan, model, lengths, exchange="ring")


def test_public_names():
    import balancer
    from balancer.loader.hybrid import HybridBatchSampler
    assert balancer.HybridBatchSampler is HybridBatchSampler
    for name in ("HybridCollator", "CPCostModel", "CPHardware", "plan_hybrid", "plan_fixed_cp",
                 "plan_megatron_hybrid", "estimate"):
        assert name in balancer.__all__ and getattr(balancer, name) is not None


def test_hybrid_mode_over_length(tmp_path, capsys):
    """A document longer than the pool holds: an error naming it by default, cut and counted
    with --over-length chunk; the report defaults its CP cost model to llama-7b."""
    f = tmp_path / "l.npy"
    np.save(f, np.array([100, 9000, 30, 7], np.int64))
    base = ["report", "--cp-mode", "hybrid", "--lengths", str(f), "--dp", "2",
            "--rank-capacity", "1024", "--no-plots", "--out", str(tmp_path / "r"),
            "--strategies", "hybrid,megatron_hybrid"]
    assert cli.main(base) == 2
    err = capsys.readouterr().err
    assert "sample 1: length 9000 exceeds the pool's limit of 2048" in err
    assert cli.main(base + ["--over-length", "chunk"]) == 0
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert rep["cost_model"] == "llama-7b"
    for b in rep["strategies"].values():
        assert b["valid"] and b["documents_cut"] == 1


def test_cost_models_without_a_model_mapping_and_odd_pools_are_named():
    """quadratic-64k is a valid cost model for fixed CP, but has no layers / heads for the K/V
    exchange: the CP cost model says so and lists the presets that work (it said 'unknown cost
    model', as for a typo); a pool that is not a power of two names its largest aligned group."""
    with pytest.raises(ValueError, match=r"cost model 'quadratic-64k' is a built-in formula "
                                         r"without a 'model:' mapping .* presets that have one: "
                                         r".*'llama-7b'"):
        CPCostModel.from_preset("quadratic-64k", 4096)
    with pytest.raises(ValueError, match=r"unknown cost model 'llama-7x': not a YAML file and "
                                         r"not one of .*'llama-70b'"):
        CPCostModel.from_preset("llama-7x", 4096)
    model = CPCostModel.from_preset("llama-7b", 100)
    with pytest.raises(ValueError, match=r"sample 1: length 500 exceeds the pool's limit of 400 "
                                         r"tokens \(its largest aligned group: 4 of the pool's 6 "
                                         r"ranks x rank_capacity 100"):
        check_pool_limit(np.array([5, 500]), model, 6)
    with pytest.raises(ValueError, match=r"exceeds the pool's limit of 400 tokens \(4 ranks x "
                                         r"rank_capacity 100"):
        check_pool_limit(np.array([5, 500]), model, 4)
