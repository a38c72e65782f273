"""Workloads by name: the real length distributions shipped with the package and seeded
synthetic ones, so benchmarks, the demo and the tests run from a clone or a wheel with no
folder outside it.

Real workloads (int32 token lengths per document, in published order) live in
``balancer/data/workloads/<name>_lengths.npz`` (``lengths`` array): ``wikipedia`` (1M Wikipedia
articles, FlexSP), ``wlbllm`` (99,519 samples of a 128K pre-training mix shaped after WLB-LLM),
``prolong`` (77,932 samples of a long-context mix). ``$BALANCER_WORKLOADS`` may name a folder of
extra ``<name>_lengths.npy`` files, which take precedence.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .resources import packaged

#: environment variable naming a folder of extra ``<name>_lengths.npy`` files (looked up first)
WORKLOADS_ENV = "BALANCER_WORKLOADS"


def _dirs() -> list[Path]:
    env = os.environ.get(WORKLOADS_ENV)
    out = [Path(env)] if env else []
    return out + [packaged("workloads")]


def _real_files() -> dict[str, Path]:
    """name -> file, the first folder in lookup order winning."""
    found: dict[str, Path] = {}
    for d in _dirs():
        if not d.is_dir():
            continue
        for pat in ("*_lengths.npy", "*_lengths.npz"):
            for f in sorted(d.glob(pat)):
                found.setdefault(f.name[: -len("_lengths.npy")], f)
    return found


def synthetic(name: str, n: int = 200_000, seed: int = 0) -> np.ndarray:
    """Seeded synthetic length distributions (int64).

    * ``bimodal-sft``: 99.89% lognormal (median ~700) and 0.11% long (median ~35K, 8K-128K),
      the Llama-3 SFT shape cited by Skrull;
    * ``lognormal-4k``: lognormal, median 4K, clipped to 1..256K;
    * ``uniform-32k``: uniform 1..32K;
    * ``pareto``: heavy tail, 64 * (1 + Pareto(1.1)), clipped to 512K.
    """
    rng = np.random.default_rng(seed)
    if name == "bimodal-sft":
        long = rng.random(n) < 0.0011
        short = rng.lognormal(np.log(700), 0.9, n)
        lng = np.clip(rng.lognormal(np.log(35_000), 0.6, n), 8192, 131072)
        out = np.where(long, lng, short)
    elif name == "lognormal-4k":
        out = np.clip(rng.lognormal(np.log(4096), 1.0, n), 1, 262144)
    elif name == "uniform-32k":
        out = rng.integers(1, 32769, n)
    elif name == "pareto":
        out = np.clip(64 * (1 + rng.pareto(1.1, n)), 1, 524288)
    else:
        raise ValueError(f"unknown synthetic workload {name!r}; known: {SYNTHETIC}")
    return np.maximum(np.asarray(out, dtype=np.int64), 1)


SYNTHETIC = ("bimodal-sft", "lognormal-4k", "uniform-32k", "pareto")
REAL = ("prolong", "wikipedia", "wlbllm")  # shipped in the package


def available() -> list[str]:
    return sorted(_real_files()) + list(SYNTHETIC)


def _read(f: Path) -> np.ndarray:
    if f.suffix == ".npz":
        with np.load(f, allow_pickle=False) as z:
            return z["lengths"].astype(np.int64)
    return np.load(f, allow_pickle=False).astype(np.int64)


def read_npy(path, mmap: bool = False) -> np.ndarray:
    """The array of a ``.npy`` file (``mmap``: memory-mapped read-only, not copied), or a
    ``ValueError`` naming the file and what is wrong (missing, not a file, not the .npy format
    or cut short, pickled objects): numpy's own errors (``EOFError``, a message about pickles
    for a text file) name neither."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{p}: no such file")
    if not p.is_file():
        raise ValueError(f"{p}: not a file")
    try:
        with open(p, "rb") as f:
            if f.read(6) != b"\x93NUMPY":
                raise ValueError(f"{p}: not a .npy file (no NumPy header; "
                                 f"{p.stat().st_size} bytes)")
            f.seek(0)
            _check_npy_size(p, f)
        return np.load(p, allow_pickle=False, mmap_mode="r" if mmap else None)
    except ValueError as e:
        if str(e).startswith(str(p)):
            raise
        if "allow_pickle" in str(e) or "pickled" in str(e):
            raise ValueError(f"{p}: holds Python objects (pickled); save the lengths as an "
                             f"integer array") from None
        raise ValueError(f"{p}: not a .npy file or cut short ({e})") from None
    except EOFError as e:
        raise ValueError(f"{p}: not a .npy file or cut short ({e})") from None


def _check_npy_size(p: Path, f) -> None:
    """Refuse a .npy whose header claims more data than the file holds, before numpy allocates
    what the header says (a header claiming 10**12 entries ended in a MemoryError)."""
    fmt = np.lib.format
    version = fmt.read_magic(f)
    read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
    shape, _, dtype = read(f)
    if dtype.hasobject:
        return   # np.load refuses pickles with its own message
    n = int(np.prod(shape, dtype=object))
    need, have = n * dtype.itemsize, p.stat().st_size - f.tell()
    if need > have:
        raise ValueError(f"{p}: not a .npy file or cut short (the header claims {n} entries of "
                         f"{dtype}, {need} bytes, but the file holds {have} bytes of data)")


def check_fits_memory(n: int, what: str) -> None:
    """Refuse ``n`` samples whose int64 lengths alone exceed this machine's memory, naming the
    size (instead of a MemoryError, or the OOM killer, later)."""
    need = int(n) * 8
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if need > mem:
        raise ValueError(f"{what} {n}: {need / 2 ** 30:.1f} GiB for the lengths alone, more than "
                         f"this machine's {mem / 2 ** 30:.1f} GiB of memory")


def load(name_or_path: str, n: int | None = None, seed: int = 0) -> np.ndarray:
    """Lengths of a workload (int64): a ``.npy`` path, a real workload name (``wikipedia``,
    ``wlbllm``, ``prolong``), or a synthetic name. ``n`` resamples (with replacement, seeded)
    or synthesises that many samples."""
    if n is not None:
        check_fits_memory(n, "--samples")
    p = Path(name_or_path)
    if p.suffix == ".npy":
        from packing.validate import as_sizes  # the one check of lengths (API and CLI alike)
        arr = as_sizes(read_npy(p), source=str(p))
    elif name_or_path in SYNTHETIC:
        return synthetic(name_or_path, n or 200_000, seed)
    else:
        f = _real_files().get(name_or_path)
        if f is None:
            raise ValueError(f"unknown workload {name_or_path!r}: not a .npy file and not one of "
                             f"{available()}")
        arr = _read(f)
    if n is not None and n != arr.shape[0]:
        arr = np.random.default_rng(seed).choice(arr, size=n, replace=True)
    return arr


__all__ = ["REAL", "SYNTHETIC", "available", "load", "read_npy", "synthetic"]
