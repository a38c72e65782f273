"""The plan store: precomputed plans on disk, memory-mapped on load.

A plan directory holds one ``.npy`` file per array per epoch and a ``manifest.json``::

    PLAN_DIR/manifest.json
    PLAN_DIR/epoch-0000/entry_sample.npy   int64[E]   sample of every document, by microbatch
                        entry_start.npy    int64[E]   token offset inside the sample (chunks)
                        entry_length.npy   int64[E]   tokens of the document
                        entry_delay.npy    int32[E]   steps the document waited
                        mb_offsets.npy     int64[M+1] CSR offsets of microbatches into entries
                        mb_step.npy        int32[M]   step of every microbatch
                        mb_rank.npy        int32[M]   DP rank of every microbatch
                        mb_fwd.npy         float64[M] predicted forward cost
                        mb_bwd.npy         float64[M] predicted backward cost
                        step_mbs.npy       int64[S]   microbatches per DP rank per step
                        leftover_*.npy     int64[L]   sample/start/length of items not placed

Every ``.npy`` has a fixed 128-byte header (so a writer can append data before it knows the
final shape and fill the header in last) and is memory-mapped read-only by :func:`load_plan`.
The manifest records the format version, layout, planner config, cost model, the dataset's
fingerprint and size, the SHA-256 of every array and summary statistics. Microbatches are
step-major, then rank-major, then in pipeline order (as in :class:`balancer.planning.planner.Plan`).
CP sharding is per-document zigzag (``cp_sharding``), computed by the loader, not stored.

Writes are atomic: everything goes into a hidden sibling directory, every file and the
directory are fsynced, the manifest is written last, and the directory is renamed into place.
A killed writer leaves at most a ``.NAME.partial-HOST-PID-RAND`` directory, which never loads
(no manifest until the end, and it is never at ``NAME``); the next writer of ``NAME`` removes
those whose process (on this host) is gone, ``inspect`` reports the rest.

Overwrite replaces only a plan store: a directory holding nothing but ``manifest.json`` and
``epoch-NNNN/<array>.npy`` (or an empty directory); anything else is refused, naming it. The
new directory is exchanged with the old one atomically (Linux ``renameat2(RENAME_EXCHANGE)``),
so ``NAME`` always holds the old or the new plan. Where the file system cannot exchange, the old
plan is first renamed to ``.NAME.old-HOST-PID-RAND``; a writer killed before the second rename
leaves ``NAME`` missing, and loading ``NAME`` then reads that complete old plan, which the next
writer renames back.

The manifest is sealed: ``manifest_sha256`` is the SHA-256 of its canonical JSON without that
key, so an edited manifest is refused. Loading checks the manifest's shape (every key and type),
confines every path it names to the plan directory (plain names only, no symbolic links), and
checks the arrays against it: counts, microbatches per rank per step, capacity and coverage.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from ..config import Layout, PlannerConfig
from ..planning.plan import Plan
from .atomic import (  # noqa: F401 (balancer.store.<name>: one namespace)
    PlanDirWriter,
    _AT_FDCWD,
    _EPOCH_RE,
    _HIDDEN_RE,
    _RENAME_EXCHANGE,
    _exchange,
    _has_plan_manifest,
    _kill_point,
    _moved_aside,
    _owner_alive,
    _tag,
    check_replaceable,
    cleanup_stale,
    exchange_supported,
    foreign_entry,
    hidden_dirs,
    manifest_digest)
from .files import (  # noqa: F401 (balancer.store.<name>: one namespace)
    epoch_dirname,
    ARRAYS,
    ArrayAppender,
    FORMAT_NAME,
    FORMAT_VERSION,
    HEADER_BYTES,
    KILL_ENV,
    MANIFEST,
    MANIFEST_DIGEST_KEY,
    MAX_MANIFEST_BYTES,
    NO_EXCHANGE_ENV,
    _HASH_BLOCK,
    allocate_array,
    fd_digest,
    file_digest,
    fsync_dir,
    npy_header,
    read_manifest_bytes,
    write_slice)
from .load import (  # noqa: F401 (balancer.store.<name>: one namespace)
    _HEX64,
    _Schema,
    _check_against_manifest,
    _check_structure,
    _epoch_entry,
    _plain_name,
    _short,
    check_compatible,
    check_manifest_schema,
    load_arrays,
    load_manifest,
    load_plan,
    open_epoch_arrays,
    plan_source,
    resolve_plan_dir)
from .snapshot import PlanSnapshot, READ_TRIES, read_whole  # noqa: F401 (one namespace)


def plan_header(layout: Layout, config: PlannerConfig, cost_model, n_samples: int,
                dataset_fingerprint: str, total_tokens: Optional[int] = None) -> dict:
    """The manifest fields shared by every epoch (``cost_model``: a CostModel or a name)."""
    spec = cost_model.model_dump(mode="json") if hasattr(cost_model, "model_dump") else None
    name = cost_model.name if spec is not None else str(cost_model)
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION,
            "layout": layout.model_dump(mode="json"), "config": config.model_dump(mode="json"),
            # defaults resolved as this code resolved them (a later release may change them)
            "config_resolved": {"max_advance": config.advance},
            "cost_model": {"name": name, "spec": spec},
            "dataset": {"fingerprint": dataset_fingerprint, "n_samples": int(n_samples),
                        "total_tokens": None if total_tokens is None else int(total_tokens)},
            "cp_sharding": "zigzag-per-document",
            "microbatch_order": "step-major, then DP rank, then pipeline order"}


def epoch_summary(n_entries: int, n_mbs: int, n_steps: int, tokens: int, n_left: int,
                  max_delay: int, delayed: int, capacity: int) -> dict:
    return {"steps": int(n_steps), "microbatches": int(n_mbs), "entries": int(n_entries),
            "tokens": int(tokens), "leftover": int(n_left),
            "packing_efficiency": float(tokens) / (n_mbs * capacity) if n_mbs else 0.0,
            "max_delay": int(max_delay), "delayed_entries": int(delayed)}


def plan_arrays(plan: Plan) -> dict:
    """The stored arrays of a plan (derived ones included)."""
    mb_step, mb_rank = plan.mb_step, plan.mb_rank
    return {"entry_sample": plan.entry_sample, "entry_start": plan.entry_start,
            "entry_length": plan.entry_length, "entry_delay": plan.entry_delay,
            "mb_offsets": plan.mb_offsets, "mb_step": mb_step, "mb_rank": mb_rank,
            "mb_fwd": plan.mb_fwd, "mb_bwd": plan.mb_bwd, "step_mbs": plan.step_mbs,
            "leftover_sample": plan.leftover.sample, "leftover_start": plan.leftover.start,
            "leftover_length": plan.leftover.length}


def _json_stats(stats: dict) -> dict:
    return {k: (v.item() if hasattr(v, "item") else v) for k, v in stats.items()}


def save_plan(plans: Union[list[Plan], Plan], path, *, lengths_fingerprint: Optional[str] = None,
              extra: Optional[dict] = None, cost=None, overwrite: bool = False) -> Path:
    """Write one or several epochs' plans (same layout, config, dataset) atomically to the
    directory ``path``; returns it. ``lengths_fingerprint``, when given, must equal the plans'
    dataset fingerprint; ``cost`` (a CostModel) stores the cost model's spec too; ``extra`` is
    stored as the manifest's ``extra``."""
    plans = [plans] if isinstance(plans, Plan) else list(plans)
    if not plans:
        raise ValueError("no plans to save")
    p0 = plans[0]
    for p in plans[1:]:
        for what in ("layout", "config", "cost_model", "n_samples", "dataset_fingerprint"):
            if getattr(p, what) != getattr(p0, what):
                raise ValueError(f"plan of epoch {p.epoch} has {what} {getattr(p, what)!r}, "
                                 f"epoch {p0.epoch} has {getattr(p0, what)!r}")
    epochs = [p.epoch for p in plans]
    if len(set(epochs)) != len(epochs):
        raise ValueError(f"epochs {epochs} repeat")
    if lengths_fingerprint is not None and lengths_fingerprint != p0.dataset_fingerprint:
        raise ValueError(f"lengths fingerprint {lengths_fingerprint} differs from the plans' "
                         f"dataset fingerprint {p0.dataset_fingerprint}")
    if cost is not None and cost.name != p0.cost_model:
        raise ValueError(f"cost model {cost.name!r} differs from the plans' {p0.cost_model!r}")
    w = PlanDirWriter(path, overwrite=overwrite)
    try:
        manifest = plan_header(p0.layout, p0.config, cost if cost is not None else p0.cost_model,
                               p0.n_samples, p0.dataset_fingerprint)
        manifest["epochs"] = []
        for p in plans:
            d = w.epoch_dir(p.epoch)
            info = {}
            for name, a in plan_arrays(p).items():
                app = ArrayAppender(d / f"{name}.npy", ARRAYS[name])
                app.append(a)
                info[name] = app.close()
            d_ = p.entry_delay
            summ = epoch_summary(len(p.entry_sample), p.n_microbatches, p.n_steps,
                                 int(p.entry_length.sum()), len(p.leftover),
                                 int(d_.max()) if d_.size else 0, int((d_ > 0).sum()),
                                 p.layout.capacity)
            manifest["epochs"].append({"epoch": p.epoch, "dir": epoch_dirname(p.epoch),
                                       "arrays": info, "stats": _json_stats(p.stats),
                                       "summary": summ})
        manifest["extra"] = extra or {}
        return w.commit(manifest)
    except BaseException:
        w.abort()
        raise
