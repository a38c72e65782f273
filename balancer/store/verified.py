"""Verify a stored epoch once, not in every process that opens it (``verify="once"``).

Hashing every array and checking the O(entries) invariants costs a full read of the epoch
(11 s and 4.6 GiB at 50M samples; ~11 min and ~97 GB of reads at 3B) and used to happen in
every rank before the first batch. With ``verify="once"`` the first reader of an epoch verifies
it exactly as ``verify=True`` does and then records a stamp, ``epoch-NNNN/verified.json``:
the sealed manifest's digest and, for every array file, its inode, size, mtime and ctime.
Later readers (the other ranks, restarts, other machines on a shared file system) that find a
stamp matching the files they opened skip the hashes and the O(entries) checks; the cheap
O(steps + microbatches) checks still run. Readers that arrive while the first one verifies
wait for it on ``epoch-NNNN/verified.lock`` (a POSIX lock, which NFS supports) instead of
verifying side by side.

The guarantee is kept: any write to an array changes its mtime and ctime (ctime cannot be set
back by a user), a copy or a rewrite gets new inodes, and a rewritten manifest another seal,
so a changed plan never matches its old stamp and is verified (and refused if bad) again.
Where the plan directory is not writable, or the lock cannot be taken, every reader verifies,
as with ``verify=True``. A stamp is written only after a full verification passed
(``check_plan=False`` writes none).
"""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator, Union

STAMP = "verified.json"
LOCK = "verified.lock"
_KIND = "balancer-plan-verified"
VerifyMode = Union[bool, str]


def verify_mode(verify) -> VerifyMode:
    """``True`` (hash in this process), ``False`` (no hashes) or ``"once"``."""
    if verify is True or verify is False or verify == "once":
        return verify
    raise ValueError(f"verify={verify!r}: expected True, False or 'once'")


def _identity(f) -> dict:
    st = os.stat(f)   # a path, or the descriptor a reader opened the array with
    return {"ino": st.st_ino, "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns}


def _expected(files: dict, seal: str) -> dict:
    return {"kind": _KIND, "manifest_sha256": seal,
            "arrays": {name: _identity(f) for name, f in sorted(files.items())}}


def stamp_matches(epoch_dir: Path, files: dict, seal: str) -> bool:
    """Whether ``epoch_dir`` holds a stamp for exactly these files (name -> path or open
    descriptor) under this manifest."""
    try:
        with open(epoch_dir / STAMP) as fh:
            doc = json.load(fh)
        return doc == _expected(files, seal)
    except (OSError, ValueError):
        return False


def stamp_extra(epoch_dir: Path, files: dict, seal: str):
    """The ``extra`` record (a dict, ``{}`` when none) of a stamp for exactly these files
    under this manifest, or None where there is no such stamp. ``extra`` says what else the
    verification that wrote it checked (a hybrid plan: the job's lengths, by fingerprint)."""
    try:
        with open(epoch_dir / STAMP) as fh:
            doc = json.load(fh)
        extra = doc.pop("extra", {}) if isinstance(doc, dict) else None
        return extra if doc == _expected(files, seal) and isinstance(extra, dict) else None
    except (OSError, ValueError):
        return None


def write_stamp(epoch_dir: Path, files: dict, seal: str, extra: dict | None = None) -> None:
    """Record that these files passed a full verification (atomically; a plan directory that
    cannot be written keeps no stamp, and its readers verify every time); ``extra``: what else
    that verification checked (read back by :func:`stamp_extra`)."""
    tmp = epoch_dir / f"{STAMP}.tmp-{os.getpid()}"
    doc = _expected(files, seal)
    if extra is not None:
        doc["extra"] = extra
    try:
        with open(tmp, "w") as fh:
            json.dump(doc, fh)
        os.replace(tmp, epoch_dir / STAMP)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


@contextlib.contextmanager
def verify_lock(epoch_dir: Path) -> Iterator[None]:
    """Hold ``epoch_dir/verified.lock`` while verifying (best effort: no lock where the
    directory is read-only or the file system has no locks)."""
    import fcntl
    try:
        fd = os.open(epoch_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # closing releases the lock


def is_stamp_file(name: str) -> bool:
    """Files ``verified.*`` that readers leave in an epoch directory (part of a plan store)."""
    return name == STAMP or name == LOCK or name.startswith(f"{STAMP}.tmp-")
