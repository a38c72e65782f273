"""Precompute plans into a plan store, in parallel: the epoch's stream is cut into the planner's
independent windows (``PlannerConfig.window_samples``), windows are planned by a pool of worker
processes on one machine, or by the ranks of a ``torchrun`` / ``torch.distributed`` job, and the
result is bit-identical to a single-process :func:`balancer.plan_epoch` / ``plan_epochs`` with
the same config (the window boundaries, not the number of workers, define the plan).

Memory stays small: the items of a window are made on demand from the epoch order (only the
permutation, 8 bytes per sample, is held for the whole epoch) and every planned window is
appended to the store's files as soon as it arrives, so the plan itself is never in memory.
Under torch.distributed every rank plans a contiguous block of windows, keeps each planned window
on disk (in the plan's temporary directory) until every rank's sizes are known, then writes its
slices straight into the store's preallocated files (a file system all ranks see); rank 0
allocates the files and writes the manifest after every rank has written and hashed its share.
Under ``order='blocks'`` not even the order is held (:mod:`balancer.planning.order`), and
lengths read on demand (:class:`balancer.shards.LengthFiles`) keep a process's memory bounded
by the window.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from . import plan_store as store
from ..config import Layout, PlannerConfig, check_fixed_mode
from ..cost.model import CostModel
from ..cost.blocks import microbatch_costs
from ..planning.plan import Items, microbatch_step_rank
from ..planning.planner import plan_window
from ..planning.stream import EpochWindows  # noqa: F401 (precompute.EpochWindows: the old home)
from ..samples import SampleTable
from ..world import World


@dataclass
class PlanPart:
    """One planned window: entries (E_w), entries per microbatch (M_w), microbatches per rank per
    step (S_w), leftover items (L_w); ``counts`` are its partial sums for the summary."""

    entry_sample: np.ndarray
    entry_start: np.ndarray
    entry_length: np.ndarray
    entry_delay: np.ndarray
    mb_sizes: np.ndarray
    step_mbs: np.ndarray
    leftover: Items
    max_delay_bound: int  # config.max_delay, to count entries that waited longer

    @property
    def counts(self) -> dict:
        d = self.entry_delay
        return {"entries": int(self.entry_sample.shape[0]), "mbs": int(self.mb_sizes.shape[0]),
                "steps": int(self.step_mbs.shape[0]), "leftover": len(self.leftover),
                "tokens": int(self.entry_length.sum()),
                "max_delay": int(d.max()) if d.size else 0, "delayed": int((d > 0).sum()),
                "over_bound": int((d > self.max_delay_bound).sum())}


def plan_part(ew: EpochWindows, cost: CostModel, i: int) -> PlanPart:
    """Plan window ``i`` of the epoch exactly as ``plan_epoch`` does (same sizes, costs, budget
    and ``plan_window`` call). Microbatch costs are left for :func:`part_slices`, which knows
    where the window's entries sit in the epoch."""
    layout, config = ew.layout, ew.config
    lo, hi = ew.windows[i]
    stream = ew.stream(cost, lo, hi)
    items = stream.items
    sp = plan_window(stream, layout, config, 0, len(items), i == len(ew.windows) - 1)
    del stream  # gather the plan's columns one at a time, releasing what is no longer needed
    e, left = sp.entry_item, sp.leftover
    leftover = Items(items.sample[left], items.start[left], items.length[left])
    cols = [items.sample, items.start, items.length]
    del items
    for j in range(3):
        cols[j] = cols[j][e]
    return PlanPart(*cols, sp.entry_delay, np.diff(sp.mb_offsets), sp.step_mbs, leftover,
                    config.max_delay)


def part_slices(part: PlanPart, base: dict, dp: int, cost: CostModel) -> dict:
    """name -> (element offset, array) of a window's slice of every stored array, given the
    entries/mbs/steps/leftover of the windows before it (``base``)."""
    local_step, rank = microbatch_step_rank(part.step_mbs, dp)
    e, m, s, l_ = base["entries"], base["mbs"], base["steps"], base["leftover"]
    # every microbatch is the sum of its own documents in order: the window's slice equals the
    # whole-epoch result bit for bit wherever the window starts
    offsets = np.zeros(part.mb_sizes.shape[0] + 1, dtype=np.int64)
    np.cumsum(part.mb_sizes, out=offsets[1:])
    mb_fwd, mb_bwd = microbatch_costs(cost, part.entry_length, offsets)
    return {"entry_sample": (e, part.entry_sample), "entry_start": (e, part.entry_start),
            "entry_length": (e, part.entry_length), "entry_delay": (e, part.entry_delay),
            "mb_offsets": (m + 1, e + np.cumsum(part.mb_sizes)),
            "mb_step": (m, s + local_step), "mb_rank": (m, rank),
            "mb_fwd": (m, mb_fwd), "mb_bwd": (m, mb_bwd), "step_mbs": (s, part.step_mbs),
            "leftover_sample": (l_, part.leftover.sample),
            "leftover_start": (l_, part.leftover.start),
            "leftover_length": (l_, part.leftover.length)}


_ZERO = {"entries": 0, "mbs": 0, "steps": 0, "leftover": 0, "tokens": 0, "max_delay": 0,
         "delayed": 0, "over_bound": 0}


def _add(total: dict, c: dict) -> dict:
    out = {k: total[k] + c[k] for k in total if k != "max_delay"}
    out["max_delay"] = max(total["max_delay"], c["max_delay"])
    return out


def _epoch_record(epoch: int, infos: dict, tot: dict, stats: dict, layout: Layout) -> dict:
    summary = store.epoch_summary(tot["entries"], tot["mbs"], tot["steps"], tot["tokens"],
                                  tot["leftover"], tot["max_delay"], tot["delayed"],
                                  layout.capacity)
    return {"epoch": epoch, "dir": store.epoch_dirname(epoch), "arrays": infos,
            "stats": stats, "summary": summary}


def _finish_stats(stats: dict, config: PlannerConfig, tot: dict, seconds: float) -> dict:
    """The plan's stats as ``planner.build_plan`` / ``plan_epoch`` record them."""
    stats, n_left = dict(stats), tot["leftover"]
    stats["dropped"] = n_left if config.tail == "drop" else 0
    stats["carried_out"] = n_left if config.tail == "carry" else 0
    stats["delay_bound_exceeded"] = tot["over_bound"]
    stats["plan_seconds"] = seconds
    return stats


class _Epochs:
    """What the local and the distributed writer share: the epochs in turn (each one's windows,
    the tail carried in from the epoch before), their manifest records and the manifest."""

    def __init__(self, samples: SampleTable, layout: Layout, config: PlannerConfig, epochs: int):
        self.samples, self.layout, self.config, self.epochs = samples, layout, config, epochs
        self.records, self.n_windows, self.carry = [], [], None
        self.t_all = time.perf_counter()

    def __iter__(self):
        """``(epoch, EpochWindows)`` of every epoch; call :meth:`done` before the next."""
        for epoch in range(self.epochs):
            self.t0 = time.perf_counter()
            ew = EpochWindows(self.samples.lengths, self.layout, self.config, epoch, self.carry)
            self.n_windows.append(len(ew.windows))
            yield epoch, ew

    def done(self, epoch: int, ew: EpochWindows, infos: dict, tot: dict, leftover) -> None:
        """Record the epoch written (``infos`` its arrays, ``tot`` its counts); ``leftover``:
        the items its last window left, carried into the next epoch under ``tail='carry'``."""
        stats = _finish_stats(ew.stats, self.config, tot, time.perf_counter() - self.t0)
        self.records.append(_epoch_record(epoch, infos, tot, stats, self.layout))
        self.carry = leftover if self.config.tail == "carry" else None

    def manifest(self, cost: CostModel, extra: Optional[dict], workers: int, world: int) -> dict:
        s = self.samples
        return dict(store.plan_header(self.layout, self.config, cost, len(s), s.fingerprint(),
                                      s.total_tokens),
                    epochs=self.records, extra=extra or {},
                    precompute={"workers": workers, "world_size": world,
                                "windows": self.n_windows,
                                "seconds": time.perf_counter() - self.t_all})


# ---- one machine: a pool of processes ------------------------------------------------------
_WORKER: dict = {}


def _init_worker(ew, cost):
    _WORKER["ew"], _WORKER["cost"] = ew, cost


def _plan_in_worker(i: int) -> PlanPart:
    return plan_part(_WORKER["ew"], _WORKER["cost"], i)


def _pool_context():
    methods = mp.get_all_start_methods()
    # fork shares the order and the compiled kernels with the workers for free
    return mp.get_context("fork" if "fork" in methods else "spawn")


def precompute(samples: SampleTable, cost: CostModel, layout: Layout, config: PlannerConfig,
               out, *, epochs: int = 1, workers: int = 1, progress: bool = False,
               overwrite: bool = False, extra: Optional[dict] = None, group=None) -> Path:
    """Plan ``epochs`` epochs (carrying the tail between them like ``plan_epochs``) into the
    plan directory ``out``, with ``workers`` processes, or over the ranks of ``group`` /
    the initialised default torch.distributed process group when it has several ranks."""
    if epochs < 1:
        raise ValueError(f"epochs {epochs} must be >= 1")
    if workers < 1:
        raise ValueError(f"workers {workers} must be >= 1")
    from ..strategies import registry as strategies
    strategies.get(config.strategy)
    check_fixed_mode(layout, "precompute", config)
    dist = _distributed(group)
    if dist is not None:
        return _precompute_distributed(samples, cost, layout, config, out, epochs=epochs,
                                      progress=progress, overwrite=overwrite, extra=extra,
                                      group=group)
    run = _Epochs(samples, layout, config, epochs)
    writer = store.PlanDirWriter(out, overwrite=overwrite)
    bar = _bar(progress)
    try:
        for epoch, ew in run:
            nw = len(ew.windows)
            _bar_add(bar, nw, f"epoch {epoch}")
            d = writer.epoch_dir(epoch)
            apps = {k: store.ArrayAppender(d / f"{k}.npy", dt) for k, dt in store.ARRAYS.items()}
            apps["mb_offsets"].append(np.zeros(1, np.int64))
            tot, last = dict(_ZERO), None
            pool = None
            if workers > 1 and nw > 1:
                if epoch == 0:
                    _warm_kernels(cost, layout, config)
                pool = _pool_context().Pool(min(workers, nw), _init_worker, (ew, cost))
                parts = pool.imap(_plan_in_worker, range(nw))
            else:
                parts = (plan_part(ew, cost, i) for i in range(nw))
            # one window: show the time it takes
            with _Ticker(bar if nw == 1 else None):
                try:
                    for part in parts:
                        for name, (off, a) in part_slices(part, tot, layout.dp, cost).items():
                            apps[name].append(a)
                        tot, last = _add(tot, part.counts), part
                        if bar is not None:
                            bar.update(1)
                finally:
                    if pool is not None:
                        pool.terminate()
                        pool.join()
            infos = {k: a.close() for k, a in apps.items()}
            run.done(epoch, ew, infos, tot, last.leftover if last is not None else None)
        return writer.commit(run.manifest(cost, extra, workers, 1))
    except BaseException:
        writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()


# ---- many machines: ranks of a torch.distributed job -----------------------------------------
class RankFailed(ValueError):
    """Raised on every rank of a distributed precompute when one rank met bad input (its files,
    a window only it plans, its disk): the same message everywhere, naming the failed rank."""


class RankCrashed(RuntimeError):
    """As :class:`RankFailed`, for an unexpected error (a bug) on one rank."""


def together(fn, group=None, share: bool = False):
    """Run ``fn()`` on this rank, then tell every rank of ``group`` whether any rank failed
    (``all_gather_object``), before anyone goes on to a collective a failed rank would never
    reach: a failure on one rank raises the same :class:`RankFailed` (bad input: ValueError,
    OSError) or :class:`RankCrashed` on every rank, naming that rank and its message. Returns
    ``fn()``'s value, or with ``share`` every rank's value (a list in rank order)."""
    import torch.distributed as dist
    w = World.current(group)
    value, err = None, None
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 -- reported to every rank, re-raised below
        err = e
    mine = None if err is None else (type(err).__name__, str(err),
                                     isinstance(err, (ValueError, OSError)))
    every = [None] * w.size
    dist.all_gather_object(every, (mine, value if share else None), group=group)
    failed = [(r, m) for r, (m, _) in enumerate(every) if m is not None]
    if failed:
        r, (kind, text, user) = failed[0]
        msg = f"rank {r} of {w.size}: {text if user else kind + ': ' + text}"
        if len(failed) > 1:
            msg += f" (ranks {', '.join(str(f[0]) for f in failed[1:])} failed too)"
        raise (RankFailed if user else RankCrashed)(msg) from err
    return [v for _, v in every] if share else value


def _precompute_distributed(samples, cost, layout, config, out, *, epochs, progress, overwrite,
                            extra, group) -> Path:
    """Rank r plans windows ``[r * W // world, (r + 1) * W // world)`` of every epoch and writes
    them into files rank 0 allocated once every rank's sizes are known (``all_gather``); each
    rank hashes a share of the arrays; rank 0 writes the manifest and renames the directory.
    Every step that can fail on one rank alone ends in :func:`together`, so a failure there
    raises the same error on every rank instead of leaving the others in a collective."""
    w = World.current(group)
    rank, world = w.rank, w.size
    run = _Epochs(samples, layout, config, epochs)

    def start():
        # the ranks must plan one corpus: lengths that differ between machines would give a
        # plan that matches none of them, silently
        seen = (len(samples), samples.fingerprint())
        tmp = str(store.PlanDirWriter(out, overwrite=overwrite).tmp) if rank == 0 else None
        return seen, tmp
    seen = together(start, group, share=True)
    if len({s for s, _ in seen}) > 1:
        exc = ValueError("the ranks read different lengths: " + ", ".join(
            f"rank {r} {n:,} samples (fingerprint {fp})" for r, ((n, fp), _) in enumerate(seen))
            + "; give every rank the same --lengths / --dataset")
        if rank == 0:
            store.PlanDirWriter(out, overwrite=overwrite, tmp=Path(seen[0][1])).abort()
        raise exc
    writer = store.PlanDirWriter(out, overwrite=overwrite, tmp=Path(seen[0][1]))
    bar = _bar(progress and rank == 0)
    epochs_it = iter(run)
    try:
        for _ in range(epochs):
            epoch, ew = together(lambda: next(epochs_it), group)
            nw = len(ew.windows)
            mine = range(rank * nw // world, (rank + 1) * nw // world)
            _bar_add(bar, len(mine), f"epoch {epoch} (rank 0 of {world})")
            # planned windows wait on disk for the file sizes (every rank's counts), not in
            # memory: a rank holds one window at a time, not its share of the epoch
            spill = writer.tmp / f".spill-epoch{epoch}-rank{rank}"

            def plan_mine():
                spill.mkdir(exist_ok=True)
                counts_mine, last_left = [], None
                with _Ticker(bar if len(mine) == 1 else None):
                    for i in mine:
                        part = plan_part(ew, cost, i)
                        _spill(spill / f"{i}.npz", part)
                        counts_mine.append(part.counts)
                        last_left = part.leftover
                        del part
                        if bar is not None:
                            bar.update(1)
                own_last = len(mine) and mine[-1] == nw - 1
                return {"counts": counts_mine, "leftover": last_left if own_last else None}
            every = together(plan_mine, group, share=True)
            counts = [c for r in every for c in r["counts"]]
            tot = dict(_ZERO)
            for c in counts:
                tot = _add(tot, c)
            d = writer.tmp / store.epoch_dirname(epoch)
            sizes = _array_sizes(tot)

            def allocate():
                if rank == 0:
                    d.mkdir(exist_ok=True)
                    for k, dt in store.ARRAYS.items():
                        store.allocate_array(d / f"{k}.npy", dt, sizes[k])
                    store.write_slice(d / "mb_offsets.npy", "<i8", sizes["mb_offsets"], 0,
                                      np.zeros(1, np.int64))
            together(allocate, group)

            def write_mine():
                base = dict(_ZERO)
                for c in counts[:mine.start]:
                    base = _add(base, c)
                for i in mine:
                    part = _unspill(spill / f"{i}.npz", config.max_delay)
                    for name, (off, a) in part_slices(part, base, layout.dp, cost).items():
                        store.write_slice(d / f"{name}.npy", store.ARRAYS[name], sizes[name],
                                          off, a)
                    base = _add(base, part.counts)
                    (spill / f"{i}.npz").unlink()
                spill.rmdir()
            together(write_mine, group)
            names = list(store.ARRAYS)[rank::world]
            digests = together(lambda: {k: store.file_digest(d / f"{k}.npy") for k in names},
                               group, share=True)
            digest = {k: v for r in digests for k, v in r.items()}
            infos = {k: {"file": f"{k}.npy", "dtype": dt, "shape": [sizes[k]],
                         "sha256": digest[k]} for k, dt in store.ARRAYS.items()}
            run.done(epoch, ew, infos, tot, every[-1]["leftover"])

        def commit():
            if rank == 0:
                writer.commit(run.manifest(cost, extra, 1, world))
        together(commit, group)
        return Path(out)
    except BaseException:
        if rank == 0 and writer.tmp.exists():
            writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()


_PART = ("entry_sample", "entry_start", "entry_length", "entry_delay", "mb_sizes", "step_mbs")


def _spill(path: Path, part: PlanPart) -> None:
    """Write a planned window to ``path`` (an uncompressed .npz)."""
    arrays = {k: np.asarray(getattr(part, k)) for k in _PART}
    arrays.update(left_sample=part.leftover.sample, left_start=part.leftover.start,
                  left_length=part.leftover.length)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def _unspill(path: Path, max_delay_bound: int) -> PlanPart:
    with np.load(path) as z:
        return PlanPart(*(z[k] for k in _PART),
                        Items(z["left_sample"], z["left_start"], z["left_length"]),
                        max_delay_bound)


def _array_sizes(tot: dict) -> dict:
    e, m, s, l_ = tot["entries"], tot["mbs"], tot["steps"], tot["leftover"]
    return {"entry_sample": e, "entry_start": e, "entry_length": e, "entry_delay": e,
            "mb_offsets": m + 1, "mb_step": m, "mb_rank": m, "mb_fwd": m, "mb_bwd": m,
            "step_mbs": s, "leftover_sample": l_, "leftover_start": l_, "leftover_length": l_}


def _warm_kernels(cost, layout, config) -> None:
    """Compile (or load from the cache) the fixed-CP kernels before the workers fork, so each
    worker does not compile them again."""
    from ..planning.warmup import warmup
    warmup(["fixed"])


def _distributed(group):
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if World.current(group).multi else None


def _bar_add(bar, n: int, description: str) -> None:
    """``n`` more windows on the progress ``bar`` (None: no bar), under ``description``."""
    if bar is not None:
        bar.total = (bar.total or 0) + n
        bar.set_description(description)


def _bar(progress: bool):
    if not progress:
        return None
    from tqdm import tqdm
    tqdm.monitor_interval = 0  # no monitor thread: the pool forks
    return tqdm(total=0, unit="window", dynamic_ncols=True)


class _Ticker:
    """Refresh ``bar`` every second while one long window is planned, so its elapsed time moves
    (the bar would otherwise sit at 0/1 until the epoch is done). Only where no pool forks."""

    def __init__(self, bar, every_s: float = 1.0):
        import threading
        self.bar, self.done = bar, threading.Event()
        self.thread = None
        if bar is not None:
            self.thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
            self.thread.start()

    def _run(self, every_s: float) -> None:
        while not self.done.wait(every_s):
            self.bar.refresh()

    def stop(self) -> None:
        self.done.set()
        if self.thread is not None:
            self.thread.join()

    def __enter__(self) -> "_Ticker":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
