"""The closed loop's measurement: a small timer a training loop calls around every microbatch's
forward and backward (issue #26).

    timer = MicrobatchTimer(device)            # "cuda..." -> CUDA events, else a wall clock
    for batch in loader:
        timer.begin(batch)                     # the microbatch's document lengths and step
        loss = model(...)
        timer.split()                          # forward ends, backward begins (optional)
        loss.backward()
        timer.end()
    records = timer.take()                     # the measured microbatches since the last take

On a GPU the marks are CUDA events recorded on the current stream, so timing adds no
synchronisation to the step; :meth:`take` waits for the last event and reads the elapsed times
(this path has not yet been run on a GPU: the project's machine has none).
On a CPU, where the work is done when the call returns, it is ``time.perf_counter``
(``clock="wall"``), or the process's CPU time (``clock="cpu"``, ``time.process_time``): the
work the microbatch cost this process, blind to the time other processes took the cores from
it (a shared, overloaded machine; one torch thread per rank), or any callable returning seconds
(a test's deterministic clock). A loop
that cannot split the passes (the HF Trainer's ``training_step`` runs both) calls only
:meth:`begin` and :meth:`end` and records the total.

A record is :class:`Measured`: the step, the microbatch's document lengths (int64[n], the
features the cost model uses) and seconds (``forward``/``backward`` when split, ``total``
always)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass
class Measured:
    """One timed microbatch. ``lengths`` int64[n]: its documents (chunk pieces as placed);
    seconds: ``total`` (forward + backward) and, when the loop split the passes, ``forward``
    and ``backward``."""

    step: int
    lengths: np.ndarray
    total: float
    forward: Optional[float] = None
    backward: Optional[float] = None


def batch_lengths(batch) -> np.ndarray:
    """The document lengths of a collated microbatch (``cu_seqlens``) or a
    :class:`~balancer.loader.refs.MicrobatchRef` (its ``lengths``), int64[n]."""
    if isinstance(batch, dict):
        if "cu_seqlens" not in batch:
            raise ValueError(f"the batch has no cu_seqlens (keys {sorted(batch)}): pass the "
                             f"document lengths")
        cu = np.asarray(batch["cu_seqlens"].cpu() if hasattr(batch["cu_seqlens"], "cpu")
                        else batch["cu_seqlens"], dtype=np.int64)
        return np.diff(cu)
    if hasattr(batch, "lengths"):
        return np.asarray(batch.lengths, dtype=np.int64)
    return np.asarray(batch, dtype=np.int64)


class MicrobatchTimer:
    """Times forward and backward of every microbatch (see the module docstring). ``device``:
    a ``torch.device`` or its name; a CUDA device times with events on its current stream."""

    def __init__(self, device=None, clock="wall"):
        if not callable(clock) and clock not in ("wall", "cpu"):
            raise ValueError(f"clock {clock!r} is not 'wall', 'cpu' or a callable")
        self.cuda = device is not None and str(device).startswith("cuda")
        if self.cuda and clock != "wall":
            raise ValueError("a CUDA device is timed with events (clock='wall')")
        self._clock = clock if callable(clock) else \
            time.perf_counter if clock == "wall" else time.process_time
        self._open: Optional[dict] = None
        self._pending: list[dict] = []

    def _mark(self):
        if self.cuda:
            import torch
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return self._clock()

    def begin(self, batch, step: Optional[int] = None, lengths=None) -> None:
        """A microbatch's forward begins. ``batch``: the collated dict (its ``cu_seqlens`` and
        ``step``), a ref, or the document lengths; ``step`` overrides the batch's, ``lengths``
        its documents (under CP give the whole documents: the collated ``cu_seqlens`` are the
        rank's shard)."""
        if self._open is not None:
            raise RuntimeError("begin() twice without end(): a microbatch was not finished")
        if step is None:
            step = batch.get("step") if isinstance(batch, dict) else getattr(batch, "step", None)
        if step is None:
            raise ValueError("give step= (the batch carries none)")
        self._open = {"step": int(step), "lengths": batch_lengths(batch if lengths is None else lengths), "t0": self._mark(),
                      "t1": None}

    def split(self) -> None:
        """The forward ends and the backward begins."""
        if self._open is None:
            raise RuntimeError("split() before begin()")
        self._open["t1"] = self._mark()

    def end(self) -> None:
        """The microbatch's backward (or, unsplit, its whole work) ends."""
        if self._open is None:
            raise RuntimeError("end() before begin()")
        self._open["t2"] = self._mark()
        self._pending.append(self._open)
        self._open = None

    def take(self) -> list[Measured]:
        """The microbatches measured since the last call (a GPU's events are waited for)."""
        out = []
        if self.cuda and self._pending:
            self._pending[-1]["t2"].synchronize()
        for r in self._pending:
            t0, t1, t2 = r["t0"], r["t1"], r["t2"]
            total = self._elapsed(t0, t2)
            fwd = bwd = None
            if t1 is not None:
                fwd, bwd = self._elapsed(t0, t1), self._elapsed(t1, t2)
            out.append(Measured(r["step"], r["lengths"], total, fwd, bwd))
        self._pending = []
        return out

    def _elapsed(self, a, b) -> float:
        if self.cuda:
            return float(a.elapsed_time(b)) / 1e3
        return float(b - a)


__all__ = ["Measured", "MicrobatchTimer", "batch_lengths"]
