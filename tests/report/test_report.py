"""The report command end to end: files, the stable JSON shape, invalid plans, stored plans."""
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from balancer import Layout, PlannerConfig, SampleTable, load_cost_model, plan_epoch
from balancer.report import build as R
from balancer.cli import main

ROOT = Path(__file__).resolve().parents[2]
SUMMARY = {"mean", "p50", "p90", "p99", "max"}
STABLE = {"plan_seconds": float, "steps": int, "samples_planned": int, "samples_lost": int,
          "samples_duplicated": int, "packing_efficiency": float,
          "est_step_time_total": float}
DISTS = ("microbatch_imbalance", "dp_imbalance", "cp_imbalance", "pp_bubble_fraction",
         "lower_bound_ratio")
PNGS = ("steps.png", "ranks.png", "gantt.png", "lengths.png")


def _lengths(n=6000, seed=0):
    rng = np.random.default_rng(seed)
    x = np.where(rng.random(n) < 0.01, rng.integers(4000, 20000, n),
                 rng.lognormal(np.log(300), 1.0, n))
    return np.maximum(x.astype(np.int64), 1)


def _assert_png(path: Path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    w, h = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert w >= 800 and h >= 400, (path, w, h)


def test_cli_report_of_a_lengths_file(tmp_path):
    lengths = _lengths()
    np.save(tmp_path / "lens.npy", lengths)
    out = tmp_path / "rep"
    r = subprocess.run([sys.executable, "-m", "balancer", "report", "--lengths",
                        str(tmp_path / "lens.npy"), "--capacity", "8192", "--dp", "2", "--pp", "2",
                        "--cp", "2", "--microbatches", "3", "--over-length", "chunk",
                        "--max-delay", "3", "--seed", "1", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "balanced" in r.stdout and "report written to" in r.stdout
    rep = json.loads((out / "report.json").read_text())
    assert rep["workload"] == {**rep["workload"], "samples": len(lengths),
                               "tokens": int(lengths.sum())}
    assert rep["layout"] == {"dp": 2, "pp": 2, "cp": 2, "microbatches": 3, "capacity": 8192}
    assert list(rep["strategies"]) == ["sequential", "ffd_tokens", "kk_tokens", "balanced"]
    for name, s in rep["strategies"].items():
        for k, t in STABLE.items():
            assert isinstance(s[k], (t, int) if t is float else t), (name, k)
        for k in DISTS:
            assert set(s[k]) >= SUMMARY and all(isinstance(s[k][q], float) for q in SUMMARY)
        assert set(s["outlier_delay_steps"]) >= {"mean", "max"}
        assert s["valid"] and s["samples_planned"] == len(lengths)
        assert s["samples_lost"] == s["samples_duplicated"] == 0
        assert s["microbatch_imbalance"]["p50"] >= 1.0
        assert s["prediction_max_rel_error"] < 1e-12
        # per-step series are the ones summarised
        ps = s["per_step"]
        assert len(ps["dp_imbalance"]) == s["steps"]
        assert np.isclose(np.mean(ps["dp_imbalance"]), s["dp_imbalance"]["mean"])
        assert sum(ps["samples"]) == len(lengths)
        g = s["gpu_time"]
        assert np.isclose(g["total"], g["useful"] + g["pp_bubble"] + g["dp_idle"])
    assert rep["speedup"]["sequential"] == 1.0 and rep["baseline"] == "sequential"
    md = (out / "report.md").read_text()
    assert "| balanced |" in md and "## Where the GPU time goes" in md
    for p in PNGS:
        _assert_png(out / p)
        assert f"]({p})" in md


def test_invalid_plan_is_marked_and_not_summarised(tmp_path):
    lengths = _lengths(3000, seed=2)
    cost = load_cost_model("quadratic-64k")
    lay = Layout(dp=2, pp=2, microbatches=2, capacity=32768)
    cfg = PlannerConfig(over_length="chunk")
    good = plan_epoch(SampleTable(lengths), cost, lay, cfg)
    # one sample lost (its entry removed), another duplicated (an entry copied next to it)
    k = 5
    lost = dataclasses.replace(
        good, entry_sample=np.delete(good.entry_sample, k),
        entry_start=np.delete(good.entry_start, k), entry_length=np.delete(good.entry_length, k),
        entry_delay=np.delete(good.entry_delay, k),
        mb_offsets=np.where(good.mb_offsets > k, good.mb_offsets - 1, good.mb_offsets))
    dup = dataclasses.replace(
        good, entry_sample=np.insert(good.entry_sample, k, good.entry_sample[k]),
        entry_start=np.insert(good.entry_start, k, good.entry_start[k]),
        entry_length=np.insert(good.entry_length, k, good.entry_length[k]),
        entry_delay=np.insert(good.entry_delay, k, 0),
        mb_offsets=np.where(good.mb_offsets > k, good.mb_offsets + 1, good.mb_offsets),
        layout=lay.model_copy(update={"capacity": 10 * lay.capacity}))
    rep, details = R.build_report(lengths, cost, lay, cfg, ["balanced"],
                                  plans={"lost": lost, "dup": dup})
    assert rep["strategies"]["lost"]["valid"] is False
    assert (rep["strategies"]["lost"]["samples_lost"],
            rep["strategies"]["lost"]["samples_duplicated"]) == (1, 0)
    assert (rep["strategies"]["dup"]["samples_lost"],
            rep["strategies"]["dup"]["samples_duplicated"]) == (0, 1)
    for name in ("lost", "dup"):
        s = rep["strategies"][name]
        assert "microbatch_imbalance" not in s and "est_step_time_total" not in s
        assert details[name] is None and name not in rep["speedup"]
    assert rep["strategies"]["balanced"]["valid"] and rep["baseline"] == "balanced"
    text = R.format_summary(rep)
    assert "lost" in text and "INVALID: 1 samples lost, 0 duplicated" in text
    R.write_report(rep, details, tmp_path, lengths, cost, plots=False)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["strategies"]["dup"]["valid"] is False
    assert on_disk["strategies"]["dup"]["samples_duplicated"] == 1
    assert "Invalid plans" in (tmp_path / "report.md").read_text()


def test_report_of_a_stored_plan(tmp_path, capsys):
    from balancer.store.plan_store import save_plan
    lengths = _lengths(4000, seed=3)
    np.save(tmp_path / "lengths.npy", lengths)
    cost = load_cost_model("llama-7b")
    lay = Layout(dp=2, pp=4, cp=2, microbatches=4, capacity=cost.capacity(2, 4))
    plan = plan_epoch(SampleTable(lengths), cost, lay, PlannerConfig(over_length="chunk"))
    save_plan(plan, tmp_path / "p1", cost=cost, extra={"lengths": str(tmp_path / "lengths.npy")})
    out = tmp_path / "out"
    assert main(["report", "--plan", str(tmp_path / "p1"), "--out", str(out), "--no-plots"]) == 0
    rep = json.loads((out / "report.json").read_text())
    s = rep["strategies"]["balanced (stored)"]
    assert s["valid"] and s["samples_planned"] == len(lengths)
    assert rep["layout"]["pp"] == 4 and rep["cost_model"] == "llama-7b"
    # without lengths the coverage is checked against what the plan itself implies
    save_plan(plan, tmp_path / "p2", cost=cost)
    assert main(["report", "--plan", str(tmp_path / "p2"), "--out", str(out), "--no-plots"]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["workload"]["lengths_known"] is False
    assert rep["strategies"]["balanced (stored)"]["valid"]
    # a stored plan with a lost sample: exit status 1, marked invalid, not summarised
    broken = dataclasses.replace(plan, entry_sample=plan.entry_sample[1:],
                                 entry_start=plan.entry_start[1:],
                                 entry_length=plan.entry_length[1:],
                                 entry_delay=plan.entry_delay[1:],
                                 mb_offsets=np.maximum(plan.mb_offsets - 1, 0))
    save_plan(broken, tmp_path / "p3", cost=cost,
              extra={"lengths": str(tmp_path / "lengths.npy")})
    assert main(["report", "--plan", str(tmp_path / "p3"), "--out", str(out), "--no-plots"]) == 1
    rep = json.loads((out / "report.json").read_text())
    assert rep["strategies"]["balanced (stored)"]["valid"] is False
    assert rep["strategies"]["balanced (stored)"]["samples_lost"] == 1
    assert "INVALID" in capsys.readouterr().out


def test_report_needs_a_workload(tmp_path, capsys):
    assert main(["report", "--out", str(tmp_path)]) == 2
    assert "--lengths" in capsys.readouterr().err


def test_demo_writes_the_report(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "report written to" in text and "speedup of balanced" in text
    rep = json.loads((out / "report.json").read_text())
    assert rep["layout"] == {**rep["layout"], "dp": 8, "pp": 4, "cp": 2, "microbatches": 4}
    assert all(s["valid"] for s in rep["strategies"].values())
    for p in PNGS:
        _assert_png(out / p)


def test_report_of_a_saved_dataset(tmp_path):
    import datasets
    lengths = _lengths(2000, seed=4)
    datasets.Dataset.from_dict({"length": lengths}).save_to_disk(str(tmp_path / "ds"))
    out = tmp_path / "out"
    assert main(["report", "--dataset", str(tmp_path / "ds"), "--capacity", "32768", "--dp", "2",
                 "--microbatches", "2", "--strategies", "sequential,balanced",
                 "--out", str(out), "--no-plots"]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["workload"]["samples"] == 2000 and rep["workload"]["tokens"] == int(lengths.sum())
    assert list(rep["strategies"]) == ["sequential", "balanced"]
    assert rep["strategies"]["balanced"]["speedup_vs_baseline"] > 0


def test_report_states_the_clock_its_seconds_rest_on():
    # seconds come from the cost model's flops_per_second (400 TFLOP/s in llama-7b): the JSON,
    # report.md and the terminal summary say so, and a model without a clock says it has none
    lengths = _lengths(3000, seed=2)
    cost = load_cost_model("llama-7b")
    layout = Layout(dp=2, microbatches=2, capacity=16384)
    rep, _ = R.build_report(lengths, cost, layout, PlannerConfig(over_length="chunk"),
                            ["sequential", "balanced"])
    assert rep["flops_per_second"] == cost.flops_per_second == 4.0e14
    assert "400 TFLOP/s" in rep["seconds_basis"] and "llama-7b" in rep["seconds_basis"]
    from balancer.report.markdown import render
    assert rep["seconds_basis"] in render(rep)
    assert "400 TFLOP/s" in R.format_summary(rep)
    plain = load_cost_model("quadratic-64k")
    rep, _ = R.build_report(lengths, plain, Layout(dp=2, microbatches=2, capacity=65536),
                            PlannerConfig(), ["sequential"])
    assert rep["flops_per_second"] is None and "no clock" in rep["seconds_basis"]


def test_report_of_lengths_needs_the_layout(tmp_path, capsys):
    # with no --dp and no --microbatches every step is one microbatch: every strategy would
    # be the same plan at imbalance 1.000, so the command asks for the layout instead
    np.save(tmp_path / "lens.npy", _lengths(500))
    argv = ["report", "--lengths", str(tmp_path / "lens.npy"), "--capacity", "8192",
            "--out", str(tmp_path / "r"), "--no-plots"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--dp" in err and "--microbatches" in err
    # an over-long sample: the error names the flag that cuts it, not the Python argument
    assert main([*argv, "--microbatches", "4", "--strategies", "sequential"]) == 2
    err = capsys.readouterr().err
    assert "--over-length chunk" in err and "over_length=" not in err, err
    assert main([*argv, "--microbatches", "4", "--strategies", "sequential",
                 "--over-length", "chunk"]) == 0
    rep = json.loads((tmp_path / "r" / "report.json").read_text())
    assert (rep["layout"]["dp"], rep["layout"]["microbatches"]) == (1, 4)
