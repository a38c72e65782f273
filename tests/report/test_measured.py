"""``python -m balancer report --measured FILE``: the closed loop's JSON lines (from a run on a
deterministic synthetic clock) become measured.json with per-step predicted vs measured step
times, DP imbalance and the refits' coefficients, and a PNG; bad lines are named."""
import json

import numpy as np
import pytest

from balancer import CostModel, Layout, PlannerConfig, SampleTable
from balancer.cli.app import main
from balancer.cost.model import PassCost
from balancer.loader.online import OnlineCalibrator, OnlineConfig
from balancer.loader.sampler import PackedBatchSampler
from balancer.loader.timing import MicrobatchTimer
from balancer.report.measured import read_measured

TRUE = CostModel(name="true", unit="seconds", forward=PassCost(a=4e-8, b=1.2e-5, c=1.5e-3),
                 backward=PassCost(a=8e-8, b=2.5e-5, c=1e-3))


def _measured_run(path, steps=24):
    lengths = np.random.default_rng(7).integers(1, 700, 400)
    s = PackedBatchSampler(SampleTable(lengths), CostModel.quadratic(65536),
                           Layout(dp=2, microbatches=2, capacity=1024),
                           PlannerConfig(seed=1, window_samples=40), dp_rank=0)
    now = [0.0]
    calib = OnlineCalibrator(s, MicrobatchTimer(clock=lambda: now[0]),
                             OnlineConfig(every=4, skip_steps=0), jsonl=path)
    done = 0
    for ref in s:
        f, b = TRUE.microbatch_cost(ref.lengths)
        calib.timer.begin(ref)
        now[0] += f + b
        calib.timer.end()
        if ref.slot == ref.step_microbatches - 1:
            calib.step_done()
            done += 1
            if done == steps:
                break


def test_report_measured(tmp_path, capsys):
    _measured_run(tmp_path / "m.jsonl")
    assert main(["report", "--measured", str(tmp_path / "m.jsonl"), "--out",
                 str(tmp_path / "rep")]) == 0
    out = json.loads((tmp_path / "rep" / "measured.json").read_text())
    assert (tmp_path / "rep" / "measured.png").stat().st_size > 0
    assert out["steps"] == list(range(24)) and len(out["refits"]) == 6
    err = out["prediction_error"]  # the wrong model (one scale) until the first refit, then exact
    assert min(err[:4]) > 1e-3 and max(err[4:]) < 1e-9 and out["prediction_error_last"] < 1e-9
    assert all(m > 0 for m in out["measured_step_s"])
    assert out["refits"][0]["columns"][0] == "per token^2"
    assert "6 refits" in capsys.readouterr().out


def test_bad_lines_are_named(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"type": "step", "step": 0}\n{"type": "other"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_measured(p)
    p.write_text("")
    with pytest.raises(ValueError, match="no step records"):
        read_measured(p)
