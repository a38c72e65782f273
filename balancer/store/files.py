"""The plan store's files: format constants and ``.npy`` arrays with a fixed 128-byte
header (appended, preallocated and written in slices by several ranks, hashed in blocks)."""
from __future__ import annotations

import errno
import hashlib
import os
import stat
import struct
from pathlib import Path
from typing import Optional

import numpy as np


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
#: hybrid DP x CP plans: their own format name, every array of an epoch and its dtype
HYBRID_FORMAT_NAME = "balancer-hybrid-plan"
HYBRID_FORMAT_VERSION = 1
HYBRID_ARRAYS = {
    "step_rounds": "<i8", "round_groups": "<i8", "group_offset": "<i8", "group_size": "<i8",
    "group_entries": "<i8", "entry_item": "<i8", "entry_owner": "<i8", "item_doc": "<i8",
    "item_start": "<i8", "item_length": "<i8",
}
_HASH_BLOCK = 1 << 24
#: a plan manifest lists ~15 arrays per epoch in a few KiB: anything larger is not one
MAX_MANIFEST_BYTES = 64 << 20
_REFUSED = "refused (the plan store reads only regular files inside its directory)"


def read_manifest_bytes(plan_dir, *, dir_fd: Optional[int] = None) -> bytes:
    """The bytes of ``plan_dir/manifest.json``, read by the one path every entry point uses
    (load, inspect, overwrite): opened with O_NOFOLLOW | O_NONBLOCK and checked with fstat
    before a byte is read, so a symbolic link (to /dev/zero, a FIFO, anywhere), a FIFO or a
    device is refused unread instead of blocking or filling memory, and so is a file larger
    than :data:`MAX_MANIFEST_BYTES`. FileNotFoundError when there is none; ValueError naming
    the file otherwise. With ``dir_fd`` (the plan directory held open) it is opened relative
    to that descriptor, ``plan_dir`` only names it in messages."""
    m = Path(plan_dir) / MANIFEST
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(m if dir_fd is None else MANIFEST, flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno != errno.ENOENT and _is_link(m, dir_fd)):
            raise ValueError(f"{m}: is a symbolic link; {_REFUSED}") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a directory" if \
                stat.S_ISDIR(st.st_mode) else "a device or socket"
            raise ValueError(f"{m}: is not a regular file ({kind}); {_REFUSED}")
        if st.st_size > MAX_MANIFEST_BYTES:
            raise ValueError(f"{m}: {st.st_size} bytes, more than the {MAX_MANIFEST_BYTES} a "
                             f"plan manifest can hold; refused unread")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:   # grew while being read
            raise ValueError(f"{m}: more than the {MAX_MANIFEST_BYTES} bytes a plan manifest "
                             f"can hold; refused")
        return data
    finally:
        os.close(fd)


def _is_link(m: Path, dir_fd: Optional[int]) -> bool:
    try:
        st = os.lstat(m if dir_fd is None else m.name, dir_fd=dir_fd)
    except OSError:
        return False
    return stat.S_ISLNK(st.st_mode)


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


def fd_digest(fd: int) -> str:
    """:func:`file_digest` of an open file (read with pread: the descriptor's offset is kept)."""
    h, off = hashlib.sha256(), HEADER_BYTES
    while True:
        b = os.pread(fd, _HASH_BLOCK, off)
        if not b:
            break
        h.update(b)
        off += len(b)
    return h.hexdigest()


def epoch_dirname(epoch: int) -> str:
    return f"epoch-{int(epoch):04d}"
