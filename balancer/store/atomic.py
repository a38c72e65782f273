"""Atomic plan directories: a plan is written into a hidden sibling and exchanged with the
target in one rename (a recoverable two-rename fallback where the kernel has no exchange), stale
hidden directories of dead writers cleaned, foreign directories never replaced."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import sys
import uuid
import warnings
from pathlib import Path
from typing import Optional

from .files import (ARRAYS, FORMAT_NAME, HYBRID_ARRAYS, HYBRID_FORMAT_NAME, KILL_ENV, MANIFEST,
                    MANIFEST_DIGEST_KEY, NO_EXCHANGE_ENV,
                    epoch_dirname, fsync_dir, read_manifest_bytes)
from .verified import is_stamp_file


# ---- atomic plan directories --------------------------------------------------------------
_EPOCH_RE = re.compile(r"epoch-\d{4,}")
#: the planned windows a rank of a distributed precompute keeps until every rank's sizes are
#: known (:func:`balancer.store.precompute._precompute_distributed`): ``<window>.npz`` files
_SPILL_RE = re.compile(r"\.spill-epoch\d+-rank\d+")
_SPILL_FILE_RE = re.compile(r"\d+\.npz")
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
    None when it holds only ``manifest.json`` and ``epoch-NNNN/<array>.npy`` regular files
    (and the ``epoch-NNNN/verified.*`` stamps that readers leave, the ``.spill-epochE-rankR/
    <window>.npz`` files of a killed distributed precompute)."""
    path = Path(path)
    for p in sorted(path.iterdir()):
        mode = _lstat_mode(p)
        if mode is None or (p.name == MANIFEST and stat.S_ISREG(mode)):
            continue
        allowed = _spill_file if _SPILL_RE.fullmatch(p.name) else \
            _plan_file if _EPOCH_RE.fullmatch(p.name) else None
        if allowed is None or not stat.S_ISDIR(mode):
            return p.name
        for q in sorted(p.iterdir()):
            mode = _lstat_mode(q)
            if mode is not None and not (allowed(q.name) and stat.S_ISREG(mode)):
                return f"{p.name}/{q.name}"
    return None


def _plan_file(name: str) -> bool:
    """A file an ``epoch-NNNN`` directory holds: an array, or a reader's verification stamp
    (:mod:`balancer.store.verified`)."""
    q = Path(name)
    return (q.suffix == ".npy" and (q.stem in ARRAYS or q.stem in HYBRID_ARRAYS)) or \
        is_stamp_file(name)


def _spill_file(name: str) -> bool:
    """A planned window a killed distributed precompute left in its spill directory."""
    return _SPILL_FILE_RE.fullmatch(name) is not None


def _lstat_mode(p: Path) -> Optional[int]:
    """``st_mode`` of ``p`` (not following a link), or None when it has gone since it was
    listed: a reader renames its ``verified.json.tmp-PID`` stamp into place at any time, and
    what is no longer there is not in the way of an overwrite."""
    try:
        return os.lstat(p).st_mode
    except FileNotFoundError:
        return None


def _has_plan_manifest(path: Path, *, strict: bool = False) -> bool:
    """Whether ``path`` holds a plan manifest (read by :func:`read_manifest_bytes`); with
    ``strict``, a manifest that is a link, a FIFO or too large raises its ValueError."""
    try:
        m = json.loads(read_manifest_bytes(path))
    except ValueError as e:
        if strict and not isinstance(e, json.JSONDecodeError) and \
                not isinstance(e, UnicodeDecodeError):
            raise
        return False
    except OSError:
        return False
    return isinstance(m, dict) and m.get("format") in (FORMAT_NAME, HYBRID_FORMAT_NAME)


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
    try:
        is_plan = _has_plan_manifest(path, strict=True)
    except ValueError as e:
        raise ValueError(f"{e}; {how}; refusing to replace {path}") from None
    if not is_plan:
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
    return max(olds, key=lambda h: _mtime_ns(h["path"])) if olds else None


def _mtime_ns(p: Path) -> int:
    """``p``'s modification time, -1 when a writer has deleted it since it was listed."""
    try:
        return p.stat().st_mtime_ns
    except FileNotFoundError:
        return -1


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


def _remove_old(old: Path, tries: int = 5) -> None:
    """Delete the replaced plan ``old``. A reader still verifying it may add its stamp or lock
    file while the tree is removed (the last rmdir then fails on a non-empty directory), so
    try again a few times rather than leave a hidden ``.NAME.old-*`` behind on every race."""
    for _ in range(tries):
        shutil.rmtree(old, ignore_errors=True)
        if not os.path.lexists(old):
            return


def _make_parent(given, parent: Path) -> None:
    """Create the folder a plan directory goes in, or a ValueError naming the plan directory
    as given and why (a file on the way, a file system that refuses)."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        p = parent
        while not p.exists() and p != p.parent:
            p = p.parent
        raise ValueError(f"{given}: {p} is not a directory, so the plan directory cannot go "
                         f"there") from None
    except OSError as e:
        raise ValueError(f"{given}: cannot make the folder {parent} ({e.strerror})") from None


class PlanDirWriter:
    """A plan directory under construction: a hidden sibling ``.NAME.partial-HOST-PID-RAND``
    that :meth:`commit` fsyncs and renames to ``path`` (or exchanges with the plan there).

    Constructing one first cleans up what killed writers of ``path`` left (see
    :func:`cleanup_stale`; what it cannot remove is in ``stale`` and warned about) and refuses
    an existing ``path`` unless ``overwrite`` and it is a plan store (:func:`check_replaceable`).
    With ``tmp`` (the ranks of a distributed writer) it only adopts that directory."""

    def __init__(self, path, *, overwrite: bool = False, tmp: Optional[Path] = None):
        # "." or "run/..": the directory by its name (its hidden siblings go next to it, not
        # inside it); absolute without resolving links, so a link is still refused as a link
        self.path = Path(os.path.abspath(path))
        self.overwrite = overwrite
        self.stale: list[str] = []
        if tmp is None:
            _make_parent(path, self.path.parent)
            self.stale = cleanup_stale(self.path)
            for line in self.stale:
                warnings.warn(line, stacklevel=2)
            self._check_target()
            tmp = self.path.parent / f".{self.path.name}.partial-{_tag()}"
            try:
                tmp.mkdir()
            except OSError as e:
                raise ValueError(f"{path}: cannot write the plan directory in "
                                 f"{self.path.parent} ({e.strerror})") from None
        self.tmp = Path(tmp)

    def _empty_dir(self) -> bool:
        """``path`` is a directory (not a link) holding nothing: a new plan directory."""
        return self.path.is_dir() and not self.path.is_symlink() and \
            not any(self.path.iterdir())

    def _check_target(self) -> bool:
        """True when ``path`` holds something to replace (refused unless allowed); an empty
        directory holds nothing (``--out .`` in an empty directory is a new plan)."""
        if not (self.path.exists() or self.path.is_symlink()) or self._empty_dir():
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
        if not self._check_target():
            if self._empty_dir():  # filled in place: it stays the same directory
                self._fill_in_place()
            else:  # nothing there
                os.rename(self.tmp, self.path)
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
        _remove_old(old)
        return self.path

    def _fill_in_place(self) -> None:
        """Move the plan into the empty directory ``path`` entry by entry, the manifest last
        (a reader sees no plan until it appears, then the whole plan), so that the directory
        keeps its identity: a shell's working directory (``--out .``), a mount point, its owner
        and mode (renaming over it would leave ``.`` a deleted directory)."""
        for p in sorted(self.tmp.iterdir(), key=lambda p: p.name == MANIFEST):
            os.rename(p, self.path / p.name)
        fsync_dir(self.path)
        self.tmp.rmdir()

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
