"""``python -m balancer precompute`` and ``python -m balancer inspect``: plans into a plan store,
and what a stored plan holds.

``precompute`` takes its values from ``--config`` YAML files (flat mappings, or sections
``layout:``/``planner:``/``workload:`` that are flattened; later files win), then from the
flags actually given on the command line, which override everything. Keys are the flag names
with ``_`` (``dp``, ``capacity``, ``cost_model``, ``max_delay``, ``window_samples``, ...); an
unknown key is an error. Under ``torchrun`` (``WORLD_SIZE`` > 1) every rank runs the same
command and plans its share of the windows (see :mod:`balancer.store.precompute`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
from pydantic import BaseModel, Field

from . import args as cli_args
from .args import open_dataset
from ..store import plan_store as store
from .. import workloads
from .commands import command
from ..config import MAX_COUNT, Layout, PlannerConfig, load_yaml
from ..cost.model import CostModel, load_cost_model
from ..samples import DEFAULT_LENGTH_COLUMN, SampleTable
from ..world import World, launched_processes
from ..frozen import FROZEN, NoBoolNumbers
from ..resources import preset_names, preset_path


class PrecomputeJob(NoBoolNumbers):
    """What precompute reads and writes, besides the layout and the planner config."""

    model_config = FROZEN
    lengths: Optional[str] = Field(None, description=".npy lengths file, a workload name, or "
                                                     "length shards: a directory, glob or "
                                                     "comma list of .npy files, or .parquet "
                                                     "files read through --length-column")
    samples: Optional[int] = Field(None, gt=0, description="resample the lengths to this many")
    lengths_cache: Optional[str] = Field(None, description="length shards: keep their "
                                                           "concatenation in this .npy, memory-"
                                                           "mapped by every rank (page cache "
                                                           "shared per machine), rewritten when "
                                                           "a shard changes")
    dataset: Optional[str] = Field(None, description="saved HF dataset directory, or jsonl / "
                                                     "parquet file(s) (comma-separated)")
    length_column: str = Field("length", description="integer column with sample lengths")
    tokens_column: Optional[str] = Field(None, description="token-id column to measure when "
                                                           "there is no length column")
    num_proc: Optional[int] = Field(None, gt=0, description="processes measuring token columns")
    cost_model: str = Field("quadratic-64k", description="cost model name, preset, YAML file or "
                            "Hugging Face config.json")
    epochs: int = Field(1, ge=1, le=MAX_COUNT,
                        description="epochs planned into the one plan directory")
    workers: int = Field(1, ge=1, description="planning processes on this machine")
    out: Optional[str] = Field(None, description="plan directory to write")


_SECTIONS = ("layout", "planner", "workload")
_JOB = set(PrecomputeJob.model_fields)
_LAYOUT = set(Layout.model_fields)
_PLANNER = set(PlannerConfig.model_fields)
_RUN_ONLY = {"config", "strategies", "overwrite", "progress", "_run"}
#: every job, layout and planner field is a precompute flag of the same name, dashed
_FLAGS = {**{k: "--" + k.replace("_", "-") for k in _JOB | _LAYOUT | _PLANNER},
          **cli_args.FLAGS}


_flag_type = cli_args.flag_type  # one derivation of flags from config fields


def _precompute_args(p: argparse.ArgumentParser) -> None:
    p.epilog = ("Several processes or machines: set --window-samples (the plan depends on it, "
                "not on the number of processes), put the lengths and --out on a file system "
                "every machine sees, and start the same command on every machine with "
                "torchrun --nnodes N --nproc-per-node K --rdzv-backend c10d --rdzv-endpoint "
                "HOST:PORT -m balancer precompute ...; each rank plans its share of the "
                "windows and writes its slices, rank 0 writes the manifest. --lengths takes "
                "length shards (a directory, glob or comma list of .npy, or .parquet files "
                "with --length-column); --lengths-cache F.npy keeps their concatenation for "
                "every rank to memory-map. --order blocks bounds each process's memory by "
                "the window (the order computed per window, .npy lengths read on demand; "
                "another order than the default, so other plans). See docs/scale.md.")
    p.add_argument("--config", action="append", default=[],
                   help="YAML file of config values, or a shipped layout by name (dp8-pp4-cp2-7b, "
                        "dp64-32k) (repeatable; flags override it)")
    cli_args.add_workload_args(p)
    have = {a.dest for a in p._actions}
    g = p.add_argument_group("planner (every PlannerConfig field)")
    g.add_argument("--strategy", help="packing strategy (or --strategies with one name)")
    for name, f in PlannerConfig.model_fields.items():
        if name not in have and name != "strategy":
            g.add_argument("--" + name.replace("_", "-"), dest=name, help=f.description,
                           **_flag_type(f.annotation))
    g = p.add_argument_group("precompute")
    for name in ("lengths_cache", "dataset", "length_column", "tokens_column", "num_proc",
                 "epochs", "workers",
                 "out"):
        f = PrecomputeJob.model_fields[name]
        g.add_argument("--" + name.replace("_", "-"), dest=name, help=f.description,
                       **_flag_type(f.annotation))
    g.add_argument("--overwrite", action="store_true", help="replace an existing plan directory")
    cli_args.add_cp_args(p)   # --cp-mode hybrid writes a hybrid DP x CP plan
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="tqdm progress bar on stderr, on rank 0 (default: when stderr is a "
                        "terminal)")
    # only flags actually given reach the namespace, so config files fill the rest
    for a in p._actions:
        if a.dest not in ("help", "config", "overwrite", "progress"):
            a.default = argparse.SUPPRESS


def config_file(name_or_path: str) -> Path:
    """A ``--config`` value: a YAML file, or the name of a shipped layout preset
    (``configs/layouts/NAME.yaml``, package data, so an installed wheel finds it anywhere)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    found = None if p.exists() else preset_path(name_or_path, "layouts")
    if found is None:
        raise ValueError(f"--config {name_or_path}: no such file and not a shipped layout "
                         f"(known: {', '.join(preset_names('layouts'))})")
    return found


def resolve(args: argparse.Namespace) -> tuple[PrecomputeJob, Layout, PlannerConfig, CostModel]:
    """Merge config files and flags into validated (job, layout, planner config, cost)."""
    values: dict = {}
    for given_path in args.config:
        path = config_file(given_path)
        doc = load_yaml(path)
        flat, where = {}, {}
        for k, v in doc.items():
            part = v.items() if k in _SECTIONS and isinstance(v, dict) else [(k, v)]
            here = f"under {k}:" if k in _SECTIONS and isinstance(v, dict) else "at the top level"
            for kk, vv in part:
                if kk in where:   # one file gives one value per key; the last never wins
                    raise ValueError(f"{path}: key {kk!r} is given {where[kk]} and {here}; "
                                     f"give it once")
                flat[kk], where[kk] = vv, here
        for k in flat:
            if k not in _JOB | _LAYOUT | _PLANNER:
                raise ValueError(f"{path}: unknown key {k!r} (known: "
                                 f"{sorted(_JOB | _LAYOUT | _PLANNER)})")
        values.update(flat)
    given = {k: v for k, v in vars(args).items() if k not in _RUN_ONLY}
    if "strategies" in vars(args):
        mode = given.get("cp_mode") or values.get("cp_mode") or "fixed"
        names = cli_args.parse_strategies(args.strategies, mode)
        if len(names) != 1:
            raise ValueError(f"precompute plans one strategy, got --strategies {args.strategies}")
        given.setdefault("strategy", names[0])
    values.update(given)
    if values.get("lengths") and values.get("dataset"):
        raise ValueError("give --lengths or --dataset, not both")
    if not values.get("lengths") and not values.get("dataset"):
        raise ValueError("give --lengths FILE.npy|NAME or --dataset PATH (or either in --config)")
    if not values.get("out"):
        raise ValueError("give --out PLAN_DIR (or out: in --config)")
    from pydantic import ValidationError
    try:
        job = PrecomputeJob(**{k: v for k, v in values.items() if k in _JOB})
    except ValidationError as e:
        raise ValueError(cli_args.flag_errors(e, _FLAGS)) from None
    _refuse_unused_input_flags(args, job)
    cost = load_cost_model(job.cost_model)
    lay = {k: v for k, v in values.items() if k in _LAYOUT and v is not None}
    if "capacity" not in lay:
        lay["capacity"] = (lay.get("cp", 1) * lay["rank_capacity"] if lay.get("rank_capacity")
                           else cost.capacity(lay.get("cp", 1), lay.get("pp", 1)))
    from pydantic import ValidationError
    try:
        layout = Layout(**lay)
        config = PlannerConfig(**{k: v for k, v in values.items() if k in _PLANNER and
                                  (v is not None or PlannerConfig.model_fields[k].default is None)})
    except ValidationError as e:
        raise ValueError(cli_args.flag_errors(e, _FLAGS)) from None
    return job, layout, config, cost


def _refuse_unused_input_flags(args, job: PrecomputeJob) -> None:
    """A flag given on the command line that the input it came with does not read is an error
    (the plan would be written without it, silently): a column, the processes measuring one
    and a shard cache mean nothing to ``--lengths FILE.npy|NAME`` (the lengths themselves),
    a shard cache nothing to ``--dataset``."""
    from ..shards import is_sharded
    given = [k for k in ("length_column", "tokens_column", "num_proc", "lengths_cache")
             if k in vars(args)]
    if job.lengths:
        sharded = is_sharded(job.lengths)
        unused = [k for k in given if k in ("tokens_column", "num_proc")
                  or (not sharded and k in ("length_column", "lengths_cache"))]
        what = (f"--lengths {job.lengths} holds the lengths themselves (columns are read from "
                f"--dataset, or --length-column from parquet shards)")
    else:
        unused = [k for k in given if k == "lengths_cache"]
        what = f"--dataset {job.dataset} is read in place (--lengths-cache is for length shards)"
    if unused:
        flags = ", ".join(_FLAGS[k] for k in unused)
        raise ValueError(f"{flags}: not used by this input: {what}; leave {flags} out")


def load_samples(job: PrecomputeJob, seed: int = 0, order: str = "permutation"):
    """The sample lengths: a .npy / workload name (resampled with ``samples``), or a dataset.
    Under ``order='blocks'`` a .npy file or shards (parquet ones through ``lengths_cache``) are
    read on demand window by window (:class:`balancer.shards.LengthFiles`, not a
    ``SampleTable``: the same length, lengths, total and fingerprint), never held whole."""
    if job.lengths:
        from ..shards import is_sharded, open_lengths, read_shards
        lazy = order == "blocks" and job.samples is None and (
            is_sharded(job.lengths) or job.lengths.endswith(".npy"))
        if lazy:
            source = open_lengths(job.lengths, job.length_column, cache=job.lengths_cache)
            if source is not None:
                return source
        if is_sharded(job.lengths):  # a directory / glob / list of .npy or parquet shards
            lengths = read_shards(job.lengths, job.length_column, cache=job.lengths_cache)
            if job.samples is not None and job.samples != lengths.shape[0]:
                lengths = np.random.default_rng(seed).choice(lengths, size=job.samples)
            return SampleTable(lengths)
        if job.lengths.endswith(".npy") and job.samples is None:
            # memory-mapped: the ranks of a machine share the file's pages (no private copy)
            from packing.validate import as_sizes
            return SampleTable(as_sizes(workloads.read_npy(job.lengths, mmap=True),
                                        source=job.lengths))
        return SampleTable(workloads.load(job.lengths, n=job.samples, seed=seed))
    if job.samples is not None:
        raise ValueError("--samples resamples a lengths workload, not a --dataset")
    ds = open_dataset(job.dataset)
    # a --length-column given must exist; the default 'length' falls back to a token column
    col = job.length_column if "length_column" in job.model_fields_set else DEFAULT_LENGTH_COLUMN
    return SampleTable.from_dataset(ds, col, job.tokens_column, job.num_proc)


def _init_distributed() -> tuple[bool, bool]:
    """Join the torchrun job (gloo, env://) when launched with WORLD_SIZE > 1: (distributed,
    whether this call created the group, so the command destroys it again). A group the
    caller initialised is used as it is, whatever WORLD_SIZE says (precompute plans over it)."""
    if "torch.distributed" in sys.modules:   # no torch imported: no group to find
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return World.current().multi, False
    if launched_processes() <= 1:
        return False, False
    import torch.distributed as dist
    dist.init_process_group("gloo")
    return True, True


def _shutdown_distributed(clean: bool) -> None:
    """Destroy the group the command created. Without it gloo's threads outlive ``main`` and
    rank 0 could abort at interpreter exit (SIGABRT, torchrun returning 1 after the plan was
    written). After a clean run every rank first meets the others (barrier) and drops
    finished collective work (gc); after an error the group is destroyed without waiting."""
    import gc
    import torch.distributed as dist
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
        gc.collect()
    dist.destroy_process_group()


def _precompute_run(args) -> int:
    # under torchrun the ranks join first, so that an error on one rank alone (its --config or
    # --lengths file missing on its machine) is every rank's error, not a rank left waiting
    t0 = time.perf_counter()
    dist, created = _init_distributed()
    clean = False
    try:
        if dist:
            from ..store.precompute import together
            job, layout, config, cost, samples = together(lambda: _prepare(args, True))
        else:
            job, layout, config, cost, samples = _prepare(args, False)
        if samples is None:   # the hybrid mode, on one process
            from .hybrid import precompute_hybrid_run
            return precompute_hybrid_run(args, job, layout, config, load_samples)
        rc = _precompute_fixed(args, job, layout, config, cost, dist, samples, t0)
        clean = True
        return rc
    finally:
        if created:
            _shutdown_distributed(clean)


def _prepare(args, dist: bool):
    """The job, layout, config and cost model of the command, and (fixed CP mode) the lengths;
    samples None: the hybrid mode, which plans on one process."""
    job, layout, config, cost = resolve(args)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    if job.workers > cores:   # more planning processes than cores add memory, not speed
        raise ValueError(f"--workers {job.workers}: more than the {cores} CPU cores this "
                         f"process may use; give at most {cores}")
    if layout.cp_mode == "hybrid":
        if dist:
            raise ValueError("--cp-mode hybrid plans on one process (no --workers, no torchrun)")
        return job, layout, config, cost, None
    for k in ("gpus_per_node", "cp_overlap", "cp_hardware"):
        if k in vars(args):
            raise ValueError(f"--{k.replace('_', '-')} is a figure of the hybrid mode's CP cost "
                             f"model: give it with --cp-mode hybrid")
    return job, layout, config, cost, load_samples(job, seed=config.seed, order=config.order)


def _precompute_fixed(args, job, layout, config, cost, dist: bool, samples, t0: float) -> int:
    from ..store.precompute import precompute
    rank = World.current().rank if dist else 0
    if rank == 0:
        print(f"precompute: {len(samples):,} samples, {samples.total_tokens:,} tokens | "
              f"{config.strategy} | dp={layout.dp} pp={layout.pp} cp={layout.cp} "
              f"microbatches={layout.microbatches} capacity={layout.capacity:,} | "
              f"{cost.name} | {job.epochs} epoch(s), window {config.window_samples or 'whole'}",
              file=sys.stderr, flush=True)
    if job.workers > 1 and config.window_samples is None and rank == 0:
        print("note: window_samples is not set, so the epoch is one window and --workers has "
              "no effect (set --window-samples; the plan depends on it)", file=sys.stderr)
    extra = {"source": job.model_dump(mode="json", exclude={"out", "workers", "lengths_cache"})}
    out = precompute(samples, cost, layout, config, job.out, epochs=job.epochs,
                     workers=job.workers, overwrite=args.overwrite,
                     progress=sys.stderr.isatty() if args.progress is None else args.progress,
                     extra=extra)
    if rank == 0:
        m = store.load_manifest(out)
        steps = sum(e["summary"]["steps"] for e in m["epochs"])
        mbs = sum(e["summary"]["microbatches"] for e in m["epochs"])
        print(f"wrote {out}: {len(m['epochs'])} epoch(s), {steps:,} steps, {mbs:,} microbatches "
              f"in {time.perf_counter() - t0:.2f} s")
    return 0


command("precompute", "plan epochs ahead of training into a plan directory")(
    (_precompute_args, _precompute_run))


# ---- inspect --------------------------------------------------------------------------------
def _inspect_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan_dir", help="a plan directory written by precompute")
    p.add_argument("--epoch", type=int, action="append",
                   help="epoch(s) to summarise (default: all)")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the SHA-256 check of every array")
    p.add_argument("--json", help="also write the summary to this JSON file")


def plan_cost_model(manifest: dict) -> CostModel:
    spec = manifest["cost_model"].get("spec")
    return CostModel.model_validate(spec) if spec else load_cost_model(manifest["cost_model"]["name"])


def epoch_report(plan, cost: CostModel) -> dict:
    """Headline figures of one stored epoch, recomputed from its arrays."""
    from ..report import metrics
    sm = metrics.step_metrics(plan, cost) if plan.n_microbatches else None
    d = np.asarray(plan.entry_delay)
    cap = plan.layout.capacity
    tokens = int(np.asarray(plan.entry_length).sum())
    out = {"epoch": plan.epoch, "steps": plan.n_steps, "microbatches": plan.n_microbatches,
           "documents": int(d.shape[0]),
           "samples": int((np.asarray(plan.entry_start) == 0).sum()), "tokens": tokens,
           "leftover": len(plan.leftover),
           "packing_efficiency": tokens / (plan.n_microbatches * cap) if plan.n_microbatches
           else 0.0,
           "max_delay": int(d.max()) if d.size else 0}
    if sm is not None:
        for k in ("microbatch_imbalance", "dp_imbalance", "pp_bubble_fraction"):
            out[k] = metrics.summarize(sm[k])
        out["cp_imbalance"] = metrics.summarize(metrics.cp_imbalance(plan, cost))
        out["est_step_time_total"] = float(sm["step_time"].sum())
    return out


def stale_report(plan_dir) -> list[dict]:
    """Hidden directories that interrupted writes of ``plan_dir`` left next to it."""
    out = []
    for h in store.hidden_dirs(plan_dir):
        alive = h["owner_alive"]
        out.append({"path": str(h["path"]), "kind": h["kind"],
                    "writer": "running" if alive else "gone" if alive is False else "unknown"})
    return out


def _inspect_run(args) -> int:
    stale = stale_report(args.plan_dir)
    if stale:
        print(f"note: {len(stale)} hidden director{'y' if len(stale) == 1 else 'ies'} next to "
              f"{args.plan_dir} left by interrupted writes (the next precompute --out "
              f"{args.plan_dir} removes those whose writer is gone):", file=sys.stderr)
        for h in stale:
            print(f"  {h['path']}  ({h['kind']}, writer {h['writer']})", file=sys.stderr)
    resolved = store.resolve_plan_dir(args.plan_dir)
    if resolved != Path(args.plan_dir):
        print(f"note: {args.plan_dir} is missing (an overwrite was interrupted); reading the "
              f"previous plan from {resolved}", file=sys.stderr)
    from .hybrid import inspect_hybrid, is_hybrid
    if is_hybrid(resolved):
        return inspect_hybrid(args, stale)
    manifest = store.load_manifest(args.plan_dir)
    store.check_compatible(manifest)
    shown = {k: v for k, v in manifest.items() if k != "epochs"}
    print(json.dumps(shown, indent=1))
    cost = plan_cost_model(manifest)
    epochs = args.epoch or [e["epoch"] for e in manifest["epochs"]]
    reports = []
    for e in epochs:
        plan, _ = store.load_plan(args.plan_dir, e, verify=args.verify)
        ent = next(x for x in manifest["epochs"] if x["epoch"] == e)
        print(f"\nepoch {e} ({ent['dir']}): arrays " + ("verified" if args.verify else
                                                        "not verified (--no-verify)"))
        for name, a in ent["arrays"].items():
            print(f"  {name:<16} {a['dtype']:>4} {a['shape'][0]:>13,}  sha256 {a['sha256'][:16]}")
        r = epoch_report(plan, cost)
        r["stats"] = ent.get("stats", {})
        reports.append(r)
        print(f"  steps {r['steps']:,}  microbatches {r['microbatches']:,}  samples "
              f"{r['samples']:,}  documents {r['documents']:,}  tokens {r['tokens']:,}  "
              f"leftover {r['leftover']:,}")
        print(f"  packing efficiency {r['packing_efficiency']:.4f}  max delay {r['max_delay']}")
        for k in ("microbatch_imbalance", "dp_imbalance", "cp_imbalance", "pp_bubble_fraction"):
            if k in r:
                s = r[k]
                print(f"  {k:<21} mean {s['mean']:.4f}  p90 {s['p90']:.4f}  max {s['max']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"manifest": shown, "epochs": reports, "stale_dirs": stale}, f,
                      indent=1)
    return 0


command("inspect", "print a plan directory's manifest and summary figures")(
    (_inspect_args, _inspect_run))

