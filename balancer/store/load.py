"""Reading plans back: the manifest's schema and seal, paths confined to the plan directory,
the arrays checked against the manifest and against the plan's own structure."""
from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..config import Layout, PlannerConfig
from ..planning.plan import Items, Plan, microbatch_step_rank
from ..zigzag import cp_pad_unit
from .atomic import _moved_aside, manifest_digest
from .files import (ARRAYS, FORMAT_NAME, FORMAT_VERSION, HYBRID_FORMAT_NAME, MANIFEST,
                    MANIFEST_DIGEST_KEY, fd_digest)
from .snapshot import PlanSnapshot, open_array, read_whole
from .verified import VerifyMode, stamp_matches, verify_lock, verify_mode, write_stamp


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


def read_sealed_manifest(path, fmt: str, version: int) -> tuple[dict, Path]:
    """``(manifest, its path)`` of a plan directory whose manifest has format ``fmt`` and
    ``format_version`` ``version`` and an intact seal; a ValueError saying what is wrong
    otherwise (a hybrid DP x CP plan read as a fixed one, or the reverse, is named)."""
    return read_whole(path, lambda snap: sealed_manifest_of(snap, fmt, version),
                      resolve_plan_dir)


def sealed_manifest_of(snap: PlanSnapshot, fmt: str, version: int) -> tuple[dict, Path]:
    """:func:`read_sealed_manifest` of the plan directory ``snap`` holds open."""
    m = snap.path / MANIFEST
    raw = snap.manifest_bytes()   # links, FIFOs, devices refused unopened
    if raw is None:
        raise ValueError(f"{snap.path}: incomplete plan (no {MANIFEST}); was precompute "
                         f"interrupted?")
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{m}: the manifest is not valid JSON ({e})") from None
    got = manifest.get("format") if isinstance(manifest, dict) else None
    if got == HYBRID_FORMAT_NAME and fmt != got:
        raise ValueError(f"{m}: a hybrid DP x CP plan (cp_mode='hybrid', written by precompute "
                         f"--cp-mode hybrid): train from it with HybridBatchSampler(plan=...) "
                         f"or read it with balancer.store.hybrid.load_hybrid_plan")
    if got == FORMAT_NAME and fmt != got:
        raise ValueError(f"{m}: a fixed-CP plan (cp_mode='fixed'): train from it with "
                         f"PackedBatchSampler(plan=...) or read it with load_plan")
    if got != fmt:
        raise ValueError(f"{m}: not a {fmt} manifest")
    if manifest.get("format_version") != version:
        raise ValueError(f"{m}: format_version: plan has {manifest.get('format_version')!r}, "
                         f"expected {version} (re-run precompute to rewrite the plan "
                         f"in this format)")
    seal = manifest.get(MANIFEST_DIGEST_KEY)
    if not isinstance(seal, str) or seal != manifest_digest(manifest):
        what = "has no" if seal is None else "does not match its"
        raise ValueError(f"{m}: the manifest was edited or corrupted: its content {what} "
                         f"{MANIFEST_DIGEST_KEY} (re-run precompute --overwrite)")
    return manifest, m


def load_manifest(path) -> dict:
    """The manifest of a plan directory; a clear ValueError when it is missing (an interrupted
    write), unreadable, not a plan of a format this code reads, edited after it was written
    (its seal ``manifest_sha256`` differs), or missing keys / of wrong types."""
    return read_whole(path, _manifest_of, resolve_plan_dir)


def _manifest_of(snap: PlanSnapshot) -> dict:
    manifest, m = sealed_manifest_of(snap, FORMAT_NAME, FORMAT_VERSION)
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
        diffs += [f"layout {k}: plan has {k}={h!r}, the job has {k}={v!r}"
                  for k, h, v in layout_differences(manifest.get("layout", {}), layout)]
    ds = manifest.get("dataset", {})
    if dataset_fingerprint is not None and ds.get("fingerprint") != dataset_fingerprint:
        diffs.append(f"dataset fingerprint: plan has {ds.get('fingerprint')!r}, the job's "
                     f"dataset has {dataset_fingerprint!r}")
    if n_samples is not None and ds.get("n_samples") != int(n_samples):
        diffs.append(f"n_samples: plan has {ds.get('n_samples')!r}, the job's dataset has "
                     f"{int(n_samples)}")
    if diffs:
        raise ValueError("the plan does not match this job: " + "; ".join(diffs))


def layout_differences(have: dict, layout) -> list[tuple]:
    """``(field, plan's value, job's value)`` of every layout field that differs between a
    stored layout dump ``have`` and the job's ``layout`` (a Layout or a mapping). Both ways: a
    field left out of one side's dump at its default (``sync``, ``cp_mode``, ...) means the
    default there, so a plan made with another value is still refused."""
    want = layout.model_dump() if hasattr(layout, "model_dump") else dict(layout)
    defaults = {k: f.default for k, f in type(layout).model_fields.items()} \
        if hasattr(type(layout), "model_fields") else {}
    out = []
    for k in list(want) + [k for k in have if k not in want and k in defaults]:
        v, h = want.get(k, defaults.get(k)), have.get(k, defaults.get(k))
        if h != v:
            out.append((k, h, v))
    return out


def _epoch_entry(manifest: dict, epoch: int) -> dict:
    for e in manifest.get("epochs", []):
        if e.get("epoch") == epoch:
            return e
    have = [e.get("epoch") for e in manifest.get("epochs", [])]
    raise ValueError(f"the plan has no epoch {epoch} (epochs: {have})")


def _plain_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name \
        and "\x00" not in name and not os.path.isabs(name)


def open_epoch_arrays(snap: PlanSnapshot, ent: dict, epoch: int,
                      dtypes: dict) -> tuple[dict, dict, dict]:
    """``(arrays, descriptors, paths)`` of every array in ``dtypes`` of the manifest's epoch
    entry ``ent``, opened in the directory ``snap`` holds: names confined to the plan
    directory, links and other non-regular files refused, sizes and headers checked."""
    name = ent["dir"]
    if not _plain_name(name):
        raise ValueError(f"{snap.path / MANIFEST}: epoch {epoch} 'dir' {_short(name)} is not a "
                         f"directory name inside the plan directory; refused")
    dfd = snap.open_dir(name, f"epoch {epoch} directory")
    arrays, fds, files = {}, {}, {}
    for k in dtypes:
        info = ent["arrays"][k]
        fname = info["file"]
        if not _plain_name(fname):
            raise ValueError(f"{snap.path / MANIFEST}: epoch {epoch} array {k!r}: 'file' "
                             f"{_short(fname)} is not a file name inside the plan directory; "
                             f"refused")
        files[k] = snap.path / name / fname
        fds[k] = snap.open_file(dfd, fname, files[k], f"array {k!r}")
        arrays[k] = open_array(fds[k], files[k], k, info, dtypes)
    return arrays, fds, files


def verify_digests(arrays: dict, fds: dict, files: dict, infos: dict) -> None:
    """Every array's SHA-256 against the manifest's (arrays hashed in parallel threads)."""
    names = [k for k in arrays if arrays[k].size]
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as ex:
        digests = dict(zip(names, ex.map(lambda k: fd_digest(fds[k]), names)))
    empty = hashlib.sha256().hexdigest()
    for k in arrays:
        if digests.get(k, empty) != infos[k]["sha256"]:
            raise ValueError(f"{files[k]}: SHA-256 of {k!r} differs from the manifest (the "
                             f"array was edited or corrupted)")


def load_arrays(path, epoch: int = 0, *, verify: VerifyMode = True,
                manifest: Optional[dict] = None, check_plan: bool = True) -> dict:
    """Every stored array of ``epoch``, memory-mapped read-only (name -> array). Paths are
    confined to the plan directory; sizes, headers and the O(steps + microbatches) invariants
    are always checked; ``verify=True`` also checks every array's SHA-256 (reads the files once,
    hashing arrays in parallel threads) and the O(entries) invariants: capacity, coverage of
    every sample, token counts. ``verify="once"`` does that only when no stamp shows that these
    exact files already passed it (see :mod:`balancer.store.verified`): the first process to
    open the epoch verifies, the others wait for it and trust its stamp. ``check_plan=False``
    skips those invariants (not the hashes) and writes no stamp: for diagnosing a broken plan
    (``report --plan``), never for training from it.

    The manifest and the arrays are read from one generation of the plan directory (see
    :mod:`balancer.store.snapshot`); a ``manifest`` read earlier must be that generation's
    (same seal), or a ValueError says the plan was replaced since."""
    verify = verify_mode(verify)
    return read_whole(path, lambda snap: _arrays_of(snap, epoch, verify, check_plan,
                                                    manifest)[0], resolve_plan_dir)


def _arrays_of(snap: PlanSnapshot, epoch: int, verify: bool, check_plan: bool,
               given: Optional[dict] = None) -> tuple[dict, dict, dict]:
    manifest = _manifest_of(snap)
    if given is not None and given.get(MANIFEST_DIGEST_KEY) != manifest[MANIFEST_DIGEST_KEY]:
        raise ValueError(f"{snap.path}: the plan was replaced since the manifest given was read "
                         f"(its {MANIFEST_DIGEST_KEY} differs from the plan's now); read the "
                         f"manifest again")
    check_compatible(manifest)
    ent = _epoch_entry(manifest, epoch)
    arrays, fds, files = open_epoch_arrays(snap, ent, epoch, ARRAYS)
    out = arrays, manifest, ent
    # the stamp names the files this snapshot opened (their descriptors), so a stamp of
    # another generation of the plan never matches them
    d, seal = snap.path / ent["dir"], manifest[MANIFEST_DIGEST_KEY]
    if verify == "once" and check_plan:
        if not stamp_matches(d, fds, seal):
            with verify_lock(d):  # the first reader verifies, the others wait and read its stamp
                if not stamp_matches(d, fds, seal):
                    _verify(arrays, fds, files, manifest, ent, epoch, check_plan)
                    write_stamp(d, fds, seal)
                    return out
    elif verify:
        _verify(arrays, fds, files, manifest, ent, epoch, check_plan)
        if check_plan:
            write_stamp(d, fds, seal)
        return out
    _check_structure(arrays, manifest, epoch)
    _check_against_manifest(arrays, manifest, ent, epoch, full=False)
    return out


def _verify(arrays: dict, fds: dict, files: dict, manifest: dict, ent: dict, epoch: int,
            check_plan: bool) -> None:
    """Every array's SHA-256 against the manifest, then the structure and (``check_plan``) the
    O(entries) invariants."""
    verify_digests(arrays, fds, files, ent["arrays"])
    _check_structure(arrays, manifest, epoch)
    _check_against_manifest(arrays, manifest, ent, epoch, full=check_plan)


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


def load_plan(path, epoch: int = 0, *, verify: VerifyMode = True,
              check_plan: bool = True) -> tuple[Plan, dict]:
    """The stored plan of ``epoch`` (arrays memory-mapped) and the manifest. Raises ValueError
    on a missing manifest or array, a wrong format version, an edited manifest, a path outside
    the plan directory, a size/header/hash mismatch, or arrays that break the manifest's
    invariants (see :func:`load_arrays`; ``verify="once"``: verified by the first process to
    open the epoch, see :mod:`balancer.store.verified`)."""
    verify = verify_mode(verify)
    a, manifest, ent = read_whole(
        path, lambda snap: _arrays_of(snap, epoch, verify, check_plan), resolve_plan_dir)
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
                n_samples: Optional[int] = None,
                verify: VerifyMode = "once") -> Callable[[int], Plan]:
    """``epoch -> Plan`` for ``PackedBatchSampler(plan=...)``: checks the manifest against the
    running job, then loads each epoch's plan on demand and checks the manifest it was read
    with again (an overwrite may have put another job's plan there meanwhile).
    ``verify="once"``: the first process to open an epoch hashes it, every other rank trusts
    its stamp; ``True``: every process hashes every array."""
    verify_mode(verify)
    job = dict(layout=layout, dataset_fingerprint=dataset_fingerprint, n_samples=n_samples)
    check_compatible(load_manifest(path), **job)

    def load(epoch: int) -> Plan:
        plan, manifest = load_plan(path, epoch, verify=verify)
        check_compatible(manifest, **job)
        return plan
    return load
