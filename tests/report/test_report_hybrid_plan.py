"""``python -m balancer report --plan DIR`` on a hybrid DP x CP plan directory (``precompute
--cp-mode hybrid``): the report examines every plan the product writes. The stored plan's
figures are the ones ``report --cp-mode hybrid`` gives the same strategy planned afresh (the
stored plan is that plan), with the lengths from the command line, from the plan's own record
of its source, or, without either, from the plan's items (``lengths_known: false``)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from balancer.cli import main

FLAGS = ["--dp", "2", "--cp", "2", "--cp-mode", "hybrid", "--rank-capacity", "4096",
         "--cost-model", "llama-7b"]


@pytest.fixture(scope="module")
def plan(tmp_path_factory):
    d = tmp_path_factory.mktemp("hybrid")
    lengths = np.random.default_rng(3).integers(1, 6000, 600)
    np.save(d / "lengths.npy", lengths)
    rc = main(["precompute", "--lengths", str(d / "lengths.npy"), *FLAGS, "--epochs", "2",
               "--out", str(d / "plan")])
    assert rc == 0
    return d


def _report(out):
    return json.loads((out / "report.json").read_text())


def test_report_of_a_hybrid_plan(plan, capsys):
    out = plan / "rep"
    rc = main(["report", "--plan", str(plan / "plan"), "--out", str(out), "--no-plots"])
    assert rc == 0, capsys.readouterr().err
    r = _report(out)
    assert r["cp_mode"] == "hybrid"
    (name, block), = r["strategies"].items()
    assert name == "hybrid_stream (stored)"
    assert block["valid"]
    # the lengths the plan was made from, found through its manifest
    assert r["workload"]["lengths_known"] is True
    assert r["workload"]["samples"] == 600
    # the figures equal a fresh hybrid report's of the same strategy (the same plan)
    fresh = plan / "fresh"
    assert main(["report", "--lengths", str(plan / "lengths.npy"), *FLAGS,
                 "--strategies", "hybrid_stream", "--out", str(fresh), "--no-plots"]) == 0
    f = _report(fresh)["strategies"]["hybrid_stream"]
    for k in ("est_step_time_total", "documents_cut", "exposed_comm_fraction", "rounds",
              "steps", "group_size_histogram"):
        assert block[k] == f[k], k
    assert "hybrid_stream (stored)" in capsys.readouterr().out


def test_report_of_a_hybrid_plan_other_epoch_and_strategies(plan, capsys):
    out = plan / "rep1"
    assert main(["report", "--plan", str(plan / "plan"), "--epoch", "1", "--lengths",
                 str(plan / "lengths.npy"), "--strategies", "hybrid,megatron_hybrid",
                 "--out", str(out)]) == 0, capsys.readouterr().err
    r = _report(out)
    assert list(r["strategies"]) == ["hybrid_stream (stored)", "hybrid", "megatron_hybrid"]
    assert r["plan"]["epoch"] == 1
    assert all(b["valid"] for b in r["strategies"].values())
    assert (out / "hybrid_step_time.png").is_file()


def test_report_of_a_hybrid_plan_without_its_lengths(plan, tmp_path, capsys):
    # the plan moved to a machine without the lengths file: the report reads the plan alone
    import shutil
    moved = tmp_path / "plan"
    shutil.copytree(plan / "plan", moved)
    m = json.loads((moved / "manifest.json").read_text())
    src = m["extra"]["source"]["lengths"]
    shutil.move(src, tmp_path / "elsewhere.npy")
    try:
        out = tmp_path / "rep"
        assert main(["report", "--plan", str(moved), "--out", str(out), "--no-plots"]) == 0, \
            capsys.readouterr().err
        r = _report(out)
        assert r["workload"]["lengths_known"] is False
        assert r["workload"]["tokens"] == int(np.load(tmp_path / "elsewhere.npy").sum())
        # lengths that are not the plan's are refused, naming both fingerprints
        np.save(tmp_path / "other.npy", np.ones(600, np.int64))
        assert main(["report", "--plan", str(moved), "--lengths", str(tmp_path / "other.npy"),
                     "--out", str(out)]) == 2
        assert "fingerprint" in capsys.readouterr().err
    finally:
        shutil.move(tmp_path / "elsewhere.npy", src)


def test_report_of_a_fixed_plan_finds_its_lengths(tmp_path, capsys):
    # the .npy precompute records as its source: before, such a report had lengths_known false
    np.save(tmp_path / "l.npy", np.random.default_rng(4).integers(1, 3000, 400))
    assert main(["precompute", "--lengths", str(tmp_path / "l.npy"), "--dp", "2",
                 "--microbatches", "2", "--capacity", "4096", "--out",
                 str(tmp_path / "plan")]) == 0
    assert main(["report", "--plan", str(tmp_path / "plan"), "--out", str(tmp_path / "rep"),
                 "--no-plots"]) == 0, capsys.readouterr().err
    assert _report(tmp_path / "rep")["workload"].get("lengths_known", True) is True


def test_the_stored_plan_alone_gets_its_per_rank_plot(plan, capsys):
    # before: only the group-size and step-time plots, the stored plan not being among the
    # strategies the per-rank plot draws
    out = plan / "rep2"
    assert main(["report", "--plan", str(plan / "plan"), "--out", str(out)]) == 0, \
        capsys.readouterr().err
    assert (out / "hybrid_rank_time.png").is_file()
    assert "hybrid_rank_time.png" in (out / "report.md").read_text()


def test_loss_tokens_with_a_hybrid_plan_say_why(plan, capsys):
    # before: '... (leave out --cp-mode hybrid)', a flag this command line did not give
    np.save(plan / "lt.npy", np.ones(600, np.int64))
    rc = main(["report", "--plan", str(plan / "plan"), "--loss-tokens", str(plan / "lt.npy"),
               "--out", str(plan / "rep3"), "--no-plots"])
    err = capsys.readouterr().err
    assert rc == 2 and "hybrid" in err and "--cp-mode" not in err, err
