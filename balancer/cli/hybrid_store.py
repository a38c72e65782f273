"""``precompute --cp-mode hybrid`` and ``inspect`` of a hybrid DP x CP plan directory
(:mod:`balancer.store.hybrid_store`); called by :mod:`balancer.cli.store`."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from . import args as cli_args
from ..config import Layout, PlannerConfig
from ..store.files import MANIFEST


#: planner flags the hybrid mode does not use (refused when given, never ignored)
_NOT_HYBRID = ("global_batch_samples", "window_samples", "tail", "max_advance", "balance",
               "lookahead", "lump_tolerance", "shuffle")


def precompute_hybrid_run(args, job, layout: Layout, config: PlannerConfig, load_samples) -> int:
    """``precompute --cp-mode hybrid``: the plans HybridBatchSampler trains from (``plan=``)."""
    from ..cost.cp import CPCostModel
    from ..planning.hybrid_epoch import HYBRID_DEFAULT_STRATEGY, HYBRID_MAX_DELAY
    from ..store.hybrid_store import load_hybrid_manifest, precompute_hybrid
    given = [k for k in _NOT_HYBRID if k in vars(args)]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ValueError(f"--cp-mode hybrid does not use {flags} (it plans global batches of --global-batch-tokens, each document "
                         f"at most --max-delay steps from its batch)")
    if job.workers > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("--cp-mode hybrid plans on one process (no --workers, no torchrun)")
    hw = cli_args.cp_hardware(args)
    try:
        model = CPCostModel.from_preset(job.cost_model, layout.rank_capacity, hardware=hw,
                                        pp=layout.pp)
    except ValueError as e:
        raise ValueError(f"--cost-model {job.cost_model}: {e}; --cp-mode hybrid needs a model "
                         f"preset with a 'model:' mapping (llama-7b, llama-70b, ... in "
                         f"configs/models) for the K/V exchange") from None
    t0 = time.perf_counter()
    samples = load_samples(job, seed=config.seed)
    # values not given (flag or --config) take the hybrid sampler's defaults, so the stored
    # plan is the one HybridBatchSampler(...) with the same arguments plans
    given = config.model_fields_set
    strategy = config.strategy if "strategy" in given else HYBRID_DEFAULT_STRATEGY
    max_delay = config.max_delay if "max_delay" in given else HYBRID_MAX_DELAY
    print(f"precompute: {len(samples):,} samples, {samples.total_tokens:,} tokens | hybrid "
          f"DP x CP, pool {layout.dp} x {layout.cp} ranks, rank capacity "
          f"{layout.rank_capacity:,} | {strategy} | {job.cost_model} | {job.epochs} epoch(s)",
          file=sys.stderr, flush=True)
    out = precompute_hybrid(samples, model, layout, job.out, strategy=strategy,
                            seed=config.seed, epochs=job.epochs,
                            batch_tokens=config.global_batch_tokens,
                            max_delay=max_delay,
                            over_limit="chunk" if config.over_length == "chunk" else "error",
                            overwrite=args.overwrite,
                            extra={"source": job.model_dump(mode="json",
                                                            exclude={"out", "workers"})})
    m = load_hybrid_manifest(out)
    steps = sum(e["summary"]["steps"] for e in m["epochs"])
    rounds = sum(e["summary"]["rounds"] for e in m["epochs"])
    print(f"wrote {out}: {len(m['epochs'])} epoch(s), {steps:,} steps, {rounds:,} rounds in "
          f"{time.perf_counter() - t0:.2f} s")
    return 0


def is_hybrid(plan_dir: Path) -> bool:
    from ..store.files import HYBRID_FORMAT_NAME
    try:
        with open(Path(plan_dir) / MANIFEST) as f:
            return json.load(f).get("format") == HYBRID_FORMAT_NAME
    except (OSError, ValueError, AttributeError):
        return False   # load_manifest says what is wrong


def hybrid_epoch_report(plan, epoch: int) -> dict:
    """Headline figures of one stored hybrid epoch, recomputed from its arrays."""
    size = np.asarray(plan.group_size)
    cnt = np.bincount(size)
    return {"epoch": int(epoch), "steps": plan.n_steps, "rounds": plan.n_rounds,
            "groups": int(size.shape[0]), "items": int(plan.item_doc.shape[0]),
            "samples": int(np.unique(np.asarray(plan.item_doc)).shape[0]),
            "tokens": int(np.asarray(plan.item_length).sum()),
            "documents_cut": int(plan.documents_cut),
            "group_sizes": {str(g): int(cnt[g]) for g in np.flatnonzero(cnt)},
            "rank_capacity": int(plan.rank_capacity), "n_ranks": int(plan.n_ranks)}


def inspect_hybrid(args, stale) -> int:
    from ..store.hybrid_store import load_hybrid_manifest, load_hybrid_plan
    manifest = load_hybrid_manifest(args.plan_dir)
    shown = {k: v for k, v in manifest.items() if k != "epochs"}
    print(json.dumps(shown, indent=1))
    reports = []
    for e in args.epoch or [x["epoch"] for x in manifest["epochs"]]:
        plan, _ = load_hybrid_plan(args.plan_dir, e, verify=args.verify)
        ent = next(x for x in manifest["epochs"] if x["epoch"] == e)
        print(f"\nepoch {e} ({ent['dir']}, hybrid DP x CP): arrays " +
              ("verified" if args.verify else "not verified (--no-verify)"))
        for name, a in ent["arrays"].items():
            print(f"  {name:<16} {a['dtype']:>4} {a['shape'][0]:>13,}  sha256 {a['sha256'][:16]}")
        r = hybrid_epoch_report(plan, e)
        reports.append(r)
        sizes = "  ".join(f"{g}: {c:,}" for g, c in r["group_sizes"].items())
        print(f"  steps {r['steps']:,}  rounds {r['rounds']:,}  groups {r['groups']:,}  "
              f"samples {r['samples']:,}  tokens {r['tokens']:,}  documents cut "
              f"{r['documents_cut']:,}")
        print(f"  groups by size (ranks: groups)  {sizes}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"manifest": shown, "epochs": reports, "stale_dirs": stale}, f, indent=1)
    return 0
