"""Set ``Layout.sync`` to how the trainer synchronises, and see what it changes (planner only):

    python examples/sync_balance.py                 # the four workloads, pp=1, dp=8
    python examples/sync_balance.py --samples 20000 # a resampled subset (faster)
    python examples/sync_balance.py --resume        # a sampler checkpoint keeps the sync

``sync="step"`` (default): DDP with ``no_sync`` accumulation meets once per step, so
``balanced`` equalises per-rank sums. ``sync="microbatch"``: FSDP / ZeRO-3 (and DDP without
``no_sync``) meet after every microbatch, the step takes ``sum_k max_r cost[r, k]``, so every
microbatch is balanced. Printed per workload and sync: that per-microbatch lockstep imbalance
and the per-rank-sum imbalance (mean over steps; 1.0 = nobody waits), side by side, one run.
With ``--resume``: the sampler of each sync (``wikipedia`` resampled, ``--samples``, default
4000), on every DP rank, saves ``state_dict()`` mid-epoch 0 (after a third of its
microbatches, through JSON as a checkpoint holds it); fresh samplers load it and the rest of
epoch 0 and all of epoch 1 equal the uninterrupted run's microbatches, so their per-microbatch
imbalance is the uninterrupted one too. A checkpoint of a ``sync="step"`` job loaded into a
``sync="microbatch"`` sampler (DDP switched to FSDP on restart) is refused, naming the layout:
its plan differs, so resuming at the same position would skip and repeat samples.
Tested with numpy 2.4, numba 0.6x (no torch model needed).
"""
import json
import argparse

import numpy as np

from balancer import (Layout, PackedBatchSampler, PlannerConfig, SampleTable, load_cost_model,
                      plan_epoch, workloads)
from balancer.integrations.sync import lockstep_imbalance, rank_sum_imbalance

from _common import TESTED_WITH, at_least, report

# (workload, samples or None for all, capacity): the bench suite's capacities
WORKLOADS = [("wlbllm", None, 131072), ("wikipedia", None, 32768), ("prolong", None, 65536),
             ("bimodal-sft", 500_000, 16384)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=at_least(1), default=None, help="resample every workload to N")
    ap.add_argument("--dp", type=at_least(1), default=8)
    ap.add_argument("--microbatches", type=at_least(1), default=4)
    ap.add_argument("--resume", action="store_true",
                    help="checkpoint each sync's samplers mid-epoch, resume in fresh ones")
    a = ap.parse_args(argv)
    if a.resume:
        return resume(a)
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


def _stream(sampler, epochs=2):
    """(epoch, step, sample ids) of every microbatch from the sampler's position on."""
    out = []
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)  # keeps a restored position inside its epoch
        for ref in sampler:  # a MicrobatchRef: the sample ids of one microbatch
            out.append((epoch, int(ref.step), list(map(int, ref))))
    return out


def resume(a):
    cost = load_cost_model("quadratic-64k")
    samples = SampleTable(np.asarray(workloads.load("wikipedia", n=a.samples or 4000), np.int64))
    config = PlannerConfig(over_length="chunk", seed=0)
    figures = {}
    for sync in ("step", "microbatch"):
        layout = Layout(dp=a.dp, microbatches=a.microbatches, capacity=32768, sync=sync)
        new = lambda r, lay=layout: PackedBatchSampler(samples, cost, lay, config, dp_rank=r)  # noqa: E731
        same, stop = True, None
        for r in range(a.dp):
            straight = _stream(new(r))
            first = new(r)
            stop = len(first) // 3  # mid-epoch 0
            it = iter(first)
            done = [next(it) for _ in range(stop)]
            state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint holds it
            fresh = new(r)
            fresh.load_state_dict(state)
            rest = _stream(fresh)
            same &= [list(map(int, b)) for b in done] == [m[2] for m in straight[:stop]]
            same &= rest == straight[stop:]
            if r == 0:
                step_state = state
        plan = plan_epoch(samples, cost, layout, config)
        figures[sync] = {"checkpoint_after_microbatch": stop, "resumed_identical": same,
                         "lockstep": float(lockstep_imbalance(plan, cost).mean())}
        print(f"sync={sync:10s}: {a.dp} ranks resumed after microbatch {stop} of "
              f"{len(new(0))}: rest of epoch 0 and epoch 1 identical: {same}; lockstep "
              f"imbalance {figures[sync]['lockstep']:.4f}")
        if not same:
            raise SystemExit(f"sync={sync}: the resumed microbatches differ")
        if sync == "step":
            saved = step_state
    fsdp = PackedBatchSampler(samples, cost, layout, config, dp_rank=0)  # sync="microbatch"
    try:
        fsdp.load_state_dict(saved)
        refused = None
    except ValueError as e:
        refused = str(e)
    print(f"a sync='step' checkpoint loaded by a sync='microbatch' sampler: "
          f"{'refused: ' + refused if refused else 'ACCEPTED'}")
    if refused is None or "differs in sync" not in refused:
        raise SystemExit("a checkpoint of another sync was not refused")
    report(example="sync_balance", resumed=True, dp=a.dp, microbatches=a.microbatches,
           samples=a.samples or 4000, sync=figures, other_sync_refused=True,
           tested_with=TESTED_WITH)


if __name__ == "__main__":
    main()
