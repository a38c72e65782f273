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
step-major, then rank-major, then in pipeline order (as in :class:`balancer.planner.Plan`).
CP sharding is per-document zigzag (``cp_sharding``), computed by the loader, not stored.

Writes are atomic: everything goes into a hidden sibling directory, every file and the
directory are fsynced, the manifest is written last, and the directory is renamed into place.
A killed writer leaves at most a ``.NAME.partial-*`` directory, which never loads (no manifest).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import struct
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

from .config import Layout, PlannerConfig
from .planner import Items, Plan

FORMAT_NAME = "balancer-plan"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
HEADER_BYTES = 128  # fixed .npy header size: data always starts at this offset
#: every array of an epoch and its on-disk dtype (little-endian)
ARRAYS = {
    "entry_sample": "<i8", "entry_start": "<i8", "entry_length": "<i8", "entry_delay": "<i4",
    "mb_offsets": "<i8", "mb_step": "<i4", "mb_rank": "<i4", "mb_fwd": "<f8", "mb_bwd": "<f8",
    "step_mbs": "<i8", "leftover_sample": "<i8", "leftover_start": "<i8",
    "leftover_length": "<i8",
}
_HASH_BLOCK = 1 << 24


# ---- .npy files with a fixed header ----------------------------------------------------------
def npy_header(dtype: str, n: int) -> bytes:
    """A version 1.0 ``.npy`` header for a 1-D array, padded to exactly HEADER_BYTES."""
    d = "{'descr': '%s', 'fortran_order': False, 'shape': (%d,), }" % (np.dtype(dtype).str, n)
    pad = HEADER_BYTES - 10 - len(d) - 1
    if pad < 0:
        raise ValueError(f"shape {n} does not fit a {HEADER_BYTES}-byte .npy header")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", HEADER_BYTES - 10) + d.encode() + \
        b" " * pad + b"\n"


def fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ArrayAppender:
    """Writes a 1-D ``.npy`` by appending chunks in order, hashing as it goes; ``close``
    writes the final header and fsyncs. Memory use is that of one chunk."""

    def __init__(self, path: Path, dtype: str):
        self.path, self.dtype, self.n = Path(path), np.dtype(dtype), 0
        self._f = open(self.path, "wb")
        self._f.write(npy_header(dtype, 0))
        self._h = hashlib.sha256()

    def append(self, a) -> None:
        a = np.ascontiguousarray(a, dtype=self.dtype)
        if a.size:
            b = memoryview(a).cast("B")
            self._h.update(b)
            self._f.write(b)
            self.n += a.shape[0]

    def close(self) -> dict:
        self._f.seek(0)
        self._f.write(npy_header(self.dtype.str, self.n))
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return {"file": self.path.name, "dtype": self.dtype.str, "shape": [self.n],
                "sha256": self._h.hexdigest()}


def allocate_array(path: Path, dtype: str, n: int) -> None:
    """Create a ``.npy`` of ``n`` elements (sparse) whose slices several writers then fill."""
    with open(path, "wb") as f:
        f.write(npy_header(dtype, n))
        f.truncate(HEADER_BYTES + n * np.dtype(dtype).itemsize)


def write_slice(path: Path, dtype: str, n: int, offset: int, a) -> None:
    """Write ``a`` at element ``offset`` of an allocated array and fsync it."""
    a = np.ascontiguousarray(a, dtype=dtype)
    if offset < 0 or offset + a.shape[0] > n:
        raise ValueError(f"{path.name}: slice {offset}:{offset + a.shape[0]} is outside 0:{n}")
    if not a.size:
        return
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + offset * a.itemsize)
        f.write(memoryview(a).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def file_digest(path: Path) -> str:
    """SHA-256 of an array file's data (the bytes after the header), read in blocks (hashlib
    releases the GIL, so several files hash in parallel threads)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        while True:
            b = f.read(_HASH_BLOCK)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


# ---- atomic plan directories --------------------------------------------------------------
class PlanDirWriter:
    """A plan directory under construction: a hidden sibling ``.NAME.partial-HOST-PID-RAND``
    that :meth:`commit` fsyncs and renames to ``path``."""

    def __init__(self, path, *, overwrite: bool = False, tmp: Optional[Path] = None):
        self.path = Path(path)
        if self.path.exists() and not overwrite:
            raise FileExistsError(f"{self.path} already exists (use overwrite / --overwrite)")
        self.overwrite = overwrite
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if tmp is None:
            tag = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            tmp = self.path.parent / f".{self.path.name}.partial-{tag}"
            tmp.mkdir()
        self.tmp = Path(tmp)

    def epoch_dir(self, epoch: int) -> Path:
        d = self.tmp / epoch_dirname(epoch)
        d.mkdir(exist_ok=True)
        return d

    def commit(self, manifest: dict) -> Path:
        manifest.setdefault("n_epochs", len(manifest.get("epochs", [])))
        for d in sorted(p for p in self.tmp.iterdir() if p.is_dir()):
            fsync_dir(d)
        m = self.tmp / MANIFEST
        with open(m, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.tmp)
        old = None
        if self.path.exists():
            if not self.overwrite:
                raise FileExistsError(f"{self.path} appeared while the plan was written")
            old = self.path.parent / f".{self.path.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(self.path, old)
        os.rename(self.tmp, self.path)
        fsync_dir(self.path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.path

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def epoch_dirname(epoch: int) -> str:
    return f"epoch-{int(epoch):04d}"


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
    n_mb = plan.step_mbs * plan.layout.dp
    mb_step = np.repeat(np.arange(plan.n_steps), n_mb)
    first = plan.step_offsets[:-1]
    mb_rank = (np.arange(plan.n_microbatches) - first[mb_step]) // np.repeat(plan.step_mbs, n_mb)
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


# ---- loading and checking -----------------------------------------------------------------
def load_manifest(path) -> dict:
    """The manifest of a plan directory; a clear ValueError when it is missing (an interrupted
    write), unreadable, or not a plan of a format this code reads."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: no plan directory there")
    m = path / MANIFEST
    if not m.is_file():
        raise ValueError(f"{path}: incomplete plan (no {MANIFEST}); was precompute interrupted?")
    try:
        with open(m) as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{m}: the manifest is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ValueError(f"{m}: not a {FORMAT_NAME} manifest")
    return manifest


def check_compatible(manifest: dict, *, layout=None, dataset_fingerprint: Optional[str] = None,
                     n_samples: Optional[int] = None, format_version: Optional[int] = None) -> None:
    """Refuse a plan made for another job: raises ValueError naming every value that differs
    (format version, dp/pp/cp/microbatches/capacity, dataset fingerprint, sample count).
    ``format_version`` defaults to the version this code reads."""
    diffs = []
    want_v = FORMAT_VERSION if format_version is None else int(format_version)
    if manifest.get("format_version") != want_v:
        diffs.append(f"format_version: plan has {manifest.get('format_version')!r}, "
                     f"expected {want_v}")
    if layout is not None:
        want = layout.model_dump() if hasattr(layout, "model_dump") else dict(layout)
        have = manifest.get("layout", {})
        for k, v in want.items():
            if have.get(k) != v:
                diffs.append(f"layout {k}: plan has {k}={have.get(k)!r}, the job has {k}={v!r}")
    ds = manifest.get("dataset", {})
    if dataset_fingerprint is not None and ds.get("fingerprint") != dataset_fingerprint:
        diffs.append(f"dataset fingerprint: plan has {ds.get('fingerprint')!r}, the job's "
                     f"dataset has {dataset_fingerprint!r}")
    if n_samples is not None and ds.get("n_samples") != int(n_samples):
        diffs.append(f"n_samples: plan has {ds.get('n_samples')!r}, the job's dataset has "
                     f"{int(n_samples)}")
    if diffs:
        raise ValueError("the plan does not match this job: " + "; ".join(diffs))


def _epoch_entry(manifest: dict, epoch: int) -> dict:
    for e in manifest.get("epochs", []):
        if e.get("epoch") == epoch:
            return e
    have = [e.get("epoch") for e in manifest.get("epochs", [])]
    raise ValueError(f"the plan has no epoch {epoch} (epochs: {have})")


def _open_array(d: Path, name: str, info: dict) -> np.ndarray:
    f = d / info.get("file", f"{name}.npy")
    if not f.is_file():
        raise ValueError(f"{f}: array {name!r} is missing")
    n = int(info["shape"][0])
    dt = np.dtype(info["dtype"])
    if dt != np.dtype(ARRAYS[name]):
        raise ValueError(f"{f}: manifest dtype {dt.str} of {name!r}, expected {ARRAYS[name]}")
    size, want = f.stat().st_size, HEADER_BYTES + n * dt.itemsize
    if size != want:
        raise ValueError(f"{f}: {size} bytes, expected {want} for {n} x {dt.str} (truncated or "
                         f"edited)")
    with open(f, "rb") as fh:
        head = fh.read(HEADER_BYTES)
    if head != npy_header(dt.str, n):
        raise ValueError(f"{f}: header does not describe {n} x {dt.str} as the manifest says")
    if n == 0:
        return np.zeros(0, dt)
    return np.load(f, mmap_mode="r", allow_pickle=False)


def load_arrays(path, epoch: int = 0, *, verify: bool = True,
                manifest: Optional[dict] = None) -> dict:
    """Every stored array of ``epoch``, memory-mapped read-only (name -> array). Sizes and
    headers are always checked; ``verify`` also checks every array's SHA-256 (reads the files
    once, hashing arrays in parallel threads)."""
    path = Path(path)
    manifest = manifest if manifest is not None else load_manifest(path)
    check_compatible(manifest)
    ent = _epoch_entry(manifest, epoch)
    d = path / ent["dir"]
    infos = ent.get("arrays", {})
    missing = sorted(set(ARRAYS) - set(infos))
    if missing:
        raise ValueError(f"{path}: the manifest lists no array {missing[0]!r} for epoch {epoch}")
    arrays = {name: _open_array(d, name, infos[name]) for name in ARRAYS}
    if verify:
        names = [k for k in ARRAYS if arrays[k].size]
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as ex:
            digests = dict(zip(names, ex.map(lambda k: file_digest(d / infos[k]["file"]), names)))
        empty = hashlib.sha256().hexdigest()
        for name in ARRAYS:
            got = digests.get(name, empty)
            if got != infos[name]["sha256"]:
                raise ValueError(f"{d / infos[name]['file']}: SHA-256 of {name!r} differs from "
                                 f"the manifest (the array was edited or corrupted)")
    _check_structure(arrays, manifest, epoch)
    return arrays


def _check_structure(a: dict, manifest: dict, epoch: int) -> None:
    """Cheap consistency checks (O(steps + microbatches)) that hold for every valid plan."""
    dp = int(manifest["layout"]["dp"])
    e, m, s = a["entry_sample"].shape[0], a["mb_fwd"].shape[0], a["step_mbs"].shape[0]
    bad = None
    if any(a[k].shape[0] != e for k in ("entry_start", "entry_length", "entry_delay")):
        bad = "entry arrays differ in length"
    elif a["mb_offsets"].shape[0] != m + 1 or int(a["mb_offsets"][0]) != 0 or \
            int(a["mb_offsets"][-1]) != e:
        bad = "mb_offsets does not span the entries"
    elif any(a[k].shape[0] != m for k in ("mb_bwd", "mb_step", "mb_rank")):
        bad = "microbatch arrays differ in length"
    elif int(a["step_mbs"].sum()) * dp != m:
        bad = f"step_mbs sums to {int(a['step_mbs'].sum())} x dp={dp}, not {m} microbatches"
    elif s and int(a["mb_step"][-1]) != s - 1:
        bad = "mb_step does not end at the last step"
    if bad:
        raise ValueError(f"plan epoch {epoch} is inconsistent: {bad}")


def load_plan(path, epoch: int = 0, *, verify: bool = True) -> tuple[Plan, dict]:
    """The stored plan of ``epoch`` (arrays memory-mapped) and the manifest. Raises ValueError
    on a missing manifest or array, a wrong format version, a size/header/hash mismatch."""
    manifest = load_manifest(path)
    a = load_arrays(path, epoch, verify=verify, manifest=manifest)
    ent = _epoch_entry(manifest, epoch)
    ds = manifest["dataset"]
    plan = Plan(layout=Layout.model_validate(manifest["layout"]),
                config=PlannerConfig.model_validate(manifest["config"]),
                cost_model=manifest["cost_model"]["name"], epoch=int(epoch),
                n_samples=int(ds["n_samples"]), dataset_fingerprint=ds["fingerprint"],
                entry_sample=a["entry_sample"], entry_start=a["entry_start"],
                entry_length=a["entry_length"], entry_delay=a["entry_delay"],
                mb_offsets=a["mb_offsets"], step_mbs=a["step_mbs"], mb_fwd=a["mb_fwd"],
                mb_bwd=a["mb_bwd"],
                leftover=Items(a["leftover_sample"], a["leftover_start"], a["leftover_length"]),
                stats=dict(ent.get("stats", {})))
    return plan, manifest


def plan_source(path, *, layout=None, dataset_fingerprint: Optional[str] = None,
                n_samples: Optional[int] = None, verify: bool = True) -> Callable[[int], Plan]:
    """``epoch -> Plan`` for ``PackedBatchSampler(plan=...)``: checks the manifest against the
    running job once, then loads each epoch's plan on demand."""
    check_compatible(load_manifest(path), layout=layout, dataset_fingerprint=dataset_fingerprint,
                     n_samples=n_samples)
    return lambda epoch: load_plan(path, epoch, verify=verify)[0]
