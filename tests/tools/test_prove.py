"""The proof tool: its figures are computed right from trainer logs and plans, and a short
2-rank run of both strategies yields a complete report whose loss curves agree."""
import json
from pathlib import Path

import numpy as np
import pytest

from balancer import Layout, PlannerConfig, SampleTable, plan_epoch  # noqa: E402
from balancer.cost.calibration import Calibration, write_preset  # noqa: E402
from balancer.cost.model import PassCost, load_cost_model  # noqa: E402
from tools import prove  # noqa: E402


def test_measured_block_step_time_is_slowest_rank():
    log = {"steps": [{"compute_s": [9.0, 1.0], "tokens": [5, 5]},
                     {"compute_s": [1.0, 3.0], "tokens": [4, 6]},
                     {"compute_s": [2.0, 2.0], "tokens": [7, 3]}]}
    m = prove.measured_block(log, skip=1)
    assert m["step_time"] == [9.0, 3.0, 2.0]
    assert m["step_time_total"] == 5.0 and m["step_time_mean"] == 2.5
    assert m["dp_imbalance"]["max"] == pytest.approx(1.5)  # 3 / mean(1, 3)
    assert m["dp_imbalance"]["mean"] == pytest.approx(1.25)
    assert m["tokens"] == 20 and m["compute_total"] == 8.0


def test_predicted_block_is_the_plans_rank_cost():
    cost = load_cost_model("quadratic-64k")
    lengths = np.random.default_rng(0).integers(1, 900, 400)
    plan = plan_epoch(SampleTable(lengths), cost, Layout(dp=2, microbatches=2, capacity=1024),
                      PlannerConfig(strategy="sequential", seed=0), epoch=0)
    p = prove.predicted_block(plan, cost, n_steps=5, skip=1)
    mb = plan.mb_fwd + plan.mb_bwd  # the planner's own per-microbatch costs
    for s in range(5):
        want = [mb[plan.microbatch_ids(s, r)].sum() for r in range(2)]
        np.testing.assert_allclose(p["rank_time"][s], want, rtol=1e-12)
    rt = np.array(p["rank_time"])
    assert p["step_time_total"] == pytest.approx(rt[1:].max(axis=1).sum())
    assert p["dp_imbalance"]["mean"] == pytest.approx(
        (rt[1:].max(axis=1) / rt[1:].mean(axis=1)).mean())


def test_loss_agreement_figures():
    base = [5.0, 4.0, 3.0, 2.6, 2.4, 2.2]
    other = [5.1, 4.1, 3.1, 2.7, 2.5]  # fewer, fuller steps: same tokens
    la = prove.loss_agreement({"sequential": base, "balanced": other},
                              {"sequential": [10] * 6, "balanced": [12] * 5}, final_fraction=0.5)
    s, b = la["strategies"]["sequential"], la["strategies"]["balanced"]
    assert s["final_steps"] == 3 and s["final_mean"] == pytest.approx(2.4)
    assert s["noise"] == pytest.approx(0.2 / np.sqrt(3))
    want = (3.1 + 2.7 + 2.5) / 3  # steps 2..4 end past 30 of 60 tokens
    assert b["final_steps"] == 3 and b["final_mean"] == pytest.approx(want)
    assert b["final_mean_rel_diff"] == pytest.approx((want - 2.4) / 2.4)
    se = np.hypot(b["noise"], s["noise"])
    assert b["final_mean_diff_over_noise"] == pytest.approx((want - 2.4) / se)
    assert s["final_mean_diff_over_noise"] == 0.0


@pytest.mark.slow
def test_two_rank_proof_run_reports_both_strategies(tmp_path):
    preset = write_preset(Calibration(forward=PassCost(a=2e-8, b=1e-5, c=1e-3),
                                      backward=PassCost(a=4e-8, b=2e-5, c=1e-3)),
                          tmp_path / "cal.yaml")
    args = prove.parse_args([
        "--cost-model", str(preset), "--worlds", "2", "--samples", "160", "--scale", "0.02",
        "--capacity", "512", "--microbatches", "2", "--steps", "6", "--dim", "32", "--layers", "1",
        "--heads", "2", "--vocab", "32", "--lr", "1e-2", "--timeout", "120", "--repeats", "2",
        "--order-seeds", "1",
        "--out", str(tmp_path / "out")])
    rep = prove.run(args)
    assert json.loads((tmp_path / "out" / "prove.json").read_text()) == json.loads(json.dumps(rep))
    md = (tmp_path / "out" / "prove.md").read_text()
    assert "| sequential |" in md and "| balanced |" in md
    w = rep["worlds"]["2"]
    assert set(w["strategies"]) == {"sequential", "balanced"}
    for s, r in w["strategies"].items():
        assert r["steps"] == 6 and r["plan_matches_trainer"], s
        m, p = r["measured"], r["predicted"]
        assert len(m["compute_s"]) == 6 and all(len(c) == 2 and min(c) > 0 for c in m["compute_s"])
        assert m["dp_imbalance"]["mean"] >= 1.0 and p["dp_imbalance"]["mean"] >= 1.0
        assert p["unit"] == "seconds" and p["step_time_total"] > 0
        assert r["loss"][-1] < r["loss"][0], s  # both learn
        assert r["loss_repeatable"], s  # same plan and seed: the same losses in every run
        assert len(m["repeats"]) == 2 and m["step_time_total"] in m["repeats"]
    assert w["speedup"]["sequential"]["measured"] == pytest.approx(1.0)
    runs = w["speedup"]["balanced"]["measured_runs"]
    assert len(runs) == 2 and w["speedup"]["balanced"]["measured"] == pytest.approx(np.median(runs))
    keys = {"measured", "predicted", "relative_gap", "measured_load_normalised"}
    assert keys <= set(w["speedup"]["balanced"])
    # balancing changes the order inside and around steps, not what is learned: after 6 steps
    # the final losses differ by less than 3 standard errors of their own noise (a relative
    # bound would be flaky this early in training)
    ea = w["eval_agreement"]  # held-out loss after steps 4 and 6, in 2 shuffle orders each
    assert ea["orders"] == 2 and ea["step"] == 6
    for s in ("sequential", "balanced"):
        curves = ea["curves"][s]
        assert len(curves) == 2 and all(len(c["loss"]) == 2 for c in curves)
        assert curves[0] != curves[1]  # another order, another run
        assert ea["end"][s]["values"] == [c["loss"][-1] for c in curves]
        assert ea["equal_steps"][s]["values"] == ea["end"][s]["values"]  # both ran 6 steps
        assert ea["end"][s]["mean"] < 0.95 * np.log(32)  # below the uniform guess: it learned
    b = ea["equal_steps"]["balanced"]
    assert b["diff"] == pytest.approx(b["mean"] - ea["equal_steps"]["sequential"]["mean"])
    assert "Held-out loss" in md
    la = w["loss_agreement"]["strategies"]["balanced"]
    assert la["final_mean_diff_over_noise"] < 3 and la["final_mean_rel_diff"] < 0.15


def test_eval_agreement_compares_the_last_step_every_run_evaluated():
    # evaluations every 4 steps plus one after the last step: a 49-step run ends with an
    # off-cycle evaluation (step 49) that a 53-step run never made; "equal steps" is step 48
    def curve(last, losses):
        steps = list(range(4, last + 1, 4)) + ([last] if last % 4 else [])
        return {"steps": steps, "tokens": [10 * s for s in steps], "loss": losses(steps)}

    seq = [curve(53, lambda st: [10.0 - 0.1 * s for s in st]) for _ in range(2)]
    bal = [curve(49, lambda st: [10.0 - 0.1 * s + 0.01 for s in st]),
           curve(49, lambda st: [10.0 - 0.1 * s + 0.03 for s in st])]
    ea = prove.eval_agreement({"sequential": seq, "balanced": bal})
    assert ea["step"] == 48
    assert ea["equal_steps"]["sequential"]["values"] == [pytest.approx(10.0 - 4.8)] * 2
    assert ea["equal_steps"]["balanced"]["diff"] == pytest.approx(0.02)
    assert ea["end"]["balanced"]["values"] == [pytest.approx(10.0 - 4.9 + 0.01),
                                               pytest.approx(10.0 - 4.9 + 0.03)]
    assert ea["end"]["sequential"]["mean"] == pytest.approx(10.0 - 5.3)


def test_model_flags_are_the_trainers():
    # the proof passes its model flags on to tools/train.py: a mode the model does not have is
    # refused when the flags are read, not ranks later
    with pytest.raises(SystemExit):
        prove.parse_args(["--attention", "flash"])
    args = prove.parse_args(["--attention", "loop", "--dim", "32"])
    targs = prove.train_args(args, "balanced", 2, Path("data"), Path("log.json"))
    assert (targs.attention, targs.dim, targs.vocab) == ("loop", 32, 256)
