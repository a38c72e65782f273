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
