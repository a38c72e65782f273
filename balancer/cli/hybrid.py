"""The ``--cp-mode hybrid`` branches of the commands: ``report --cp-mode hybrid`` (the hybrid
report of :mod:`balancer.report.hybrid`), ``precompute --cp-mode hybrid`` and ``inspect`` of a
hybrid plan directory (:mod:`balancer.store.hybrid`), and the hybrid mode's ``--strategies``;
called by :mod:`balancer.cli.report` and :mod:`balancer.cli.store`. Both modes read the same
flags (``--strategy``/``--strategies``, ``--seed``, ``--global-batch-tokens``, ``--max-delay``,
``--over-length``), ``--max-delay`` left out taking the hybrid mode's default (2, not the fixed
mode's 4: :data:`balancer.config.MODE_DEFAULTS`); ``precompute`` refuses a planner flag the
hybrid mode does not use, never ignoring it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from . import args as cli_args
from ..world import launched_processes
from ..config import MODE_FIELDS, Layout, PlannerConfig


#: planner flags the hybrid mode does not use (refused when given, never ignored)
_NOT_HYBRID = tuple(k for k in PlannerConfig.model_fields if k not in MODE_FIELDS["hybrid"])


def parse_strategies(text: Optional[str], n_ranks: int) -> list[str]:
    """``--strategies`` of the hybrid mode (None: every hybrid-mode strategy of the registry for
    a pool of ``n_ranks``); unknown names or degrees that do not tile the pool are one error
    naming them."""
    from ..planning.hybrid import default_strategies
    if not text:
        return default_strategies(n_ranks)
    names = [s.strip() for s in text.split(",") if s.strip()]
    ok = set(default_strategies(n_ranks))
    bad = [s for s in names if s not in ok]
    if bad or not names:
        raise ValueError(f"--strategies {text!r}: {', '.join(bad) or 'none given'} not a hybrid-"
                         f"mode strategy of a pool of {n_ranks} ranks (choose from "
                         f"{', '.join(sorted(ok))})")
    return names


def run_hybrid_report(args, *, out: str, plots: bool = True, quiet: bool = False) -> dict:
    """Everything ``python -m balancer report --cp-mode hybrid`` does; returns the report. The
    hybrid report of :mod:`balancer.report.hybrid` (what it holds is described there), its
    table printed. A plan that loses or duplicates a token of a document is reported
    ``"valid": false`` (exit status 1)."""
    from ..planning.warmup import warmup
    from ..report.hybrid import build_hybrid_report
    t0 = time.perf_counter()
    if getattr(args, "plan", None):
        return _stored_hybrid_report(args, out=out, plots=plots, quiet=quiet, t0=t0)
    lengths, wname = cli_args.read_lengths(args)
    if lengths is None:
        raise ValueError("give --lengths FILE.npy|NAME or --dataset DIR")
    # the CP cost model needs a preset with a model: mapping; llama-7b unless told
    args = argparse.Namespace(**{**vars(args), "cost_model": args.cost_model or "llama-7b"})
    model, P, budget = cli_args.build_cp(args)
    layout = cli_args.build(args)[1]   # validates the layout flags (cp_mode, rank_capacity)
    names = parse_strategies(args.strategies, P)
    if not args.strategies:  # the default list: leave out fixed degrees that hold nothing
        names = [n for n in names if not n.startswith("fixed_cp") or
                 model.doc_limit(int(n[len("fixed_cp"):])) >= 1]
    warmup(["hybrid"])
    report, _, _ = build_hybrid_report(
        lengths, model, P, budget, names, seed=args.seed, max_delay=args.max_delay,
        layout=layout.model_dump(), workload=wname, over_length=args.over_length)
    return _write(report, out, wname, plots=plots, quiet=quiet, t0=t0)


def _stored_hybrid_report(args, *, out: str, plots: bool, quiet: bool, t0: float) -> dict:
    """``report --plan DIR`` of a hybrid plan directory: the stored plan of ``--epoch`` under
    its own CP cost model (``--cost-model`` evaluates it under another preset, the plan's rank
    capacity, hardware and pp kept), as ``"<strategy> (stored)"``, beside the hybrid-mode
    ``--strategies`` planned afresh when the lengths are known. The lengths: ``--lengths`` /
    ``--dataset``, else the ``.npy`` the plan was made from (its manifest's source), else the
    plan's items (each sample's planned tokens; ``lengths_known: false``, nothing re-planned)."""
    from ..cost.cp import CPCostModel
    from ..planning.warmup import warmup
    from ..report.hybrid import build_hybrid_report
    from ..report.hybrid.figures import summarize
    from ..samples import SampleTable
    from ..store.hybrid import load_hybrid_manifest, load_hybrid_plan
    path = Path(args.plan)
    epoch = getattr(args, "epoch", 0) or 0
    manifest = load_hybrid_manifest(path)
    lengths, wname = cli_args.read_lengths(args)
    ds = manifest["dataset"]
    if lengths is not None:
        fp = SampleTable(lengths).fingerprint()
        if fp != ds["fingerprint"]:
            raise ValueError(f"--plan {args.plan}: the plan was made for lengths of fingerprint "
                             f"{ds['fingerprint']} ({ds['n_samples']:,} samples), the lengths "
                             f"given have {fp} ({len(lengths):,} samples)")
    else:
        lengths = cli_args.manifest_lengths(manifest, path)
        if lengths is not None and SampleTable(lengths).fingerprint() != ds["fingerprint"]:
            lengths = None   # the file changed since: report the plan alone
    wname = wname or path.name
    # the report diagnoses coverage itself; the store checks the structure and the hashes
    plan, _ = load_hybrid_plan(path, epoch, verify=True)
    known = lengths is not None
    if not known:
        item_doc, item_length = np.asarray(plan.item_doc), np.asarray(plan.item_length)
        lengths = np.zeros(ds["n_samples"], np.int64)
        np.add.at(lengths, item_doc, item_length)
    model = CPCostModel.model_validate(manifest["cost_model"])
    if args.cost_model:
        model = CPCostModel.from_preset(args.cost_model, model.rank_capacity,
                                        hardware=model.hardware, pp=model.pp)
    lay = manifest["layout"]
    P = int(lay["dp"]) * int(lay["cp"])
    names = parse_strategies(args.strategies, P) if args.strategies and known else []
    if names:
        warmup(["hybrid"])
    report, _, _ = build_hybrid_report(
        lengths, model, P, manifest["batch_tokens"], names, seed=manifest["seed"],
        max_delay=manifest["max_delay"], layout=lay, workload=wname,
        over_length=manifest["over_limit"])
    stored = f"{manifest['strategy']} (stored)"
    block, _ = summarize(plan, model, lengths, [],
                         per_document=manifest["strategy"] == "megatron_hybrid")
    report["strategies"] = {stored: block, **report["strategies"]}
    report["workload"]["lengths_known"] = known
    report["plan"] = {"dir": str(path), "epoch": int(epoch), "strategy": manifest["strategy"],
                      "epochs": len(manifest["epochs"])}
    return _write(report, out, wname, plots=plots, quiet=quiet, t0=t0)


def _write(report: dict, out: str, wname: str, *, plots: bool, quiet: bool, t0: float) -> dict:
    """Write a hybrid report's files and, unless ``quiet``, print its table and where it went."""
    from ..report.hybrid import format_table, write_hybrid_report
    files = write_hybrid_report(report, out, plots=plots, t0=t0)
    if not quiet:
        print(format_table({**report, "title": wname, "longest": report["workload"]["longest"],
                            "overlap": report["cp_cost_model"]["overlap"]}))
        written = ", ".join(Path(p).name for p in files.values())
        print(f"\nreport written to {Path(out)}/: {written} ({report['report_seconds']:.1f} s)")
    return report


def precompute_hybrid_run(args, job, layout: Layout, config: PlannerConfig, load_samples) -> int:
    """``precompute --cp-mode hybrid``: the plans HybridBatchSampler trains from (``plan=``)."""
    from ..cost.cp import CPCostModel
    from ..planning.hybrid import hybrid_config
    from ..store.hybrid import load_hybrid_manifest, precompute_hybrid
    given = [k for k in _NOT_HYBRID if k in vars(args)]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise ValueError(f"--cp-mode hybrid does not use {flags} (it plans global batches of --global-batch-tokens, each document "
                         f"at most --max-delay steps from its batch)")
    if job.workers > 1 or launched_processes() > 1:
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
    # values not given (flag or --config) take the hybrid mode's defaults, so the stored plan
    # is the one HybridBatchSampler(...) with the same arguments plans
    config = hybrid_config(config)
    print(f"precompute: {len(samples):,} samples, {samples.total_tokens:,} tokens | hybrid "
          f"DP x CP, pool {layout.dp} x {layout.cp} ranks, rank capacity "
          f"{layout.rank_capacity:,} | {config.strategy} | {job.cost_model} | {job.epochs} "
          f"epoch(s)",
          file=sys.stderr, flush=True)
    out = precompute_hybrid(samples, model, layout, job.out, config=config, epochs=job.epochs,
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
    from ..store.files import HYBRID_FORMAT_NAME, read_manifest_bytes
    try:   # the store's one way of opening a manifest: links and FIFOs refused unopened
        return json.loads(read_manifest_bytes(plan_dir)).get("format") == HYBRID_FORMAT_NAME
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
    from ..store.hybrid import load_hybrid_manifest, load_hybrid_plan
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
