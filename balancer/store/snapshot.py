"""One generation of a plan directory, read whole.

``precompute --overwrite`` replaces a plan by exchanging directories, then deletes the old one.
A reader that opened the manifest by path and the arrays by path later could read the manifest
of one plan and the arrays of the other. A :class:`PlanSnapshot` opens the plan directory once
and every file relative to that descriptor (``openat``), so all it reads is of the one directory
it opened; a committed plan directory is never written in place, only renamed and deleted. A
file that disappears because the directory was replaced and deleted meanwhile raises
:class:`Replaced`, and :func:`read_whole` reads the new plan from the start."""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Callable, Optional, TypeVar

import numpy as np

from .files import HEADER_BYTES, MANIFEST, npy_header, read_manifest_bytes

T = TypeVar("T")
#: reads of a plan that an overwrite replaced mid-read before the reader gives up
READ_TRIES = 4
_REFUSED = "refused (the plan store reads only regular files inside its directory)"


class Replaced(Exception):
    """The directory a snapshot reads was replaced (and its files deleted) while reading."""


class PlanSnapshot:
    """The plan directory ``path`` held open by a descriptor; files opened relative to it.
    Use as a context manager (closes every descriptor it opened)."""

    def __init__(self, path, asked=None):
        self.path = Path(path)
        #: the path the reader asked for; ``path`` differs from it when that was missing and
        #: the old plan an overwrite moved aside is read instead (the two-rename fallback)
        self.asked = self.path if asked is None else Path(asked)
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            if self.asked != self.path:   # the moved-aside old plan, deleted since: read anew
                raise Replaced(str(self.path)) from None
            raise ValueError(f"{self.path}: no plan directory there") from None
        self._fds: list[int] = []

    def __enter__(self) -> "PlanSnapshot":
        return self

    def __exit__(self, *exc) -> None:
        for fd in self._fds + [self.fd]:
            os.close(fd)
        self._fds = []

    def replaced(self) -> bool:
        """Whether ``path`` now names another directory than the one this snapshot reads, or
        it reads a moved-aside old plan and the new one is in place (the old one is being
        deleted: read the new one)."""
        if self.asked != self.path and os.path.lexists(self.asked):
            return True
        try:
            st = os.stat(self.path)
        except OSError:
            return True
        me = os.fstat(self.fd)
        return (st.st_dev, st.st_ino) != (me.st_dev, me.st_ino)

    def _missing(self, msg: str):
        if self.replaced():
            raise Replaced(msg)
        raise ValueError(msg)

    def manifest_bytes(self) -> Optional[bytes]:
        """The manifest's bytes (:func:`read_manifest_bytes`); None when there is none."""
        try:
            return read_manifest_bytes(self.path, dir_fd=self.fd)
        except FileNotFoundError:
            if self.replaced():
                raise Replaced(str(self.path / MANIFEST)) from None
            return None

    def _open(self, dir_fd: int, name: str, shown: Path, what: str, flags: int) -> int:
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW, dir_fd=dir_fd)
        except OSError as e:
            if e.errno == errno.ELOOP or (e.errno == errno.ENOTDIR and stat.S_ISLNK(
                    os.lstat(name, dir_fd=dir_fd).st_mode)):
                raise ValueError(f"{shown}: the plan's {what} is a symbolic link; "
                                 f"{_REFUSED}") from None
            if e.errno in (errno.ENOENT, errno.ENOTDIR):
                self._missing(f"{shown}: {what} is missing")
            raise
        self._fds.append(fd)
        return fd

    def open_dir(self, name: str, what: str) -> int:
        """A descriptor of sub-directory ``name`` (a link is refused, not followed)."""
        return self._open(self.fd, name, self.path / name, what, os.O_RDONLY | os.O_DIRECTORY)

    def open_file(self, dir_fd: int, name: str, shown: Path, what: str) -> int:
        """A descriptor of regular file ``name`` under ``dir_fd`` (links, FIFOs, devices
        refused unread)."""
        fd = self._open(dir_fd, name, shown, what, os.O_RDONLY | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{shown}: the plan's {what} is not a regular file; {_REFUSED}")
        return fd


def open_array(fd: int, f: Path, name: str, info: dict, dtypes: dict) -> np.ndarray:
    """The array ``name`` of open file ``fd`` (shown as ``f``), memory-mapped read-only, after
    checking its dtype, size and header against the manifest's ``info``."""
    n = int(info["shape"][0])
    try:
        dt = np.dtype(info["dtype"])
    except TypeError:
        raise ValueError(f"{f}: manifest dtype {_short(info['dtype'])} of {name!r} is not a "
                         f"dtype, expected {dtypes[name]}") from None
    if dt != np.dtype(dtypes[name]):
        raise ValueError(f"{f}: manifest dtype {dt.str} of {name!r}, expected {dtypes[name]}")
    size, want = os.fstat(fd).st_size, HEADER_BYTES + n * dt.itemsize
    if size != want:
        raise ValueError(f"{f}: {size} bytes, expected {want} for {n} x {dt.str} (truncated or "
                         f"edited)")
    if os.pread(fd, HEADER_BYTES, 0) != npy_header(dt.str, n):
        raise ValueError(f"{f}: header does not describe {n} x {dt.str} as the manifest says")
    if n == 0:
        return np.zeros(0, dt)
    with os.fdopen(os.dup(fd), "rb") as fh:   # the map keeps its own reference to the file
        return np.memmap(fh, dtype=dt, mode="r", offset=HEADER_BYTES, shape=(n,))


def read_whole(path, fn: Callable[[PlanSnapshot], T], resolve: Callable = Path) -> T:
    """``fn(snapshot)`` of one generation of the plan at ``path`` (``resolve(path)``, read
    anew on each try): when an overwrite replaced the plan mid-read, read the new one from the
    start; after :data:`READ_TRIES` replacements in a row a ValueError says so."""
    for _ in range(READ_TRIES):
        try:
            snap = PlanSnapshot(resolve(path), asked=path)
        except Replaced:
            continue
        except ValueError:
            # gone when opened: an overwrite between its two renames. Read again when the old
            # plan is moved aside now, or the name is a directory again (the new plan landed
            # between the open and this look)
            if resolve(path) != Path(path) or os.path.isdir(path):
                continue
            raise
        with snap:
            try:
                return fn(snap)
            except Replaced:
                continue
    raise ValueError(f"{path}: the plan was replaced while reading it ({READ_TRIES} times in a "
                     f"row: a precompute --overwrite is writing it); read it again once that "
                     f"write is done")


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."
