"""tools/bench_modelcost.py (issue #25 item 4): every row is scored under the right model and
the right model's own rows are the reference."""
import warnings

import pytest

from tools import bench_modelcost


def test_twins_of_a_sliding_and_an_moe_preset():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the shipped presets name every field they need
        t = bench_modelcost.twins("gpt-oss-20b")
    assert set(t) == {"right", "full-attention twin", "dense twin", "quadratic-64k"}
    assert {a.kind for a in t["right"].attention} == {"full", "sliding"}
    assert {a.kind for a in t["full-attention twin"].attention} == {"full"}
    assert t["dense twin"].forward.b > t["right"].forward.b  # 32 experts active, not 4


@pytest.mark.slow
def test_bench_rows(monkeypatch):
    monkeypatch.setattr(bench_modelcost, "WORKLOADS",
                        {"prolong": dict(dp=2, microbatches=2, capacity=65536)})
    rows = bench_modelcost.run(1500, 0, "balanced", ["mistral-7b-v0.1"])
    assert [r["planned_with"] for r in rows] == ["right", "full-attention twin", "quadratic-64k"]
    assert rows[0]["epoch_vs_right"] == 0.0 and rows[0]["own_estimate_error"] == 0.0
    assert rows[2]["own_estimate_seconds"] is None  # quadratic-64k has no clock
    assert all(r["epoch_seconds"] > 0 and r["dp_imbalance"] >= 1.0 for r in rows)
