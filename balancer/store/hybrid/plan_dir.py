"""Hybrid DP x CP plans on disk: precomputed ahead of training, memory-mapped and
checked on load, trained from by :class:`balancer.loader.HybridBatchSampler` (``plan=``).

A hybrid plan directory has the fixed-CP store's shape and guarantees (atomic write, sealed
manifest, paths confined to the directory, SHA-256 of every array, see :mod:`plan_store`) with
its own format name ``balancer-hybrid-plan``, so neither loader reads the other's plans::

    PLAN_DIR/manifest.json
    PLAN_DIR/epoch-0000/step_rounds.npy    int64[S+1] rounds of step s: step_rounds[s:s+2]
                        round_groups.npy   int64[R+1] groups of round r (CSR)
                        group_offset.npy   int64[G]   first pool rank of every group
                        group_size.npy     int64[G]   ranks of every group (aligned power of 2)
                        group_entries.npy  int64[G+1] entries of every group (CSR)
                        entry_item.npy     int64[E]   item of every entry
                        entry_owner.npy    int64[E]   -1: zigzag-sharded over the group, else
                                                      the member holding it whole
                        item_doc.npy       int64[I]   sample id of every item
                        item_start.npy     int64[I]   token offset in the sample (cut pieces)
                        item_length.npy    int64[I]   tokens of every item

The manifest records the layout (``cp_mode: hybrid``), the CP cost model's full spec, the
strategy, seed, batch tokens, delay bound and over-limit policy the plan was made with, the
dataset's fingerprint and size, and per epoch the arrays and a summary. The plan of an epoch is
:func:`balancer.planning.hybrid.plan_hybrid_epoch` of those inputs, the one the sampler
computes itself, so training from the store or without it gives the same batches.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import numpy as np

from packing.hybrid_cp import HybridPlan

from ...config import Layout, PlannerConfig, renamed
from ...cost.cp import CPCostModel
from ...planning.hybrid import default_strategies, hybrid_config, plan_hybrid_epoch
from ...samples import SampleTable
from ..atomic import PlanDirWriter
from ..files import (HYBRID_ARRAYS, HYBRID_FORMAT_NAME, HYBRID_FORMAT_VERSION,
                     MANIFEST_DIGEST_KEY, ArrayAppender, epoch_dirname)
from .check import check_stored_hybrid
from ..load import (_HEX64, _Schema, _epoch_entry, layout_differences, open_epoch_arrays,
                    resolve_plan_dir, sealed_manifest_of, verify_digests)
from ..snapshot import PlanSnapshot, read_whole
from ..verified import VerifyMode, stamp_extra, verify_lock, verify_mode, write_stamp

#: what a plan was made with, besides layout, cost model and dataset (compared on load): the
#: manifest's keys (stable JSON: ``batch_tokens`` is PlannerConfig's ``global_batch_tokens``,
#: ``over_limit`` its ``over_length``)
PLANNED_WITH = ("strategy", "seed", "batch_tokens", "max_delay", "over_limit")


def hybrid_header(layout: Layout, model: CPCostModel, samples: SampleTable, *, strategy: str,
                  seed: int, batch_tokens: int, max_delay: int, over_limit: str) -> dict:
    """The manifest fields shared by every epoch."""
    if layout.cp_mode != "hybrid":
        raise ValueError(f"a hybrid plan needs a layout with cp_mode='hybrid', got "
                         f"{layout.cp_mode!r} (fixed-CP plans: precompute / save_plan)")
    if layout.rank_capacity != model.rank_capacity:
        raise ValueError(f"layout rank_capacity {layout.rank_capacity} differs from the cost "
                         f"model's {model.rank_capacity}")
    return {"format": HYBRID_FORMAT_NAME, "format_version": HYBRID_FORMAT_VERSION,
            "layout": layout.model_dump(mode="json"),
            "cost_model": model.model_dump(mode="json"),
            "strategy": str(strategy), "seed": int(seed), "batch_tokens": int(batch_tokens),
            "max_delay": int(max_delay), "over_limit": str(over_limit),
            "dataset": {"fingerprint": samples.fingerprint(), "n_samples": len(samples),
                        "total_tokens": int(samples.total_tokens)},
            "cp_sharding": "zigzag-per-document"}


def _summary(plan: HybridPlan) -> dict:
    return {"steps": plan.n_steps, "rounds": plan.n_rounds,
            "groups": int(plan.group_size.shape[0]), "entries": int(plan.entry_item.shape[0]),
            "items": int(plan.item_doc.shape[0]), "tokens": int(plan.item_length.sum()),
            "documents_cut": int(plan.documents_cut), "n_ranks": int(plan.n_ranks),
            "rank_capacity": int(plan.rank_capacity)}


def save_hybrid_plans(plans: dict, path, header: dict, *, overwrite: bool = False,
                      extra: Optional[dict] = None) -> Path:
    """Write ``{epoch: HybridPlan}`` (``item_doc`` sample ids) atomically to ``path`` with
    the manifest fields ``header`` (:func:`hybrid_header`); returns the directory."""
    if not plans:
        raise ValueError("no plans to save")
    w = PlanDirWriter(path, overwrite=overwrite)
    try:
        manifest = dict(header, epochs=[], extra=extra or {})
        for epoch in sorted(plans):
            plan, d = plans[epoch], w.epoch_dir(epoch)
            info = {}
            for name, dtype in HYBRID_ARRAYS.items():
                app = ArrayAppender(d / f"{name}.npy", dtype)
                app.append(getattr(plan, name))
                info[name] = app.close()
            manifest["epochs"].append({"epoch": int(epoch), "dir": epoch_dirname(epoch),
                                       "arrays": info, "summary": _summary(plan)})
        return w.commit(manifest)
    except BaseException:
        w.abort()
        raise


@renamed(over_limit="over_length", model="cost")
def precompute_hybrid(samples: SampleTable, cost: CPCostModel, layout: Layout, out, *,
                      config: Optional[PlannerConfig] = None, strategy: Optional[str] = None,
                      seed: Optional[int] = None, epochs: int = 1,
                      batch_tokens: Optional[int] = None, max_delay: Optional[int] = None,
                      over_length: Optional[str] = None, overwrite: bool = False,
                      extra: Optional[dict] = None) -> Path:
    """Plan ``epochs`` epochs of the pool ``dp x cp`` exactly as ``HybridBatchSampler`` with
    the same arguments would, and write them to the plan directory ``out``. ``config`` and the
    keywords on top (:func:`~balancer.planning.hybrid.hybrid_config`: strategy
    ``hybrid_stream``, seed 0, ``max_delay`` 2, ``over_length="error"`` unless set; older names
    ``model=``, ``over_limit=``; ``batch_tokens`` is ``global_batch_tokens``, default
    ``dp x cp x microbatches x rank_capacity``)."""
    config = hybrid_config(config, strategy=strategy, seed=seed, global_batch_tokens=batch_tokens,
                           max_delay=max_delay, over_length=over_length)
    model, strategy, seed = cost, config.strategy, config.seed
    batch_tokens, max_delay, over_limit = (config.global_batch_tokens, config.max_delay,
                                           config.over_length)
    if epochs < 1:
        raise ValueError(f"epochs {epochs} must be >= 1")
    if layout.pp != 1:
        raise ValueError(f"a hybrid plan covers one pipeline stage: pp {layout.pp} must be 1")
    P = layout.dp * layout.cp
    if strategy not in default_strategies(P):
        raise ValueError(f"strategy {strategy!r} is not a hybrid-mode strategy of a pool of {P} "
                         f"ranks (choose from {', '.join(default_strategies(P))})")
    bt = int(batch_tokens or P * layout.microbatches * layout.rank_capacity)
    header = hybrid_header(layout, model, samples, strategy=strategy, seed=seed,
                           batch_tokens=bt, max_delay=max_delay, over_limit=over_limit)
    plans = {e: plan_hybrid_epoch(samples.lengths, model, P, bt, strategy=strategy, seed=seed,
                                  epoch=e, max_delay=max_delay, over_limit=over_limit)
             for e in range(epochs)}
    return save_hybrid_plans(plans, out, header, overwrite=overwrite, extra=extra)


# ---- reading back ---------------------------------------------------------------------------
def load_hybrid_manifest(path) -> dict:
    """The sealed manifest of a hybrid plan directory, its keys and types checked (errors name
    the key, its value and the type wanted)."""
    return read_whole(path, _hybrid_manifest_of, resolve_plan_dir)


def _hybrid_manifest_of(snap: PlanSnapshot) -> dict:
    manifest, m = sealed_manifest_of(snap, HYBRID_FORMAT_NAME, HYBRID_FORMAT_VERSION)
    sc = _Schema(m)
    try:
        Layout.model_validate(sc.get(manifest, "layout", "", dict))
        CPCostModel.model_validate(sc.get(manifest, "cost_model", "", dict))
    except ValueError as e:
        sc.fail("layout / cost_model", f"is invalid: {e}")
    for key, t in zip(PLANNED_WITH, (str, int, int, int, str)):
        sc.get(manifest, key, "", t)
    ds = sc.get(manifest, "dataset", "", dict)
    sc.get(ds, "fingerprint", "dataset", str)
    sc.get(ds, "n_samples", "dataset", int, minimum=0)
    sc.get(ds, "total_tokens", "dataset", int, minimum=0)
    for k, e in enumerate(sc.get(manifest, "epochs", "", list)):
        w = f"epochs[{k}]"
        if not isinstance(e, dict):
            sc.fail(w, f"is {type(e).__name__}, expected dict")
        sc.get(e, "epoch", w, int, minimum=0)
        sc.get(e, "dir", w, str)
        summ = sc.get(e, "summary", w, dict)
        for key in ("steps", "rounds", "groups", "entries", "items", "tokens", "documents_cut",
                    "n_ranks", "rank_capacity"):
            sc.get(summ, key, f"{w}.summary", int, minimum=0)
        arrays = sc.get(e, "arrays", w, dict)
        for name in HYBRID_ARRAYS:
            a = sc.get(arrays, name, f"{w}.arrays", dict)
            sc.get(a, "file", f"{w}.arrays.{name}", str)
            sc.get(a, "dtype", f"{w}.arrays.{name}", str)
            if not _HEX64.fullmatch(sc.get(a, "sha256", f"{w}.arrays.{name}", str)):
                sc.fail(f"{w}.arrays.{name}.sha256", "is not 64 hex digits")
            shape = sc.get(a, "shape", f"{w}.arrays.{name}", list)
            if len(shape) != 1 or not isinstance(shape[0], int) or shape[0] < 0:
                sc.fail(f"{w}.arrays.{name}.shape", f"is {shape!r}, expected [n] with n >= 0")
    return manifest


def _unnamed(cp_model: dict) -> dict:
    """A CP cost model's dump without its cost model's ``name``: a label (a config.json's
    folder, a fitted preset's file), while the coefficients are what the plan was made with."""
    cost = cp_model.get("cost")
    if isinstance(cost, dict):
        cp_model = {**cp_model, "cost": {k: v for k, v in cost.items() if k != "name"}}
    return cp_model


@renamed(model="cost")
def check_hybrid_compatible(manifest: dict, *, layout: Optional[Layout] = None,
                            cost: Optional[CPCostModel] = None,
                            samples: Optional[SampleTable] = None, **planned) -> None:
    """Refuse a stored hybrid plan made for another job, naming every difference: the layout
    (a field left out of one dump counts as its default), the CP cost model ``cost`` (older
    name ``model``), the dataset, and ``planned`` values among :data:`PLANNED_WITH` (strategy,
    seed, batch_tokens, ...; ``over_length`` is taken for the manifest's ``over_limit``)."""
    if "over_length" in planned:
        v = planned.pop("over_length")
        if planned.get("over_limit") not in (None, v):
            raise ValueError(f"over_length={v!r} and over_limit={planned['over_limit']!r} "
                             f"disagree (over_limit is the older name of over_length): give "
                             f"one of them")
        planned["over_limit"] = v
    model = cost
    diffs = []
    if layout is not None:
        diffs += [f"layout {k}: plan has {h!r}, the job has {v!r}"
                  for k, h, v in layout_differences(manifest["layout"], layout)]
    if model is not None and \
            _unnamed(model.model_dump(mode="json")) != _unnamed(manifest["cost_model"]):
        mine, theirs = _unnamed(model.model_dump(mode="json")), _unnamed(manifest["cost_model"])
        keys = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
        diffs.append(f"CP cost model differs in {', '.join(keys)}")
    if samples is not None:
        ds = manifest["dataset"]
        if ds["n_samples"] != len(samples):
            diffs.append(f"n_samples: plan has {ds['n_samples']}, the job's dataset has "
                         f"{len(samples)}")
        elif ds["fingerprint"] != samples.fingerprint():
            diffs.append(f"dataset fingerprint: plan has {ds['fingerprint']}, the job's "
                         f"dataset has {samples.fingerprint()} (other sample lengths)")
    for k, v in planned.items():
        if k not in PLANNED_WITH:
            raise TypeError(f"unknown planning argument {k!r} (known: {PLANNED_WITH})")
        if v is not None and manifest[k] != v:
            diffs.append(f"{k}: plan has {manifest[k]!r}, the job has {v!r}")
    if diffs:
        raise ValueError("the hybrid plan does not match this job: " + "; ".join(diffs))


def load_hybrid_plan(path, epoch: int = 0, *, lengths: Optional[np.ndarray] = None,
                     verify: VerifyMode = True) -> tuple[HybridPlan, dict]:
    """The stored plan of ``epoch`` (arrays memory-mapped read-only) and the manifest.
    Checks paths, sizes, headers, the plan's structure (groups tile the pool in aligned
    powers of two every round, every item exactly once, owners inside their groups, no rank
    over its token limit in any round) and, with ``verify``, every array's SHA-256; with
    ``lengths`` (int64[n], the job's samples) also that the items cover every sample's tokens
    exactly once. ``verify="once"`` (the sampler's default): the hashes and those O(items)
    checks run only when no stamp shows that these exact files already passed them (with the
    same lengths, by fingerprint, when ``lengths`` is given): the first process to open the
    epoch verifies, the others wait for it and trust its stamp (:mod:`..verified`)."""
    verify = verify_mode(verify)
    return read_whole(path, lambda snap: _hybrid_plan_of(snap, epoch, lengths, verify),
                      resolve_plan_dir)


def _lengths_fingerprint(lengths) -> Optional[str]:
    """SampleTable.fingerprint() of ``lengths`` (hashed in blocks, no copy of int64 lengths)."""
    if lengths is None:
        return None
    import hashlib
    a = np.ascontiguousarray(lengths, dtype="<i8")
    h = hashlib.sha256()
    for lo in range(0, a.shape[0], 1 << 22):
        h.update(a[lo:lo + (1 << 22)].data)
    return h.hexdigest()[:16]


def _vouches(extra: Optional[dict], lengths_fp: Optional[str]) -> bool:
    """Whether a stamp's record covers this reader: any stamp without lengths to check, one
    made with the same lengths otherwise."""
    return extra is not None and (lengths_fp is None or extra.get("lengths") == lengths_fp)


def _hybrid_plan_of(snap: PlanSnapshot, epoch: int, lengths, verify: VerifyMode):
    """:func:`load_hybrid_plan` of one generation of the plan directory (the manifest and the
    arrays read from the directory ``snap`` holds open)."""
    manifest = _hybrid_manifest_of(snap)
    ent = _epoch_entry(manifest, epoch)
    a, fds, files = open_epoch_arrays(snap, ent, epoch, HYBRID_ARRAYS)
    summ = ent["summary"]
    plan = HybridPlan(**a, n_ranks=summ["n_ranks"], rank_capacity=summ["rank_capacity"],
                      documents_cut=summ["documents_cut"])
    if verify == "once":
        d, seal = snap.path / ent["dir"], manifest[MANIFEST_DIGEST_KEY]
        fp = _lengths_fingerprint(lengths)
        if not _vouches(stamp_extra(d, fds, seal), fp):
            with verify_lock(d):  # the first reader verifies, the others wait and read its stamp
                if not _vouches(stamp_extra(d, fds, seal), fp):
                    verify_digests(a, fds, files, ent["arrays"])
                    check_stored_hybrid(plan, manifest, summ, epoch, lengths)
                    write_stamp(d, fds, seal, extra={"lengths": fp})
                    return plan, manifest
        _check_counts(plan, manifest, lengths)
        return plan, manifest
    if verify:
        verify_digests(a, fds, files, ent["arrays"])
    check_stored_hybrid(plan, manifest, summ, epoch, lengths)
    return plan, manifest


def _check_counts(plan: HybridPlan, manifest: dict, lengths) -> None:
    """The O(1) checks a stamped epoch still gets: the pool and the number of samples."""
    lay = manifest["layout"]
    if plan.n_ranks != int(lay["dp"]) * int(lay["cp"]) or \
            plan.rank_capacity != int(lay["rank_capacity"]):
        raise ValueError(f"hybrid plan: summary n_ranks {plan.n_ranks} / rank_capacity "
                         f"{plan.rank_capacity} do not match the layout")
    n = int(manifest["dataset"]["n_samples"])
    if lengths is not None and np.asarray(lengths).shape[0] != n:
        raise ValueError(f"the job has {np.asarray(lengths).shape[0]} samples, the plan {n}")


@renamed(model="cost")
def hybrid_plan_source(path, *, layout: Optional[Layout] = None,
                       cost: Optional[CPCostModel] = None,
                       samples: Optional[SampleTable] = None, verify: VerifyMode = "once",
                       **planned) -> Callable[[int], HybridPlan]:
    """``epoch -> HybridPlan`` for ``HybridBatchSampler(plan=...)``: checks the manifest
    against the job once (:func:`check_hybrid_compatible`), then loads (and checks) each epoch
    on demand (``verify="once"``: the first process to open an epoch hashes and checks it,
    every other trusts its stamp; ``True``: every process)."""
    verify_mode(verify)
    job = dict(layout=layout, cost=cost, samples=samples, **planned)
    check_hybrid_compatible(load_hybrid_manifest(path), **job)
    lengths = None if samples is None else samples.lengths

    def load(epoch: int) -> HybridPlan:   # checked again: an overwrite may have replaced it
        plan, manifest = load_hybrid_plan(path, epoch, lengths=lengths, verify=verify)
        check_hybrid_compatible(manifest, **job)
        return plan
    return load


__all__ = ["PLANNED_WITH", "check_hybrid_compatible", "hybrid_header", "hybrid_plan_source",
           "load_hybrid_manifest", "load_hybrid_plan", "precompute_hybrid", "save_hybrid_plans"]
