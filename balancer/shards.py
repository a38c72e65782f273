"""Sample lengths from sharded files: a directory or glob of ``.npy`` files, or parquet files
with a length column, read in sorted path order into one int64 array (sample ``i`` of the corpus
is row ``i`` of the shards concatenated in that order).

A single int64 ``.npy`` is memory-mapped, not copied: the ranks of a machine share its pages
in the page cache. Shards are concatenated once into the one array the planner indexes
(8 bytes per sample); with ``cache=PATH.npy`` the concatenation is written there once (a
file every rank of a shared file system then maps) and reused while the shards are unchanged.
"""
from __future__ import annotations

import glob
import json
import os
from pathlib import Path
from typing import Optional

import numpy as np

from .workloads import read_npy

_SUFFIXES = (".npy", ".parquet")


def is_sharded(spec: str) -> bool:
    """Whether ``spec`` names several files: a directory, a glob pattern, a comma-separated
    list, or a parquet file (read through its length column)."""
    return ("," in spec or any(c in spec for c in "*?[") or spec.endswith(".parquet")
            or (Path(spec).is_dir() and not spec.endswith(".npy")))  # X.npy names one file


def shard_paths(spec: str) -> list[Path]:
    """The files ``spec`` names, sorted by path (a directory: its ``.npy`` / ``.parquet``
    files; a glob; a comma-separated list of files or globs). One kind only."""
    paths: list[Path] = []
    for part in [s for s in spec.split(",") if s]:
        p = Path(part)
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.suffix in _SUFFIXES and q.is_file())
            if not found:
                raise ValueError(f"{p}: a directory with no .npy or .parquet length shards")
        elif any(c in part for c in "*?["):
            found = sorted(Path(q) for q in glob.glob(part))
            if not found:
                raise ValueError(f"{part}: the pattern matches no file")
        else:
            if not p.is_file():
                raise ValueError(f"{p}: no such length shard")
            found = [p]
        paths += found
    kinds = {q.suffix for q in paths}
    if not paths or len(kinds) != 1 or not kinds <= set(_SUFFIXES):
        raise ValueError(f"--lengths {spec}: length shards must be all .npy or all .parquet "
                         f"files (got {sorted(kinds) or 'none'})")
    return paths


def _rows(p: Path, column: str) -> int:
    if p.suffix == ".npy":
        a = read_npy(p, mmap=True)
        if a.ndim != 1:
            raise ValueError(f"{p}: lengths must be a 1-D array, got shape {a.shape}")
        return int(a.shape[0])
    import pyarrow.parquet as pq
    meta = pq.ParquetFile(p)
    if column not in meta.schema_arrow.names:
        raise ValueError(f"{p}: no column {column!r} (columns: {meta.schema_arrow.names})")
    return int(meta.metadata.num_rows)


def _read_into(p: Path, column: str, out: np.ndarray) -> None:
    from packing.validate import as_sizes
    if p.suffix == ".npy":
        a = read_npy(p, mmap=True)
        step = 1 << 24  # bounded working set: one block of the shard at a time
        for lo in range(0, a.shape[0], step):
            out[lo:lo + step] = as_sizes(a[lo:lo + step], source=f"{p} (rows from {lo})")
        return
    import pyarrow.parquet as pq
    f, lo = pq.ParquetFile(p), 0
    for rg in range(f.num_row_groups):
        col = f.read_row_group(rg, columns=[column]).column(0)
        if col.null_count:
            i = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise ValueError(f"{p}: row {lo + i}: length is missing (null)")
        vals = np.concatenate([c.to_numpy(zero_copy_only=False) for c in col.chunks]) \
            if col.num_chunks else np.zeros(0, np.int64)
        out[lo:lo + vals.shape[0]] = as_sizes(vals, source=f"{p} (row group {rg})")
        lo += vals.shape[0]


def read_shards(spec: str, column: str = "length", cache: Optional[str] = None) -> np.ndarray:
    """Lengths (int64[n]) of every shard ``spec`` names, concatenated in sorted path order.
    A bad value is an error naming its file and row. ``cache``: a ``.npy`` path where the
    concatenation is kept (memory-mapped on reuse) while the shards' sizes and mtimes match."""
    paths = shard_paths(spec)
    stamp = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in paths]
    if cache:
        c, meta = Path(cache), Path(str(cache) + ".json")
        try:
            if json.loads(meta.read_text()) == {"column": column, "shards": stamp}:
                        return read_npy(c, mmap=True)
        except (OSError, ValueError):
            pass
    counts = [_rows(p, column) for p in paths]
    n = int(sum(counts))
    if cache:
        tmp = f"{c}.tmp-{os.getpid()}.npy"  # ranks writing it at once each write their own
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype="<i8",
                                        shape=(n,))
    else:
        out = np.empty(n, np.int64)
    lo = 0
    for p, k in zip(paths, counts):
        _read_into(p, column, out[lo:lo + k])
        lo += k
    if cache:
        out.flush()
        del out
        os.replace(tmp, c)
        meta.write_text(json.dumps({"column": column, "shards": stamp}))
        return read_npy(c, mmap=True)
    return out


class LengthFiles:
    """Lengths of one or more ``.npy`` files (concatenated in the given order) read on demand
    with ``pread``: nothing of the corpus is held or memory-mapped, so a process reading a
    window's lengths holds that window's only (a memory map would keep every page it touched
    mapped, counted in the process's RSS). Duck-types what precompute reads of a
    :class:`~balancer.samples.SampleTable` (``len``, ``lengths``, ``total_tokens``,
    ``fingerprint()``, the same values) and what the planner's stream reads of lengths
    (``shape``, ``take(idx)``).

    Opening reads every file once, in blocks: each value is checked as ``SampleTable`` checks
    it (an error names the file and row), the total and the fingerprint are computed then.
    The files must not change afterwards."""

    _CHUNK = 1 << 12  # values read together by take(): a block of the 'blocks' order
    _BATCH = 1 << 10  # blocks read per batch of take() (32 MiB)

    def __init__(self, paths, block: int = 1 << 22):
        import hashlib
        from packing.validate import MAX_TOTAL, as_sizes
        self.paths = [Path(p) for p in paths]
        if not self.paths:
            raise ValueError("no length files")
        self._meta = []  # (dtype, data offset, rows) per file
        for p in self.paths:
            a = read_npy(p, mmap=True)  # the header only: no data page is read here
            if a.ndim != 1:
                raise ValueError(f"{p}: lengths must be a 1-D array, got shape {a.shape}")
            if a.dtype.hasobject or a.dtype.kind not in "iuf":
                raise ValueError(f"{p}: lengths must be integers, got dtype {a.dtype}")
            off = getattr(a, "offset", None)
            if not isinstance(a, np.memmap) or off is None:
                raise ValueError(f"{p}: cannot be read in place (not a plain .npy array)")
            self._meta.append((a.dtype, int(off), int(a.shape[0])))
            del a
        rows = [m[2] for m in self._meta]
        self.starts = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
        self.n = int(self.starts[-1])
        if self.n == 0:
            raise ValueError("the dataset is empty: no samples to plan")
        self.shape = (self.n,)
        self._fds: dict = {}
        h, total = hashlib.sha256(), 0
        for i, p in enumerate(self.paths):
            lo0 = int(self.starts[i])
            for lo in range(lo0, int(self.starts[i + 1]), block):
                hi = min(lo + block, int(self.starts[i + 1]))
                a = as_sizes(self._raw(i, lo - lo0, hi - lo0), source=f"{p} (rows from "
                                                                         f"{lo - lo0})")
                total += int(a.sum())
                h.update(a.astype("<i8", copy=False).data)
        if total > MAX_TOTAL:
            raise ValueError(f"the total of the lengths ({total:.4g} over {self.n} samples) "
                             f"exceeds {MAX_TOTAL}: split the dataset")
        self.total_tokens = total
        self._fingerprint = h.hexdigest()[:16]

    # ---- what precompute reads of a SampleTable --------------------------------------------
    def __len__(self) -> int:
        return self.n

    @property
    def lengths(self) -> "LengthFiles":
        return self

    def fingerprint(self) -> str:
        """SampleTable.fingerprint() of the same lengths."""
        return self._fingerprint

    def __getstate__(self):  # file descriptors stay in their process
        return {k: v for k, v in self.__dict__.items() if k != "_fds"} | {"_fds": {}}

    def __del__(self):
        for fd in getattr(self, "_fds", {}).values():
            try:
                os.close(fd)
            except OSError:
                pass

    # ---- reads ------------------------------------------------------------------------------
    def _raw(self, i: int, lo: int, hi: int) -> np.ndarray:
        """Rows ``[lo, hi)`` of file ``i``, in its dtype."""
        dtype, off, _ = self._meta[i]
        fd = self._fds.get(i)
        if fd is None:
            fd = self._fds[i] = os.open(self.paths[i], os.O_RDONLY)
        want = (hi - lo) * dtype.itemsize
        buf = bytearray(want)
        view, got = memoryview(buf), 0
        while got < want:
            k = os.preadv(fd, [view[got:]], off + lo * dtype.itemsize + got)
            if k <= 0:
                raise ValueError(f"{self.paths[i]}: shorter than its header says "
                                 f"(changed while planning?)")
            got += k
        return np.frombuffer(buf, dtype=dtype)

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Lengths of samples ``[lo, hi)`` (int64[hi - lo], a fresh array)."""
        out = np.empty(max(0, hi - lo), np.int64)
        i = int(np.searchsorted(self.starts, lo, side="right")) - 1
        at = lo
        while at < hi:
            s, e = int(self.starts[i]), int(self.starts[i + 1])
            b = min(hi, e)
            if b > at:
                out[at - lo:b - lo] = self._raw(i, at - s, b - s)
            at, i = b, i + 1
        return out

    def take(self, idx: np.ndarray) -> np.ndarray:
        """``lengths[idx]`` (int64[k]): the blocks of CHUNK values that hold ``idx`` are read,
        runs of adjacent blocks in one read, at most BATCH blocks at a time (scattered indices
        must not read the whole corpus into one buffer)."""
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size == 0:
            return np.zeros(0, np.int64)
        if int(idx.min()) < 0 or int(idx.max()) >= self.n:
            raise IndexError(f"sample index out of range [0, {self.n})")
        c = self._CHUNK
        chunk = idx // c
        u = np.unique(chunk)
        out = np.empty(idx.shape[0], np.int64)
        by_chunk = np.argsort(chunk, kind="stable")
        sorted_chunk = chunk[by_chunk]
        for a in range(0, u.shape[0], self._BATCH):
            us = u[a:a + self._BATCH]
            buf = np.empty(us.shape[0] * c, np.int64)
            cuts = np.flatnonzero(np.diff(us) != 1) + 1
            for x, y in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [us.shape[0]]])):
                lo, hi = int(us[x]) * c, min(int(us[y - 1] + 1) * c, self.n)
                buf[x * c:x * c + hi - lo] = self.read(lo, hi)
            i0 = np.searchsorted(sorted_chunk, us[0], side="left")
            i1 = np.searchsorted(sorted_chunk, us[-1], side="right")
            sel = by_chunk[i0:i1]
            out[sel] = buf[np.searchsorted(us, chunk[sel]) * c + idx[sel] % c]
        return out


def open_lengths(spec: str, column: str = "length", cache: Optional[str] = None):
    """Lengths read on demand (:class:`LengthFiles`) for ``spec``: one ``.npy`` file, ``.npy``
    shards, or parquet shards through ``cache`` (written once by :func:`read_shards`). None
    where that is impossible (parquet without a cache): the caller reads them whole."""
    if not is_sharded(spec):
        return LengthFiles([spec])
    paths = shard_paths(spec)
    if paths[0].suffix == ".npy":
        return LengthFiles(paths)
    if cache:
        read_shards(spec, column, cache=cache)  # writes or validates the cache
        return LengthFiles([cache])
    return None
