"""tools/prove_online.py's noise-free comparison (issue 26 item 4): the measured-true model
fitted on both runs' microbatches, each run's DP imbalance under it, the whole epoch planned
with each model and the paired differences. Synthetic observations from a known model: no
training run, no clock."""
import argparse

import numpy as np
import pytest

from balancer.cost.model import CostModel, PassCost
from balancer.cost.refit import coefficients
from tools import prove_online, train

TRUE = CostModel(name="true", unit="seconds",
                 forward=PassCost(a=4e-8, b=1.2e-5, c=1.5e-3, d=1e-4),
                 backward=PassCost(a=8e-8, b=2.5e-5, c=1e-3, d=2e-4))


def _obs(seed, steps=12, ranks=2, per_rank=2):
    """Observations timed exactly by TRUE: per step and rank ``per_rank`` microbatches."""
    rng = np.random.default_rng(seed)
    out = {k: [] for k in ("step", "rank", "seconds", "forward", "backward", "lengths")}
    for s in range(steps):
        for r in range(ranks):
            for _ in range(per_rank):
                lens = rng.integers(1, 900, rng.integers(1, 6))
                f, b = TRUE.microbatch_cost(lens)
                out["step"].append(s)
                out["rank"].append(r)
                out["lengths"].append(lens.tolist())
                out["forward"].append(f)
                out["backward"].append(b)
                out["seconds"].append(f + b)
    return out


def test_true_model_check_fits_both_runs_and_scores_each_plan():
    runs = {"online": _obs(0), "offline": _obs(1)}
    res, model = prove_online.true_model_check(runs, "quadratic-64k", skip=2, steady_from=4,
                                               replanned_from=6)
    for got, want in zip(coefficients(model), coefficients(TRUE)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-15)
    for tag, obs in runs.items():
        r = res[tag]
        assert r["fit_error"] < 1e-9
        # exact times: the model's imbalance is the measured one, step by step
        np.testing.assert_allclose(r["imbalance_per_step"], r["measured_imbalance_per_step"],
                                   atol=1e-5)
        step, rank = np.array(obs["step"]), np.array(obs["rank"])
        y = np.array(obs["seconds"])
        per = np.array([[y[(step == s) & (rank == k)].sum() for k in (0, 1)]
                        for s in range(12)])
        imb = per.max(1) / per.mean(1)
        assert r["imbalance_last10"] == pytest.approx(imb[-10:].mean(), abs=1e-5)
        assert r["imbalance_steady"] == pytest.approx(imb[4:].mean(), abs=1e-5)
        assert r["imbalance_replanned"] == pytest.approx(imb[6:].mean(), abs=1e-5)
    assert res["observations"] == 2 * 10 * 4 and res["replanned_from_step"] == 6


def test_plan_check_plans_the_epoch_with_each_model():
    args = train.parse_args(["--world", "2", "--samples", "300", "--scale", "0.02",
                             "--capacity", "512", "--calibrate-online", "--window-samples",
                             "40", "--steps", "12"])
    f, b = coefficients(TRUE)
    log = {"config": {k: v for k, v in vars(args).items()},
           "steps": [{}] * 12,
           "online_calibration": {"refits": [
               {"step": 5, "first_replanned_step": 7, "forward": (f * 2).tolist(),
                "backward": b.tolist()},
               {"step": 10, "first_replanned_step": 14, "forward": f.tolist(),
                "backward": b.tolist()}]}}
    res = prove_online.plan_check(log, "tiny-lm-cpu", TRUE)
    plans = res["plans"]
    # steps 2..11 were planned by refit-s5 (from step 7 on); refit-s10 planned none of them
    assert [k for k, v in plans.items() if v["planned_last_steps"]] == ["refit-s5"]
    assert set(plans) == {"measured-true", "tiny-lm-cpu", "final (refit-s10)", "refit-s5"}
    for v in plans.values():
        assert v["steps"] > 0 and v["imbalance_mean"] >= 1 and v["epoch_slowest_over_mean"] >= 1
    # refit-s10 is TRUE itself: its plan is the measured-true model's
    assert plans["final (refit-s10)"] == {**plans["measured-true"], "planned_last_steps": False}
    assert res["slices"]["count"] >= 1


def test_paired_differences():
    def pair(on, off):
        return {"offline_model": "p",
                "online": {"imbalance_measured_last10": on, "imbalance_measured_steady": on,
                           "compute_imbalance_last10": on},
                "offline": {"imbalance_measured_last10": off, "imbalance_measured_steady": off,
                            "compute_imbalance_last10": off},
                "true_model": {k: {"imbalance_last10": v, "imbalance_steady": v,
                                   "imbalance_replanned": v,
                                   "measured_imbalance_replanned": v}
                               for k, v in (("online", on), ("offline", off))}
                | {"plans": {"plans": {"p": {"epoch_slowest_over_mean": off,
                                             "planned_last_steps": False},
                                       "refit-s5": {"epoch_slowest_over_mean": on,
                                                    "planned_last_steps": True}}}}}
    out = prove_online.paired([pair(1.02, 1.03), pair(1.04, 1.03)])
    c = out["loop_clock_last10"]
    assert c["difference"] == pytest.approx([-0.01, 0.01])
    assert c["difference_mean"] == pytest.approx(0.0, abs=1e-12)
    assert c["difference_std"] == pytest.approx(np.std([-0.01, 0.01], ddof=1))
    assert c["online_no_worse"] == 1 and c["pairs"] == 2
    assert out["whole_epoch_last_models"]["difference"] == pytest.approx([-0.01, 0.01])
