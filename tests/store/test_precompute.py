"""Parallel precompute is bit-identical to the single-process planner: with 1 and several
worker processes, with 2 torch.distributed (gloo) ranks, across planner block boundaries; the
window item stream equals the planner's; the command line merges configs and flags."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from balancer import Layout, PlannerConfig, SampleTable, load_cost_model, plan_epochs
from balancer.store import plan_store as store
from balancer.planning import planner
from balancer.cli import main
from balancer.store.precompute import EpochWindows, precompute

from test_store import assert_same_plan
from tests.common.gloo import run_ranks

COST = load_cost_model("quadratic-64k")


def lengths_with_outliers(n, seed=3, long_frac=0.01, cap=8192):
    rng = np.random.default_rng(seed)
    return np.where(rng.random(n) < long_frac, rng.integers(cap, 5 * cap, n),
                    rng.integers(1, cap // 3, n))


CASES = {
    "balanced-chunk-carry-cp2": (Layout(dp=4, pp=2, cp=2, microbatches=2, capacity=8192),
                                 PlannerConfig(over_length="chunk", tail="carry",
                                               window_samples=1500)),
    "balanced-drop-rank-units": (Layout(dp=4, microbatches=3, capacity=8192),
                                 PlannerConfig(over_length="chunk", tail="drop",
                                               window_samples=2000)),
    "sequential-samples-budget": (Layout(dp=2, microbatches=2, capacity=8192),
                                  PlannerConfig(strategy="sequential", over_length="chunk",
                                                global_batch_samples=40, window_samples=1777)),
    "ffd-one-window": (Layout(dp=2, microbatches=2, capacity=8192),
                       PlannerConfig(strategy="ffd_tokens", over_length="chunk", tail="carry")),
}


@pytest.fixture(scope="module")
def samples():
    return SampleTable(lengths_with_outliers(6000))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("workers", [1, 3])
def test_precompute_equals_plan_epochs(samples, tmp_path, case, workers):
    layout, config = CASES[case]
    ref = plan_epochs(samples, COST, layout, config, 2)
    out = precompute(samples, COST, layout, config, tmp_path / "p", epochs=2, workers=workers)
    m = store.load_manifest(out)
    assert m["precompute"]["windows"][0] == len(EpochWindows(samples.lengths, layout, config,
                                                             0).windows)
    for p in ref:
        q, _ = store.load_plan(out, p.epoch)
        assert_same_plan(q, p)
        assert {k: v for k, v in q.stats.items() if k != "plan_seconds"} == \
            {k: v for k, v in p.stats.items() if k != "plan_seconds"}
    assert not list(tmp_path.glob(".*partial*"))


def test_microbatch_costs_identical_across_planner_blocks(samples, tmp_path, monkeypatch):
    # the planner sums document costs block by block; windows straddle those blocks
    from balancer.cost import blocks
    monkeypatch.setattr(blocks, "_BLOCK", 1000)
    layout, config = CASES["balanced-chunk-carry-cp2"]
    config = config.model_copy(update={"window_samples": 1234})
    ref = plan_epochs(samples, COST, layout, config, 1)[0]
    out = precompute(samples, COST, layout, config, tmp_path / "p", workers=2)
    q, _ = store.load_plan(out, 0)
    assert_same_plan(q, ref)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 300), window=st.integers(1, 120), seed=st.integers(0, 10**6),
       cp=st.sampled_from([1, 2, 4]), n_carry=st.integers(0, 7), shuffle=st.booleans())
def test_window_items_equal_the_epoch_stream(n, window, seed, cp, n_carry, shuffle):
    lengths = lengths_with_outliers(n, seed, long_frac=0.2, cap=64)
    layout = Layout(dp=1, cp=cp, capacity=64)
    config = PlannerConfig(over_length="chunk", window_samples=window, seed=seed,
                           shuffle=shuffle)
    carry = planner.Items(np.arange(n_carry, dtype=np.int64), np.zeros(n_carry, np.int64),
                          np.full(n_carry, 5, np.int64))
    ref = planner.epoch_stream(SampleTable(lengths), COST, layout, config, 1, carry)
    ew = EpochWindows(lengths, layout, config, 1, carry, block=7)
    assert ew.windows == ref.windows(config)
    assert ew.stats == ref.stats
    for lo, hi in ew.windows:
        it = ew.items(lo, hi)
        for f in ("sample", "start", "length"):
            assert np.array_equal(getattr(it, f), getattr(ref.items, f)[lo:hi])


def test_over_length_error_is_the_planners(tmp_path):
    lengths = np.array([10, 20, 9000, 30, 9999])
    layout, config = Layout(capacity=8192), PlannerConfig(over_length="error")
    with pytest.raises(ValueError) as ref:
        plan_epochs(SampleTable(lengths), COST, layout, config)
    with pytest.raises(ValueError) as got:
        precompute(SampleTable(lengths), COST, layout, config, tmp_path / "p")
    assert str(got.value) == str(ref.value)
    assert not (tmp_path / "p").exists() and not list(tmp_path.glob(".*partial*"))


# ---- torch.distributed ----------------------------------------------------------------------
def _rank_main(rank, world, out_dir, lengths):
    layout, config = CASES["balanced-chunk-carry-cp2"]
    precompute(SampleTable(lengths), COST, layout, config, str(Path(out_dir) / "plan"), epochs=2)
    (Path(out_dir) / f"rank{rank}.ok").write_text("ok")


def test_distributed_two_gloo_ranks_equal_plan_epochs(samples, tmp_path):
    run_ranks(_rank_main, 2, tmp_path, samples.lengths, timeout_s=240)  # a failing rank raises
    out = tmp_path / "plan"
    results = {r: (tmp_path / f"rank{r}.ok").read_text() for r in range(2)}
    assert results == {0: "ok", 1: "ok"}
    layout, config = CASES["balanced-chunk-carry-cp2"]
    m = store.load_manifest(out)
    assert m["precompute"]["world_size"] == 2
    for p in plan_epochs(samples, COST, layout, config, 2):
        q_, _ = store.load_plan(out, p.epoch)
        assert_same_plan(q_, p)


# ---- command line ---------------------------------------------------------------------------
def test_cli_config_then_flags_then_inspect(samples, tmp_path, capsys):
    npy = tmp_path / "lengths.npy"
    np.save(npy, samples.lengths)
    cfg = tmp_path / "job.yaml"
    cfg.write_text("layout: {dp: 8, microbatches: 2, capacity: 8192}\n"
                   "planner: {over_length: chunk, window_samples: 2000, tail: carry}\n"
                   f"workload: {{lengths: {npy}}}\nepochs: 2\n")
    out = tmp_path / "plan"
    assert main(["precompute", "--config", str(cfg), "--dp", "2", "--max-delay", "3",
                 "--no-lookahead", "--out", str(out), "--workers", "2", "--no-progress"]) == 0
    m = store.load_manifest(out)
    assert m["layout"]["dp"] == 2 and m["layout"]["microbatches"] == 2
    assert m["config"]["max_delay"] == 3 and m["config"]["lookahead"] is False
    assert m["config"]["window_samples"] == 2000 and len(m["epochs"]) == 2
    layout = Layout(dp=2, microbatches=2, capacity=8192)
    config = PlannerConfig(over_length="chunk", window_samples=2000, tail="carry", max_delay=3,
                           lookahead=False)
    for p in plan_epochs(samples, COST, layout, config, 2):
        assert_same_plan(store.load_plan(out, p.epoch)[0], p)
    capsys.readouterr()
    js = tmp_path / "s.json"
    assert main(["inspect", str(out), "--json", str(js)]) == 0
    text = capsys.readouterr().out
    assert "microbatch_imbalance" in text and "packing efficiency" in text
    rep = json.loads(js.read_text())["epochs"]
    assert rep[1]["microbatches"] == m["epochs"][1]["summary"]["microbatches"]
    bad = tmp_path / "bad.yaml"
    bad.write_text("dp: 2\ncapacty: 10\n")
    assert main(["precompute", "--config", str(bad), "--lengths", str(npy), "--out",
                 str(tmp_path / "x")]) == 2
    assert "unknown key 'capacty'" in capsys.readouterr().err


def test_cli_config_takes_a_shipped_layout_by_name(tmp_path, capsys, monkeypatch):
    # the README's --config configs/layouts/dp8-pp4-cp2-7b.yaml exists only in a clone; the
    # layouts ship as package data, so a wheel installed anywhere takes them by name
    monkeypatch.chdir(tmp_path)  # no configs/ folder here
    npy = tmp_path / "lengths.npy"
    np.save(npy, lengths_with_outliers(3000, cap=131072))
    out = tmp_path / "plan"
    assert main(["precompute", "--config", "dp8-pp4-cp2-7b", "--lengths", str(npy),
                 "--over-length", "chunk", "--out", str(out), "--no-progress"]) == 0
    m = store.load_manifest(out)
    assert (m["layout"]["dp"], m["layout"]["pp"], m["layout"]["cp"],
            m["layout"]["microbatches"]) == (8, 4, 2, 4)
    assert m["cost_model"]["name"] == "llama-7b"
    capsys.readouterr()
    assert main(["precompute", "--config", "no-such-layout", "--lengths", str(npy),
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--config no-such-layout" in err
    assert "dp8-pp4-cp2-7b" in err and "dp64-32k" in err  # names the shipped layouts


@pytest.mark.parametrize("text,msg", [
    ("layout: [1,\n", r"job\.yaml: not valid YAML \(line \d+, column \d+\)"),
    ("layout:\n  dp: !!python/object:os.system x\n", r"job\.yaml: not plain YAML"),
    ("- 1\n- 2\n", r"job\.yaml: .*mapping"),
    ("\xff\xfe", r"job\.yaml"),
])
def test_cli_config_yaml_errors_are_one_line_naming_the_file(tmp_path, capsys, text, msg):
    import re
    cfg = tmp_path / "job.yaml"
    cfg.write_bytes(text.encode("latin-1"))
    npy = tmp_path / "lengths.npy"
    np.save(npy, np.arange(1, 100))
    assert main(["precompute", "--config", str(cfg), "--lengths", str(npy), "--capacity",
                 "8192", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and re.search(msg, err), err


def test_cli_dataset_sources(tmp_path):
    import datasets
    lengths = lengths_with_outliers(300, long_frac=0.0)
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"length": lengths}).save_to_disk(str(saved))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": list(range(int(n)))}) + "\n"
                            for n in lengths))
    want = SampleTable(lengths).fingerprint()
    for src in (saved, rows):
        out = tmp_path / f"plan-{src.name}"
        assert main(["precompute", "--dataset", str(src), "--capacity", "8192", "--out",
                     str(out), "--no-progress", "--strategies", "balanced"]) == 0
        m = store.load_manifest(out)
        assert m["dataset"] == {"fingerprint": want, "n_samples": 300,
                                "total_tokens": int(lengths.sum())}
        assert Path(out).is_dir()


def test_cli_overwrite_refuses_a_directory_that_is_not_a_plan(samples, tmp_path, capsys):
    npy = tmp_path / "lengths.npy"
    np.save(npy, samples.lengths[:500])
    notes = tmp_path / "notes"
    (notes / "sub").mkdir(parents=True)
    (notes / "sub" / "keep.txt").write_text("mine")
    args = ["precompute", "--lengths", str(npy), "--capacity", "8192", "--no-progress",
            "--over-length", "chunk",
            "--overwrite", "--out"]
    assert main(args + [str(notes)]) == 2
    err = capsys.readouterr().err
    assert str(notes) in err and "not a plan directory" in err and "refusing" in err
    assert (notes / "sub" / "keep.txt").read_text() == "mine"
    out = tmp_path / "plan"
    assert main(args + [str(out)]) == 0 and main(args + [str(out)]) == 0
    assert not list(tmp_path.glob(".*"))


def test_cli_sync_flag_plans_and_stores_the_lockstep_layout(samples, tmp_path, capsys):
    """--sync microbatch (FSDP / ZeRO-3: the ranks wait per microbatch) reaches the planner and
    the manifest from the flag and from --config, and a config's sync is kept when no flag is
    given (before, only a --config YAML could set it and report/compare could not)."""
    npy = tmp_path / "lengths.npy"
    np.save(npy, samples.lengths)
    args = ["--lengths", str(npy), "--dp", "4", "--microbatches", "2", "--capacity", "8192",
            "--over-length", "chunk", "--no-progress"]
    assert main(["precompute", *args, "--sync", "microbatch", "--out", str(tmp_path / "a")]) == 0
    assert store.load_manifest(tmp_path / "a")["layout"]["sync"] == "microbatch"
    lay = Layout(dp=4, microbatches=2, capacity=8192, sync="microbatch")
    cfg = PlannerConfig(over_length="chunk")
    want = plan_epochs(samples, COST, lay, cfg, 1)[0]
    assert_same_plan(store.load_plan(tmp_path / "a", 0)[0], want)
    step = plan_epochs(samples, COST, lay.model_copy(update={"sync": "step"}), cfg, 1)[0]
    assert not np.array_equal(step.mb_fwd, want.mb_fwd)  # the flag changed the plan
    yml = tmp_path / "job.yaml"
    yml.write_text("layout: {sync: microbatch}\n")
    assert main(["precompute", "--config", str(yml), *args, "--out", str(tmp_path / "b")]) == 0
    assert store.load_manifest(tmp_path / "b")["layout"]["sync"] == "microbatch"
    with pytest.raises(SystemExit) as e:
        main(["compare", *args[:-1], "--sync", "bogus"])
    assert e.value.code == 2 and "--sync: invalid choice: 'bogus'" in capsys.readouterr().err
