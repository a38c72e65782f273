"""Set ``Layout.sync`` to how the trainer synchronises, and see what it changes (planner only):

    python examples/sync_balance.py                 # the four workloads, pp=1, dp=8
    python examples/sync_balance.py --samples 20000 # a resampled subset (faster)

``sync="step"`` (default): DDP with ``no_sync`` accumulation meets once per step, so
``balanced`` equalises per-rank sums. ``sync="microbatch"``: FSDP / ZeRO-3 (and DDP without
``no_sync``) meet after every microbatch, the step takes ``sum_k max_r cost[r, k]``, so every
microbatch is balanced. Printed per workload and sync: that per-microbatch lockstep imbalance
and the per-rank-sum imbalance (mean over steps; 1.0 = nobody waits), side by side, one run.
Tested with numpy 2.4, numba 0.6x (no torch model needed).
"""
import argparse

import numpy as np

from balancer import Layout, PlannerConfig, SampleTable, load_cost_model, plan_epoch, workloads
from balancer.integrations.sync import lockstep_imbalance, rank_sum_imbalance

from _common import TESTED_WITH, report

# (workload, samples or None for all, capacity): the bench suite's capacities
WORKLOADS = [("wlbllm", None, 131072), ("wikipedia", None, 32768), ("prolong", None, 65536),
             ("bimodal-sft", 500_000, 16384)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=None, help="resample every workload to N")
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=4)
    a = ap.parse_args()
    cost = load_cost_model("quadratic-64k")
    rows = {}
    print(f"pp=1 dp={a.dp} microbatches={a.microbatches} cost=quadratic-64k balanced, auto")
    print(f"{'workload':12s} | lockstep: step  microbatch | rank sums: step  microbatch")
    for name, n, cap in WORKLOADS:
        lengths = np.asarray(workloads.load(name, n=a.samples or n), dtype=np.int64)
        samples = SampleTable(lengths)
        got = {}
        for sync in ("step", "microbatch"):
            layout = Layout(dp=a.dp, microbatches=a.microbatches, capacity=cap, sync=sync)
            plan = plan_epoch(samples, cost, layout, PlannerConfig(over_length="chunk"))
            got[sync] = (float(lockstep_imbalance(plan, cost).mean()),
                         float(rank_sum_imbalance(plan, cost).mean()))
        rows[name] = got
        print(f"{name:12s} |       {got['step'][0]:.4f}  {got['microbatch'][0]:.4f}     |"
              f"        {got['step'][1]:.4f}  {got['microbatch'][1]:.4f}")
    report(example="sync_balance", dp=a.dp, microbatches=a.microbatches, samples=a.samples,
           lockstep={k: {s: v[s][0] for s in v} for k, v in rows.items()},
           rank_sums={k: {s: v[s][1] for s in v} for k, v in rows.items()},
           tested_with=TESTED_WITH)


if __name__ == "__main__":
    main()
