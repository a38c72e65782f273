"""The loader's collator, CP sharder and adapters import neither numba nor the planner (issue
#12): a training process that only reads a stored plan never compiles a kernel."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("numba", "balancer.planning.planner", "balancer.planning.stream", "balancer.report")


@pytest.mark.parametrize("modules", [
    "balancer",
    "balancer.loader",
    "balancer.loader.collate, balancer.loader.cp_shard, balancer.loader.adapters",
    "balancer.loader.sampler",
    "balancer.planning.plan, balancer.zigzag, balancer.cost.model, packing.validate",
])
def test_no_numba_and_no_planner(modules):
    code = (f"import sys\nimport {modules}\n"
            f"bad = [m for m in {HEAVY!r} if m in sys.modules]\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr


def test_public_names_still_resolve():
    import balancer
    from balancer import (CostModel, FlatTokens, Items, Layout, MicrobatchRef, ModelSpec,  # noqa
                          PackedBatchSampler, PackedCollator, PackedDataset, PassCost, Plan,
                          PlannerConfig, SampleTable, epoch_order, load_cost_model, plan_epoch,
                          plan_epochs)
    for n in balancer.__all__:
        assert getattr(balancer, n) is not None, n
    from balancer.planning import planner
    assert plan_epoch is planner.plan_epoch and Plan is planner.Plan
