"""One compiled signature per kernel: the public wrappers convert every argument to the one
dtype their kernel takes (int64 sizes, float64 costs, named tuples of those), and kernels call
each other with typed scalars (``np.int64(0)``, not ``0``: a Python literal compiles a
``Literal[int](0)`` specialisation of the callee beside its int64 one). Checked in a fresh
process compiling into an empty cache (a kernel loaded from the cache brings its callees inlined
and so never shows their signatures), after the warm-up and a representative workload whose
inputs come in other dtypes (int32 lengths, Python and numpy scalars, lists), so no test that
ran before in this process changes the count. Integer locals of kernels start typed
(``n = np.int64(0)``) for the same reason: a variable that starts as a literal is typed
``Literal[int]`` until inference widens it, and a callee reached on the way compiles for it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

WORKLOAD = r"""
import json
import numpy as np
from balancer.planning.warmup import kernels, warmup
warmup()
from balancer.config import Layout, PlannerConfig
from balancer.cost.cp import CPCostModel
from balancer.cost.model import CostModel
from balancer.planning.hybrid import default_strategies, plan_strategy
from balancer.planning.planner import plan_epoch
from balancer.samples import SampleTable
from balancer.strategies import registry
import packing
from packing.hybrid_cp import plan_batch, shelf_cost
from packing.hybrid_move import move_tall
from packing.zigzag_work import zigzag_max_pairs

rng = np.random.default_rng(0)
lengths = np.concatenate([rng.integers(16, 3000, 300), [40000, 20000, 9000]]).astype(np.int32)
rng.shuffle(lengths)
model = CPCostModel.from_preset("llama-7b", 4096)
for P in (8, 6):
    for name in default_strategies(P):
        if name == "megatron_hybrid" and P & (P - 1):
            continue
        plan_strategy(name, lengths, model, P, P * 2 * 4096, over_length="chunk")
P = 8
docs = np.minimum(lengths[:60], model.doc_limit(8))
tab = model.table(docs, P)
for kw in ({}, {"candidates": 3, "local_search": 0}, {"sizes": (2, 3)}, {"whole": False},
           {"fixed": 3, "whole": False}, {"fixed": 2, "whole": True}):
    plan_batch(tab.time, tab.tokens, np.int32(4096), np.int64(P), **kw)
tall = np.array([3, 1, 2], dtype=np.int32)
shelf_cost(tab.time, tab.tokens, 4096, 8, tall, 1e-6)
move_tall(tab.time, tab.tokens, 4096, 8, [1, 2, 3], [0, 0, 1], np.float32(1e-6), 2, 1)
zigzag_max_pairs(lengths.astype(np.int32), [1, 2, 4])
small = SampleTable(lengths)
for layout in (Layout(dp=2, microbatches=2, capacity=8192),
               Layout(dp=2, cp=2, microbatches=2, capacity=16384, sync="microbatch")):
    for name in registry.names():
        plan_epoch(small, CostModel.quadratic(4096), layout,
                   PlannerConfig(strategy=name, over_length="chunk"))
for dtype in (np.int32, np.int64, np.float64):
    sizes = np.array([3, 2, 2, 1, 5, 4], dtype=dtype)
    packing.first_fit_decreasing(sizes, 5)
    packing.best_fit_decreasing(sizes, 5)
    packing.next_fit(sizes, 5)
    packing.lpt_equal(sizes, 2)
    packing.kk_equal(sizes, 2)
    packing.balanced_equal(sizes, 2)
    packing.kk(sizes, 2)
print(json.dumps([[f"{k.__module__}.{k.__name__}", [str(s) for s in k.signatures]]
                  for k in kernels()]))
"""

@pytest.mark.slow
def test_one_signature_per_kernel(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env["BALANCER_NUMBA_CACHE_DIR"] = str(tmp_path)   # empty: every kernel compiles here
    r = subprocess.run([sys.executable, "-c", WORKLOAD], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    pairs = json.loads(r.stdout.strip().splitlines()[-1])
    sigs = dict(pairs)
    assert len(sigs) == len(pairs), "two kernels share a name"
    assert len(sigs) >= 60
    many = {k: v for k, v in sigs.items() if len(v) > 1}
    assert many == {}
    literal = {k: v for k, v in sigs.items() if any("Literal[" in s for s in v)}
    assert literal == {}
