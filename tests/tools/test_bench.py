"""tools/bench.py (issue 27 item 6): per workload and strategy the packing efficiency, its hard
limit and the gap to it, and the costliest DP rank's gap to the step's lower bound, simple and
capacity-aware, in the table and the JSON."""
import json

import numpy as np

from tools import bench


def test_efficiency_limit_and_lower_bound_gap_per_strategy(tmp_path, capsys):
    lengths = np.random.default_rng(0).integers(1, 8192, 3000)
    f = tmp_path / "l.npy"
    np.save(f, lengths)
    js = tmp_path / "b.json"
    assert bench.main(["--lengths", str(f), "--dp", "4", "--microbatches", "2",
                          "--capacity", "8192", "--strategies", "sequential,balanced",
                          "--repeats", "1", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert "efficiency / hard limit" in out and "capacity-aware" in out
    assert "efficiency / L2 limit" in out
    doc = json.loads(js.read_text())
    assert set(doc["strategies"]) == {"sequential", "balanced"}
    for v in doc["strategies"].values():
        assert 0 < v["packing_efficiency"] <= v["efficiency_hard_limit"] <= 1
        assert v["efficiency_gap_points"] == 100 * (v["efficiency_hard_limit"]
                                                    - v["packing_efficiency"])
        # the L2 bound: at least the hard bound's microbatches, so a limit no higher
        assert v["microbatches_l2_bound"] >= v["microbatches_hard_bound"] > 0
        assert v["microbatches_l2_bound"] % 4 == 0
        assert 0 < v["packing_efficiency"] <= v["efficiency_l2_limit"] \
            <= v["efficiency_hard_limit"]
        assert v["efficiency_l2_gap_points"] == 100 * (v["efficiency_l2_limit"]
                                                       - v["packing_efficiency"])
        tight, simple = v["capacity_lower_bound_ratio"], v["lower_bound_ratio"]
        assert 1 - 1e-9 <= tight["mean"] <= simple["mean"] * (1 + 1e-12)
        assert v["steps_over_1pct_capacity_bound"] <= v["steps_over_1pct_lower_bound"] \
            <= v["steps"]
    b = doc["strategies"]["balanced"]
    seq = doc["strategies"]["sequential"]
    assert b["lower_bound_ratio"]["mean"] < seq["lower_bound_ratio"]["mean"]


def test_speed_reports_the_ratio_of_minima():
    """The speed line's figures: medians of paired ratios (wall and CPU) and the best plan over
    the best argsort, each strategy timed ``repeats`` times next to its own argsort."""
    sp = bench.speed(3000, 64, 4, 32768, 2)
    assert sp["argsort_seconds_min"] <= sp["argsort_seconds"]
    for v in sp["strategies"].values():
        assert 0 < v["plan_seconds_min"] <= v["plan_seconds"]
        assert v["ratio_of_minima"] == v["plan_seconds_min"] / sp["argsort_seconds_min"]
        assert v["ratio_to_argsort"] > 0 and v["cpu_ratio_to_argsort"] > 0
