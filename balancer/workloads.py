"""Workloads by name: the real length distributions in ``shared/workloads`` and seeded synthetic
ones, so benchmarks and the demo run on a fresh machine with no arguments."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def shared_dir() -> Path | None:
    """``$BALANCER_WORKLOADS`` or the ``shared/workloads`` folder beside the repository."""
    env = os.environ.get("BALANCER_WORKLOADS")
    cands = [Path(env)] if env else []
    root = Path(__file__).resolve().parent.parent
    cands += [root.parent / "shared" / "workloads", root / "shared" / "workloads"]
    for c in cands:
        if c.is_dir():
            return c
    return None


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


def available() -> list[str]:
    d = shared_dir()
    real = sorted(p.name[: -len("_lengths.npy")] for p in d.glob("*_lengths.npy")) if d else []
    return real + list(SYNTHETIC)


def load(name_or_path: str, n: int | None = None, seed: int = 0) -> np.ndarray:
    """Lengths of a workload: a ``.npy`` path, a shared workload name (``wikipedia``,
    ``wlbllm``, ``prolong``), or a synthetic name. ``n`` resamples (with replacement, seeded)
    or synthesises that many samples."""
    p = Path(name_or_path)
    if p.suffix == ".npy" and p.is_file():
        arr = np.load(p, allow_pickle=False).astype(np.int64)
    elif name_or_path in SYNTHETIC:
        return synthetic(name_or_path, n or 200_000, seed)
    else:
        d = shared_dir()
        f = d / f"{name_or_path}_lengths.npy" if d else None
        if f is None or not f.is_file():
            raise ValueError(f"unknown workload {name_or_path!r}: not a .npy file and not one of "
                             f"{available()}")
        arr = np.load(f, allow_pickle=False).astype(np.int64)
    if n is not None and n != arr.shape[0]:
        arr = np.random.default_rng(seed).choice(arr, size=n, replace=True)
    return arr
