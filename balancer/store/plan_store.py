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

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import struct
import sys
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

from ..config import Layout, PlannerConfig
from ..planning.plan import Items, Plan, microbatch_step_rank
from ..zigzag import cp_pad_unit

FORMAT_NAME = "balancer-plan"
FORMAT_VERSION = 2  # 2: sealed manifest (manifest_sha256)
MANIFEST = "manifest.json"
MANIFEST_DIGEST_KEY = "manifest_sha256"
#: test hook: a writer SIGKILLs itself at this named point of :meth:`PlanDirWriter.commit`
#: ('after-arrays', 'after-manifest', 'between-renames', 'after-rename')
KILL_ENV = "BALANCER_STORE_TEST_KILL_AT"
#: set to 1 to replace a plan with two renames instead of an atomic exchange (tests)
NO_EXCHANGE_ENV = "BALANCER_STORE_NO_EXCHANGE"
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
_EPOCH_RE = re.compile(r"epoch-\d{4,}")
_HIDDEN_RE = re.compile(r"(?P<kind>partial|old)-(?:(?P<host>.+)-(?P<pid>\d+)-)?[0-9a-f]{8}")


def _kill_point(name: str) -> None:
    """Test hook: die here, as a SIGKILL would, when ``KILL_ENV`` names this point."""
    if os.environ.get(KILL_ENV) == name:
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def _tag() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def manifest_digest(manifest: dict) -> str:
    """The seal of a manifest: SHA-256 of its canonical JSON without ``manifest_sha256``."""
    body = {k: v for k, v in manifest.items() if k != MANIFEST_DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def foreign_entry(path) -> Optional[str]:
    """The first entry of directory ``path`` that a plan store does not hold (relative name), or
    None when it holds only ``manifest.json`` and ``epoch-NNNN/<array>.npy`` regular files."""
    path = Path(path)
    for p in sorted(path.iterdir()):
        st = os.lstat(p)
        if p.name == MANIFEST and stat.S_ISREG(st.st_mode):
            continue
        if not (_EPOCH_RE.fullmatch(p.name) and stat.S_ISDIR(st.st_mode)):
            return p.name
        for q in sorted(p.iterdir()):
            if not (q.suffix == ".npy" and q.stem in ARRAYS and
                    stat.S_ISREG(os.lstat(q).st_mode)):
                return f"{p.name}/{q.name}"
    return None


def _has_plan_manifest(path: Path) -> bool:
    try:
        with open(path / MANIFEST) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and m.get("format") == FORMAT_NAME


def check_replaceable(path) -> None:
    """Raise ValueError unless ``path`` is a plan store (or an empty directory) that an
    overwrite may replace; the message names what is there."""
    path = Path(path)
    how = "--overwrite replaces only a plan directory written by precompute / save_plan"
    if path.is_symlink():
        raise ValueError(f"{path} is a symbolic link; {how}; refusing to replace it (give the "
                         f"link's target, or remove the link yourself)")
    if not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory; {how}; refusing to replace it "
                         f"(remove it yourself or choose another --out)")
    if not any(path.iterdir()):
        return
    if not _has_plan_manifest(path):
        raise ValueError(f"{path} is not a plan directory (no {MANIFEST} of format "
                         f"{FORMAT_NAME}); {how}; refusing to replace it (remove it yourself "
                         f"or choose another --out)")
    bad = foreign_entry(path)
    if bad is not None:
        raise ValueError(f"{path} holds {bad!r}, which is not part of a plan; {how}; refusing "
                         f"to replace it (move {bad!r} out of it, or choose another --out)")


def _owner_alive(host: Optional[str], pid: Optional[str]) -> Optional[bool]:
    """Whether the process that made a hidden directory still runs (None: cannot tell, it ran
    on another host or the name carries no owner)."""
    if host is None or pid is None or host != socket.gethostname():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def hidden_dirs(path) -> list[dict]:
    """Hidden siblings ``.NAME.partial-*`` / ``.NAME.old-*`` that writers of ``path`` made:
    ``{"path", "kind", "owner_alive"}`` (owner_alive None: another host or unknown)."""
    path = Path(path)
    out, prefix = [], f".{path.name}."
    try:
        siblings = sorted(path.parent.iterdir())
    except OSError:
        return out
    for p in siblings:
        if not p.name.startswith(prefix):
            continue
        m = _HIDDEN_RE.fullmatch(p.name[len(prefix):])
        if m is None or not p.is_dir() or p.is_symlink():
            continue
        out.append({"path": p, "kind": m["kind"],
                    "owner_alive": _owner_alive(m["host"], m["pid"])})
    return out


def _moved_aside(path: Path) -> Optional[dict]:
    """The complete old plan an overwrite killed between its two renames left aside, when
    ``path`` itself is missing (the newest such directory's :func:`hidden_dirs` entry)."""
    if path.exists() or path.is_symlink():
        return None
    olds = [h for h in hidden_dirs(path)
            if h["kind"] == "old" and _has_plan_manifest(h["path"])]
    return max(olds, key=lambda h: h["path"].stat().st_mtime_ns) if olds else None


def cleanup_stale(path) -> list[str]:
    """Finish what killed writers of ``path`` left: put back an old plan an overwrite moved
    aside (``path`` missing), remove hidden directories whose writer (on this host) is gone and
    that hold only plan files. Returns a line for every hidden directory left in place."""
    path = Path(path)
    old = _moved_aside(path)
    if old is not None and old["owner_alive"] is False:
        os.rename(old["path"], path)
        fsync_dir(path.parent)
    left = []
    for h in hidden_dirs(path):
        p = h["path"]
        if h["owner_alive"] is False and foreign_entry(p) is None:
            shutil.rmtree(p, ignore_errors=True)
        else:
            who = "its writer is still running" if h["owner_alive"] else \
                "its writer ran on another host or is unknown" if h["owner_alive"] is None else \
                "it holds files that are not part of a plan"
            left.append(f"{p}: left in place ({who}); remove it once no precompute writes "
                        f"{path}")
    return left


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap directories ``a`` and ``b`` (Linux renameat2 RENAME_EXCHANGE); False
    where the system or file system cannot."""
    if os.environ.get(NO_EXCHANGE_ENV) == "1" or not sys.platform.startswith("linux"):
        return False
    import ctypes
    import errno
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                   ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def exchange_supported(directory) -> bool:
    """Whether directories under ``directory`` can be swapped atomically."""
    d = Path(directory)
    a, b = d / f".xchg-a-{_tag()}", d / f".xchg-b-{_tag()}"
    a.mkdir()
    b.mkdir()
    try:
        return _exchange(a, b)
    finally:
        a.rmdir()
        b.rmdir()


class PlanDirWriter:
    """A plan directory under construction: a hidden sibling ``.NAME.partial-HOST-PID-RAND``
    that :meth:`commit` fsyncs and renames to ``path`` (or exchanges with the plan there).

    Constructing one first cleans up what killed writers of ``path`` left (see
    :func:`cleanup_stale`; what it cannot remove is in ``stale`` and warned about) and refuses
    an existing ``path`` unless ``overwrite`` and it is a plan store (:func:`check_replaceable`).
    With ``tmp`` (the ranks of a distributed writer) it only adopts that directory."""

    def __init__(self, path, *, overwrite: bool = False, tmp: Optional[Path] = None):
        self.path = Path(path)
        self.overwrite = overwrite
        self.stale: list[str] = []
        if tmp is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.stale = cleanup_stale(self.path)
            for line in self.stale:
                warnings.warn(line, stacklevel=2)
            self._check_target()
            tmp = self.path.parent / f".{self.path.name}.partial-{_tag()}"
            tmp.mkdir()
        self.tmp = Path(tmp)

    def _check_target(self) -> bool:
        """True when ``path`` holds something to replace (refused unless allowed)."""
        if not (self.path.exists() or self.path.is_symlink()):
            return False
        if not self.overwrite:
            raise FileExistsError(f"{self.path} already exists (use overwrite / --overwrite)")
        check_replaceable(self.path)
        return True

    def epoch_dir(self, epoch: int) -> Path:
        d = self.tmp / epoch_dirname(epoch)
        d.mkdir(exist_ok=True)
        return d

    def commit(self, manifest: dict) -> Path:
        _kill_point("after-arrays")
        manifest.setdefault("n_epochs", len(manifest.get("epochs", [])))
        manifest.pop(MANIFEST_DIGEST_KEY, None)
        manifest[MANIFEST_DIGEST_KEY] = manifest_digest(manifest)
        for d in sorted(p for p in self.tmp.iterdir() if p.is_dir()):
            fsync_dir(d)
        m = self.tmp / MANIFEST
        with open(m, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.tmp)
        _kill_point("after-manifest")
        parent = self.path.parent
        if not self._check_target() or not any(self.path.iterdir()):
            os.rename(self.tmp, self.path)  # nothing there, or an empty directory
            fsync_dir(parent)
            return self.path
        if _exchange(self.tmp, self.path):
            old = self.tmp  # now holds the old plan, under the hidden partial name
        else:
            old = parent / f".{self.path.name}.old-{_tag()}"
            os.rename(self.path, old)
            fsync_dir(parent)
            _kill_point("between-renames")
            os.rename(self.tmp, self.path)
        fsync_dir(parent)
        _kill_point("after-rename")
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


# ---- loading and checking -----------------------------------------------------------------
def resolve_plan_dir(path) -> Path:
    """``path``, or, when it is missing because an overwrite was killed between its two
    renames, the complete old plan that overwrite moved aside (read in place; the next writer
    of ``path`` puts it back)."""
    path = Path(path)
    if not path.exists():
        old = _moved_aside(path)
        if old is not None:
            return old["path"]
    return path


_HEX64 = re.compile(r"[0-9a-f]{64}")


class _Schema:
    """Type checks of a manifest's keys, with errors naming the key, its value and the type
    wanted (never a KeyError / TypeError traceback)."""

    def __init__(self, src: Path):
        self.src = src

    def fail(self, key: str, what: str):
        raise ValueError(f"{self.src}: manifest key {key!r} {what}; the plan cannot be read "
                         f"(re-run precompute --overwrite to rewrite it)")

    def get(self, d: dict, key: str, where: str, types, *, optional=False, minimum=None):
        full = f"{where}.{key}" if where else key
        if key not in d:
            if optional:
                return None
            self.fail(full, "is missing")
        v = d[key]
        if optional and v is None:
            return None
        ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in
                                           (types if isinstance(types, tuple) else (types,)))
        if not ok:
            want = " or ".join(t.__name__ for t in (types if isinstance(types, tuple)
                                                    else (types,)))
            self.fail(full, f"is {type(v).__name__} {_short(v)}, expected {want}")
        if minimum is not None and v < minimum:
            self.fail(full, f"is {v}, expected >= {minimum}")
        return v


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def check_manifest_schema(manifest: dict, src="manifest") -> None:
    """Raise ValueError naming the first missing key or wrong type of a plan manifest."""
    from pydantic import ValidationError
    sc = _Schema(Path(src))
    for key in ("layout", "config"):
        v = sc.get(manifest, key, "", dict)
        try:
            (Layout if key == "layout" else PlannerConfig).model_validate(v)
        except ValidationError as e:
            sc.fail(key, "is invalid: " + "; ".join(
                f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()))
    cm = sc.get(manifest, "cost_model", "", dict)
    sc.get(cm, "name", "cost_model", str)
    sc.get(cm, "spec", "cost_model", dict, optional=True)
    ds = sc.get(manifest, "dataset", "", dict)
    sc.get(ds, "fingerprint", "dataset", str)
    sc.get(ds, "n_samples", "dataset", int, minimum=0)
    sc.get(ds, "total_tokens", "dataset", int, optional=True, minimum=0)
    sc.get(manifest, "extra", "", dict, optional=True)
    epochs = sc.get(manifest, "epochs", "", list)
    n_ep = sc.get(manifest, "n_epochs", "", int, optional=True)
    if n_ep is not None and n_ep != len(epochs):
        sc.fail("n_epochs", f"is {n_ep}, but 'epochs' lists {len(epochs)}")
    seen = set()
    for k, e in enumerate(epochs):
        w = f"epochs[{k}]"
        if not isinstance(e, dict):
            sc.fail(w, f"is {type(e).__name__}, expected dict")
        ep = sc.get(e, "epoch", w, int, minimum=0)
        if ep in seen:
            sc.fail(f"{w}.epoch", f"is {ep}, which an earlier entry has too")
        seen.add(ep)
        sc.get(e, "dir", w, str)
        sc.get(e, "stats", w, dict, optional=True)
        summ = sc.get(e, "summary", w, dict)
        for key in ("steps", "microbatches", "entries", "tokens", "leftover"):
            sc.get(summ, key, f"{w}.summary", int, minimum=0)
        arrays = sc.get(e, "arrays", w, dict)
        for name in ARRAYS:
            a = sc.get(arrays, name, f"{w}.arrays", dict)
            aw = f"{w}.arrays.{name}"
            sc.get(a, "file", aw, str)
            sc.get(a, "dtype", aw, str)
            h = sc.get(a, "sha256", aw, str)
            if not _HEX64.fullmatch(h):
                sc.fail(f"{aw}.sha256", f"is {_short(h)}, expected 64 hex digits")
            shape = sc.get(a, "shape", aw, list)
            if len(shape) != 1 or not isinstance(shape[0], int) or isinstance(shape[0], bool) \
                    or shape[0] < 0:
                sc.fail(f"{aw}.shape", f"is {_short(shape)}, expected [n] with n >= 0")


def load_manifest(path) -> dict:
    """The manifest of a plan directory; a clear ValueError when it is missing (an interrupted
    write), unreadable, not a plan of a format this code reads, edited after it was written
    (its seal ``manifest_sha256`` differs), or missing keys / of wrong types."""
    path = resolve_plan_dir(path)
    if not path.is_dir():
        raise ValueError(f"{path}: no plan directory there")
    m = path / MANIFEST
    if m.is_symlink():
        raise ValueError(f"{m}: is a symbolic link; refused (the plan store reads only regular "
                         f"files inside its directory)")
    if not m.is_file():
        raise ValueError(f"{path}: incomplete plan (no {MANIFEST}); was precompute interrupted?")
    try:
        with open(m) as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{m}: the manifest is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise ValueError(f"{m}: not a {FORMAT_NAME} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{m}: format_version: plan has {manifest.get('format_version')!r}, "
                         f"expected {FORMAT_VERSION} (re-run precompute to rewrite the plan "
                         f"in this format)")
    seal = manifest.get(MANIFEST_DIGEST_KEY)
    if not isinstance(seal, str) or seal != manifest_digest(manifest):
        what = "has no" if seal is None else "does not match its"
        raise ValueError(f"{m}: the manifest was edited or corrupted: its content {what} "
                         f"{MANIFEST_DIGEST_KEY} (re-run precompute --overwrite)")
    check_manifest_schema(manifest, m)
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


def _plain_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name \
        and "\x00" not in name and not os.path.isabs(name)


def _no_link(p: Path, kind: str) -> None:
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise ValueError(f"{p}: the plan's {kind} is a symbolic link; refused (the plan store "
                         f"reads only regular files inside its directory)")


def _epoch_path(path: Path, ent: dict, epoch: int) -> Path:
    name = ent["dir"]
    if not _plain_name(name):
        raise ValueError(f"{path / MANIFEST}: epoch {epoch} 'dir' {_short(name)} is not a "
                         f"directory name inside the plan directory; refused")
    d = path / name
    _no_link(d, f"epoch {epoch} directory")
    return d


def _array_path(d: Path, name: str, info: dict, epoch: int) -> Path:
    fname = info["file"]
    if not _plain_name(fname):
        raise ValueError(f"{d.parent / MANIFEST}: epoch {epoch} array {name!r}: 'file' "
                         f"{_short(fname)} is not a file name inside the plan directory; "
                         f"refused")
    f = d / fname
    _no_link(f, f"array {name!r}")
    return f


def _open_array(f: Path, name: str, info: dict) -> np.ndarray:
    if not f.is_file():
        raise ValueError(f"{f}: array {name!r} is missing")
    n = int(info["shape"][0])
    try:
        dt = np.dtype(info["dtype"])
    except TypeError:
        raise ValueError(f"{f}: manifest dtype {_short(info['dtype'])} of {name!r} is not a "
                         f"dtype, expected {ARRAYS[name]}") from None
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
                manifest: Optional[dict] = None, check_plan: bool = True) -> dict:
    """Every stored array of ``epoch``, memory-mapped read-only (name -> array). Paths are
    confined to the plan directory; sizes, headers and the O(steps + microbatches) invariants
    are always checked; ``verify`` also checks every array's SHA-256 (reads the files once,
    hashing arrays in parallel threads) and the O(entries) invariants: capacity, coverage of
    every sample, token counts. ``check_plan=False`` skips those invariants (not the hashes):
    for diagnosing a broken plan (``report --plan``), never for training from it."""
    path = resolve_plan_dir(path)
    manifest = manifest if manifest is not None else load_manifest(path)
    check_compatible(manifest)
    ent = _epoch_entry(manifest, epoch)
    d = _epoch_path(path, ent, epoch)
    infos = ent["arrays"]
    files = {name: _array_path(d, name, infos[name], epoch) for name in ARRAYS}
    arrays = {name: _open_array(files[name], name, infos[name]) for name in ARRAYS}
    if verify:
        names = [k for k in ARRAYS if arrays[k].size]
        with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as ex:
            digests = dict(zip(names, ex.map(lambda k: file_digest(files[k]), names)))
        empty = hashlib.sha256().hexdigest()
        for name in ARRAYS:
            got = digests.get(name, empty)
            if got != infos[name]["sha256"]:
                raise ValueError(f"{files[name]}: SHA-256 of {name!r} differs from "
                                 f"the manifest (the array was edited or corrupted)")
    _check_structure(arrays, manifest, epoch)
    _check_against_manifest(arrays, manifest, ent, epoch, full=verify and check_plan)
    return arrays


def _check_structure(a: dict, manifest: dict, epoch: int) -> None:
    """Cheap consistency checks (O(steps + microbatches)) that hold for every valid plan."""
    lay = manifest["layout"]
    dp, per_rank = int(lay["dp"]), int(lay["microbatches"])
    e, m, s = a["entry_sample"].shape[0], a["mb_fwd"].shape[0], a["step_mbs"].shape[0]
    bad = None
    if any(a[k].shape[0] != e for k in ("entry_start", "entry_length", "entry_delay")):
        bad = "entry arrays differ in length"
    elif any(a[k].shape[0] != a["leftover_sample"].shape[0]
             for k in ("leftover_start", "leftover_length")):
        bad = "leftover arrays differ in length"
    elif a["mb_offsets"].shape[0] != m + 1 or int(a["mb_offsets"][0]) != 0 or \
            int(a["mb_offsets"][-1]) != e:
        bad = "mb_offsets does not span the entries"
    elif m and (np.diff(a["mb_offsets"]) <= 0).any():
        k = int(np.flatnonzero(np.diff(a["mb_offsets"]) <= 0)[0])
        bad = f"microbatch {k} is empty or mb_offsets decreases there"
    elif any(a[k].shape[0] != m for k in ("mb_bwd", "mb_step", "mb_rank")):
        bad = "microbatch arrays differ in length"
    elif s and (int(a["step_mbs"].min()) < 1 or int(a["step_mbs"].max()) > per_rank):
        k = int(np.flatnonzero((a["step_mbs"] < 1) | (a["step_mbs"] > per_rank))[0])
        bad = (f"step_mbs of step {k} is {int(a['step_mbs'][k])} microbatches per rank, "
               f"outside 1..microbatches={per_rank} of the layout")
    elif int(a["step_mbs"].sum()) * dp != m:
        bad = f"step_mbs sums to {int(a['step_mbs'].sum())} x dp={dp}, not {m} microbatches"
    elif s and int(a["mb_step"][-1]) != s - 1:
        bad = "mb_step does not end at the last step"
    else:
        step, rank = microbatch_step_rank(a["step_mbs"], dp)
        if not np.array_equal(a["mb_step"], step) or not np.array_equal(a["mb_rank"], rank):
            k = int(np.flatnonzero((a["mb_step"] != step) | (a["mb_rank"] != rank))[0])
            bad = (f"microbatch {k} is stored as step {int(a['mb_step'][k])} rank "
                   f"{int(a['mb_rank'][k])}, but step_mbs with dp={dp} puts it at step "
                   f"{int(step[k])} rank {int(rank[k])}")
    if bad:
        raise ValueError(f"plan epoch {epoch} is inconsistent: {bad}")


def _check_against_manifest(a: dict, manifest: dict, ent: dict, epoch: int,
                            full: bool) -> None:
    """The arrays against what the manifest states: summary counts always; with ``full`` the
    O(entries) invariants: token count, sample ids in range, capacity, every sample covered,
    whole samples at most once (and tokens equal to the dataset's without carried-in items)."""
    summ, where = ent["summary"], f"plan epoch {epoch}"
    have = {"steps": a["step_mbs"].shape[0], "microbatches": a["mb_fwd"].shape[0],
            "entries": a["entry_sample"].shape[0], "leftover": a["leftover_sample"].shape[0]}
    for k, v in have.items():
        if summ[k] != v:
            raise ValueError(f"{where}: manifest summary.{k} {summ[k]} but the arrays hold {v}")
    if not full:
        return
    tokens = int(np.asarray(a["entry_length"]).sum())
    if summ["tokens"] != tokens:
        raise ValueError(f"{where}: manifest summary.tokens {summ['tokens']} but the arrays "
                         f"hold {tokens}")
    lay, ds = manifest["layout"], manifest["dataset"]
    n = int(ds["n_samples"])
    samp = np.concatenate([a["entry_sample"], a["leftover_sample"]])
    start = np.concatenate([a["entry_start"], a["leftover_start"]])
    length = np.concatenate([a["entry_length"], a["leftover_length"]])
    bad = (samp < 0) | (samp >= n) | (start < 0) | (length <= 0)
    if bad.any():
        k = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{where}: {int(bad.sum())} documents are out of range (first: sample "
                         f"{int(samp[k])} start {int(start[k])} length {int(length[k])}; "
                         f"samples are 0..{n - 1}, dataset.n_samples={n})")
    cp, cap = int(lay["cp"]), int(lay["capacity"])
    if a["mb_fwd"].shape[0]:
        unit = cp_pad_unit(cp)
        padded = -(-np.asarray(a["entry_length"], np.int64) // unit) * unit
        over = np.add.reduceat(padded, np.asarray(a["mb_offsets"][:-1])) > cap
        if over.any():
            k = int(np.flatnonzero(over)[0])
            raise ValueError(f"{where}: {int(over.sum())} microbatches exceed the capacity "
                             f"{cap} of the layout (first: microbatch {k})")
    if n:
        seen = np.bincount(samp, minlength=n)
        if (seen == 0).any():
            k = int(np.flatnonzero(seen == 0)[0])
            raise ValueError(f"{where}: {int((seen == 0).sum())} samples of the dataset's {n} "
                             f"are not in the plan (first: sample {k}); nothing may be lost")
    carried = int((ent.get("stats") or {}).get("carried_in", 0) or 0)
    if carried == 0 and n:
        whole = np.bincount(samp[start == 0], minlength=n)
        if (whole > 1).any():
            k = int(np.flatnonzero(whole > 1)[0])
            raise ValueError(f"{where}: sample {k} starts {int(whole[k])} times; nothing may be "
                             f"duplicated")
        total = ds.get("total_tokens")
        if total is not None and int(length.sum()) != int(total):
            raise ValueError(f"{where}: the plan holds {int(length.sum())} tokens (placed and "
                             f"left over), the dataset has total_tokens={int(total)}")


def load_plan(path, epoch: int = 0, *, verify: bool = True,
              check_plan: bool = True) -> tuple[Plan, dict]:
    """The stored plan of ``epoch`` (arrays memory-mapped) and the manifest. Raises ValueError
    on a missing manifest or array, a wrong format version, an edited manifest, a path outside
    the plan directory, a size/header/hash mismatch, or arrays that break the manifest's
    invariants (see :func:`load_arrays`)."""
    path = resolve_plan_dir(path)
    manifest = load_manifest(path)
    a = load_arrays(path, epoch, verify=verify, manifest=manifest, check_plan=check_plan)
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
