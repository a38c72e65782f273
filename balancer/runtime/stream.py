"""Streaming input: an ``IterableDataset`` wrapper that reads this rank's own stream, buffers one
global batch over the DP ranks, balances it with :class:`~balancer.runtime.RuntimeBalancer`
and yields this rank's packed microbatches (the keys of :class:`balancer.loader.collate.PackedCollator`
plus ``source_rank``/``source_index``).

``source`` is any iterable of rows -- a Hugging Face ``IterableDataset`` (after
``datasets.distributed.split_dataset_by_node(ds, rank, world_size)``), any
``torch.utils.data.IterableDataset``, or a ``StatefulDataLoader(ds, batch_size=None,
num_workers=k)`` to read with workers -- each row a mapping holding ``tokens_column`` or the
token ids themselves. Use it with ``num_workers=0`` (the step's collectives run in the loading
process): ``StatefulDataLoader(StreamingPackedDataset(...), batch_size=None)``.

Per step every rank reads rows until the tokens it holds (carried + new) reach
``tokens_per_rank`` (default: the step budget -- ``global_batch_tokens`` or dp x microbatches x
capacity -- divided by the ranks still reading), so steps stay full and the carry stays small.

The wrapper owns the source: give it one that has not been iterated yet (its ``state_dict()``
at construction is where a fresh pass starts; a Hugging Face ``IterableDataset`` keeps reporting
the state of its last iteration).

Unequal stream lengths (``uneven``), decided from the flags every rank sends with its offers:

* ``"drain"`` (default): read every stream to its end; a rank whose stream ended offers nothing
  new but still trains samples moved to it; the others read ``budget / ranks still reading``.
* ``"stop"``: stop reading at the step where any stream ends (that step is trained); the other
  ranks' unread rows stay in their sources (``stats["unread_ranks"]`` names them, their
  ``state_dict`` points at the first unread row); the one row each of them read ahead (to see
  its stream's end the step it comes) is trained in a flush step.

Either way, carried samples are flushed in further steps (``final=True``: the tail merged into a
step when it fits; a final step never carries what the next ones could not train, e.g. fewer
samples than DP ranks), and what still cannot make a step (fewer samples than DP ranks in the
whole stream, or a tail of samples too heavy to share any split) is counted with its ids in
``stats["unplanned"]``/``["unplanned_ids"]``; empty rows are counted in ``stats["empty"]``,
over-long ones raise (``over_length="error"``) or are counted in ``stats["skipped"]``
(``"skip"``). Nothing else is left out: every row read is trained once. The end of each pass
is logged on every rank (logger ``balancer.runtime.stream``; INFO, WARNING when a sample was
not trained) with these counts.

``state_dict()`` is the resume point after the last microbatch handed out: the source's state
at the start of the current step (its ``state_dict()``, or the rows consumed for a source
without one, skipped again on resume), the samples carried into the step (token tensors), the
step counter, the microbatches of the step already handed out, and the counters. Loading it on
every rank and iterating re-reads the step, re-plans it identically and skips what was handed
out. All ranks must resume from the same step (checked: a mismatch raises on every rank).
A Hugging Face stream shuffled through a buffer (``ds.shuffle(seed=..., buffer_size=...)``,
directly or read by a DataLoader) does not hold its buffer in its ``state_dict()``: the wrapper
finds the buffer shuffle and records, instead, the rows consumed, re-reading the seeded stream
(at the checkpoint's epoch) and skipping them on resume -- exact, at the cost of re-reading the
epoch's rows so far; the state carries a digest of the shuffle's seed, and resuming with
another (an unseeded shuffle draws a new one in every process) is refused, naming the fix.
The state records the rank and world size it was taken on: loading it on another rank or in a
job of another size is refused (on every rank, at the first step), as is a state whose values
cannot be a stream's (a negative count, an unknown phase, a microbatch past its step): one
ValueError naming the checkpoint and the key, never a bare KeyError.
"""
from __future__ import annotations

import copy
import logging
from typing import Iterator, Literal, Optional

import numpy as np
import torch
from torch.utils.data import IterableDataset

from ..config import Layout, PlannerConfig
from ..cost.model import CostModel
from .runtime_balancer import RuntimeBalancer
from .payload import TOKENS, Columns
from ..world import World
from .stream_source import set_source_epoch, shuffle_fingerprint, stateful

STATE_VERSION = 1
log = logging.getLogger(__name__)
CHECKPOINT = "StreamingPackedDataset checkpoint"
#: keys of a state and what each must be
_COUNTS = ("epoch", "step", "position", "next_local", "active", "mb", "rank")
_PHASES = ("read", "flush", "done")
_MAX_IDS = 10_000  # ids kept per counter (the counts are exact)
SOURCE = "its stream source"  # names the source in a failure raised on every rank


class StreamingPackedDataset(IterableDataset):
    """Balanced packed microbatches from per-rank streams (see the module docstring).

    ``layout.dp`` must equal the size of ``group`` (default: the world); ``layout.microbatches``
    microbatches per rank per step (fewer in the last steps). ``id_column`` names an integer id
    in the rows (default: ``rank + dp * k`` for this rank's k-th row). ``max_carry``: steps a
    sample may be carried before it is pinned (default ``config.max_delay``).

    ``labels_column`` (token ids, -100 where not trained) or ``loss_mask_column`` (0/1, e.g.
    TRL's ``completion_mask``), at most one, say which tokens are trained; ``token_columns``
    name more per-token columns (advantages, old log-probs...): each is in the batch under its
    own name, packed, padded and CP-sharded like ``input_ids``, and the loss-token counts count
    the trained tokens (:class:`~balancer.runtime.runtime_balancer.RuntimeBalancer`)."""

    def __init__(self, source, cost: CostModel, layout: Layout,
                 config: Optional[PlannerConfig] = None, *, group=None,
                 tokens_column: str = "input_ids", id_column: Optional[str] = None,
                 tokens_per_rank: Optional[int] = None,
                 uneven: Literal["drain", "stop"] = "drain", max_carry: Optional[int] = None,
                 over_length: Literal["error", "skip"] = "error", cp_rank: int = 0,
                 labels_column: Optional[str] = None, loss_mask_column: Optional[str] = None,
                 token_columns=()):
        if isinstance(token_columns, str):
            raise ValueError(f"token_columns is a list of column names, got the string "
                             f"{token_columns!r} (write token_columns=[{token_columns!r}])")
        if labels_column is not None and loss_mask_column is not None:
            raise ValueError(f"give labels_column ({labels_column!r}) or loss_mask_column "
                             f"({loss_mask_column!r}), not both: each says what is trained")
        self.labels_column, self.loss_mask_column = labels_column, loss_mask_column
        trained = [c for c in (labels_column, loss_mask_column) if c is not None]
        self._fields = tuple(trained) + tuple(token_columns)
        if len(set(self._fields)) != len(self._fields) or tokens_column in self._fields:
            raise ValueError(f"a column is named twice: tokens {tokens_column!r}, "
                             f"labels/mask {trained}, token_columns {list(token_columns)}")
        if uneven not in ("drain", "stop"):
            raise ValueError(f"uneven must be 'drain' or 'stop', got {uneven!r}")
        for name, v, low in (("tokens_per_rank", tokens_per_rank, 1), ("max_carry", max_carry, 0)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))
                                  or v < low):  # 1.5 was truncated, -1 pinned every sample
                raise ValueError(f"{name} {v!r} must be an integer >= {low}")
        self.source, self.cost, self.layout = source, cost, layout
        self.config = config or PlannerConfig()
        self.group, self.tokens_column, self.id_column = group, tokens_column, id_column
        self.tokens_per_rank, self.uneven = tokens_per_rank, uneven
        self.max_carry, self.over_length, self.cp_rank = max_carry, over_length, cp_rank
        # a stream shuffled through a buffer: its state does not hold the buffer, so it is
        # re-read from its start (the seeded order is the same) and what was read is skipped
        self._shuffle = shuffle_fingerprint(source)
        self._replay = self._shuffle is not None
        self._initial_source = (copy.deepcopy(source.state_dict()) if self._source_stateful()
                                else None)
        self.epoch = 0
        self._start = self._fresh()
        self._mb = 0
        self._owner: Optional[tuple] = None  # (rank, world size) of a loaded state, unchecked
        self.last_step: dict = {}  # the last step's counters, bytes and seconds
        self.last_plan = None  # the last step's StepPlan (equal on every rank)

    # ---- state --------------------------------------------------------------------------
    def _source_stateful(self) -> bool:
        return not self._replay and stateful(self.source)

    def _fresh(self) -> dict:
        return {"version": STATE_VERSION, "epoch": self.epoch, "step": 0, "position": 0,
                "source": self._initial_source if self._source_stateful() else {"consumed": 0},
                "held": None, "peek": None, "next_local": 0, "active": self.layout.dp,
                "exhausted": False,
                "phase": "read",
                "counters": {"read": 0, "empty": 0, "trained_here": 0, "trained": 0,
                             "skipped": 0, "skipped_ids": [], "unplanned": 0,
                             "unplanned_ids": [], "pinned": 0, "carry_bound_exceeded": 0,
                             "max_age": 0, "steps": 0, "unread_ranks": []}}

    def state_dict(self) -> dict:
        """Resume point after the last microbatch handed out (see the module docstring)."""
        st = copy.deepcopy({k: v for k, v in self._start.items() if k not in ("held", "peek")})
        st["held"], st["peek"] = self._start["held"], self._start.get("peek")  # never modified
        st["mb"] = self._mb
        w = World.current(self.group)  # whose stream this is: checked when loaded
        st["rank"], st["world_size"] = w.rank, w.size
        if self._shuffle is not None:
            st["shuffle"] = self._shuffle
        return st

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state`` (checked here for what it holds, and at the first step for the
        rank and world size it was taken on)."""
        check_state(state)
        state = dict(state)
        saved = state.pop("shuffle", None)
        if saved != self._shuffle:
            raise ValueError(
                f"{CHECKPOINT}: the stream's shuffle differs from the checkpoint's ("
                f"{'none' if saved is None else 'another seed'} there, "
                f"{'none' if self._shuffle is None else 'a buffer shuffle'} here): resuming "
                f"re-reads the shuffled stream in the same order, so build it exactly as "
                f"before, with a fixed seed: ds.shuffle(seed=..., buffer_size=...)")
        self._mb = int(state.pop("mb"))
        self._owner = (int(state.pop("rank")), int(state.pop("world_size")))
        self._start = state
        self.epoch = int(state["epoch"])
        if self._replay:  # the shuffle's order depends on the epoch: the checkpoint's
            set_source_epoch(self.source, self.epoch)

    @property
    def stats(self) -> dict:
        """Counters of this pass up to the current step (global counts are equal on every
        rank; ``read``/``empty``/``trained_here`` are this rank's)."""
        return copy.deepcopy(self._start["counters"])

    def set_epoch(self, epoch: int) -> None:
        """Start a fresh pass (the source's ``set_epoch`` is called when it has one)."""
        self.epoch = int(epoch)
        set_source_epoch(self.source, self.epoch)
        self._start, self._mb = self._fresh(), 0

    # ---- reading --------------------------------------------------------------------------
    def _open(self, st: dict) -> Iterator:
        src = st["source"]
        if self._source_stateful():
            if src is not None:
                self.source.load_state_dict(copy.deepcopy(src))
            return iter(self.source)
        it = iter(self.source)
        for _ in range(int(src["consumed"])):  # a source without state: skip what was read
            next(it)
        return it

    def _snapshot(self, consumed: int):
        if self._source_stateful():
            return copy.deepcopy(self.source.state_dict())
        return {"consumed": consumed}

    def _tokens(self, row, k: int) -> torch.Tensor:
        """The token ids of this rank's ``k``-th row, int64[L]; a ValueError naming the row."""
        if isinstance(row, dict) or hasattr(row, "keys"):
            if self.tokens_column not in row:
                raise ValueError(f"row {k} of this rank's stream has no {self.tokens_column!r} "
                                 f"(columns: {sorted(row.keys())})")
            v = row[self.tokens_column]
        else:
            v = row
        t = torch.as_tensor(np.asarray(v) if not isinstance(v, torch.Tensor) else v).reshape(-1)
        if t.numel() and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
            raise ValueError(f"row {k} of this rank's stream: token ids of dtype {t.dtype}, "
                             f"not integers")
        return t.to(torch.int64)

    def _columns(self, row, k: int, n: int) -> dict:
        """This rank's ``k``-th row's labels/mask and token columns (tensors of ``n`` rows); a
        ValueError naming the row and the column."""
        out = {}
        for f in self._fields:
            if not (isinstance(row, dict) or hasattr(row, "keys")) or f not in row:
                have = sorted(row.keys()) if hasattr(row, "keys") else type(row).__name__
                raise ValueError(f"row {k} of this rank's stream has no {f!r} (columns: {have})")
            v = row[f]
            t = torch.as_tensor(np.asarray(v) if not isinstance(v, torch.Tensor) else v)
            if t.dim() != 1 or t.shape[0] != n:
                raise ValueError(f"row {k} of this rank's stream: column {f!r} has "
                                 f"{tuple(t.shape)} values but its tokens have {n}")
            out[f] = t
        return out

    def _id(self, row, k: int, default: int) -> int:
        if not self.id_column:
            return default
        if self.id_column not in row:
            raise ValueError(f"row {k} of this rank's stream has no id column {self.id_column!r}")
        return int(row[self.id_column])

    def _budget(self) -> int:
        lay, cfg = self.layout, self.config
        return int(cfg.global_batch_tokens or lay.dp * lay.microbatches * lay.capacity)

    # ---- iteration ------------------------------------------------------------------------
    def __iter__(self):
        if self._start["phase"] == "done":  # a new pass over the source
            self._start, self._mb = self._fresh(), 0
        in_worker()
        st = self._start
        try:  # opening the source may fail on one rank: raised on every rank at the first step
            it, opened = self._open(st), None
        except Exception as e:  # noqa: BLE001 -- any failure of the source, sent to every rank
            it, opened = iter(()), e
        consumed = int(st["source"]["consumed"]) if not self._source_stateful() else 0
        bal = RuntimeBalancer(self.cost, self.layout, self.config, group=self.group,
                              max_carry=self.max_carry, over_length=self.over_length,
                              cp_rank=self.cp_rank, labels_field=self.labels_column,
                              loss_mask_field=self.loss_mask_column)
        lay = self.layout
        owner, self._owner = self._owner, None
        world = World.current(self.group).size
        if owner is not None and owner != (bal.rank, world):
            bal.fail(ValueError(  # every rank raises, none waits in the step's collective
                f"{CHECKPOINT}: taken on rank {owner[0]} of a world size {owner[1]} but this "
                f"process is rank {bal.rank} and this job's world size is {world}: each rank "
                f"loads the state its own rank saved, in a job of the same size (another rank's "
                f"stream would train its samples again and lose this one's)"))
        if opened is not None:
            bal.fail(opened, source=SOURCE)
        while True:
            st = self._start
            if st["phase"] == "done":
                return
            held = st["held"]
            if held is None:
                bal.set_held([], [], None)
            else:
                bal.set_held(held["ids"], held["ages"],
                             Columns(np.asarray(held["lengths"], np.int64),
                                     {TOKENS: held["tokens"], **held.get("fields", {})}, {}))
            bal.step_index, bal.position = st["step"], st["position"]
            c = copy.deepcopy(st["counters"])
            exhausted, next_local = bool(st["exhausted"]), int(st["next_local"])
            seqs, ids, fields = [], [], []
            peek = st.get("peek")
            have = 0 if held is None else int(np.sum(held["lengths"]))
            if peek is not None:  # the row read ahead last step (offered even when flushing)
                seqs.append(peek["tokens"])
                fields.append(peek.get("fields", {}))
                ids.append(int(peek["id"]))
                have += int(peek["tokens"].numel())
                peek = None
            try:  # a bad row on one rank is raised on every rank (bal.fail), none hangs
                if st["phase"] == "read" and not exhausted:
                    target = self.tokens_per_rank or -(-self._budget() // max(st["active"], 1))

                    def pull():  # the next non-empty row (id, tokens), or None at the end
                        nonlocal consumed, next_local
                        while True:
                            try:
                                row = next(it)
                            except StopIteration:
                                return None
                            consumed += 1
                            k, next_local = next_local, next_local + 1
                            c["read"] += 1
                            toks = self._tokens(row, k)
                            if toks.numel():
                                return (self._id(row, k, bal.rank + lay.dp * k), toks,
                                        self._columns(row, k, toks.numel()))
                            c["empty"] += 1

                    while have < target and not exhausted:
                        got = pull()
                        if got is None:
                            exhausted = True
                            break
                        ids.append(got[0])
                        seqs.append(got[1])
                        fields.append(got[2])
                        have += int(got[1].numel())
                    if not exhausted:  # one row ahead: a stream's end is known the step it comes
                        got = pull()
                        if got is None:
                            exhausted = True
                        else:
                            peek = {"id": got[0], "tokens": got[1]}
                            if got[2]:
                                peek["fields"] = got[2]
                snapshot = self._snapshot(consumed)
                cols = Columns.from_sequences(
                    seqs, {f: [x[f] for x in fields] for f in self._fields}) if seqs else None
            except Exception as e:  # noqa: BLE001 -- a refused row, or the source failing
                bal.fail(e, source=SOURCE)
            ends = all if self.uneven == "drain" else any  # this is the last step read
            res = bal.step(cols, np.asarray(ids, np.int64),
                           header={"exhausted": exhausted, "peek": peek is not None},
                           final=True if st["phase"] == "flush" else
                           (lambda hs: ends(h["exhausted"] for h in hs)),
                           keep=_keep)
            plan = res.plan
            flags = [bool(h["exhausted"]) for h in res.stats["headers"]]
            phase = st["phase"]
            if phase == "read" and (all(flags) or (self.uneven == "stop" and any(flags))):
                phase = "flush"
                c["unread_ranks"] = [r for r, f in enumerate(flags) if not f]
            # done when nothing is carried and no rank holds a row read ahead: with
            # uneven="stop" a rank still reading has read one row past the last step
            # (ending there would lose it); a further flush step offers it
            peeks = [bool(h.get("peek")) for h in res.stats["headers"]]
            if phase == "flush" and plan.carried.size == 0 and not any(peeks):
                phase = "done"
            ps = plan.stats
            c["trained"] += ps["trained"]
            c["trained_here"] += sum(len(b["sample_ids"]) for b in res.microbatches)
            c["skipped"] += ps["skipped"]
            c["skipped_ids"] = (c["skipped_ids"] + plan.offers.sample_id[plan.skipped].tolist()
                                )[:_MAX_IDS]
            c["unplanned"] += ps["unplanned"]
            c["unplanned_ids"] = (c["unplanned_ids"] +
                                  plan.offers.sample_id[plan.unplanned].tolist())[:_MAX_IDS]
            c["pinned"] += ps["pinned"]
            c["carry_bound_exceeded"] += ps["carry_bound_exceeded"]
            c["max_age"] = max(c["max_age"], ps["max_age"])
            c["steps"] += 1 if plan.microbatches else 0
            h_ids, h_ages, h_cols = bal.held
            pending = {"version": STATE_VERSION, "epoch": self.epoch, "step": bal.step_index,
                       "position": bal.position, "source": snapshot,
                       "held": None if h_cols is None else {
                           "ids": h_ids.tolist(), "ages": h_ages.tolist(),
                           "lengths": h_cols.lengths.tolist(),
                           "tokens": h_cols.token[TOKENS].clone(),
                           **({"fields": {f: h_cols.token[f].clone() for f in self._fields}}
                              if self._fields else {})},
                       "next_local": next_local, "active": lay.dp - sum(flags), "peek": peek,
                       "exhausted": exhausted, "phase": phase, "counters": c}
            self.last_step = {k: v for k, v in res.stats.items() if k != "headers"}
            self.last_plan = plan
            mbs, skip = res.microbatches, self._mb
            if skip and skip >= len(mbs):  # a corrupted state: replaying the step would loop
                bal.fail(ValueError(
                    f"{CHECKPOINT}: mb {skip} but step {st['step']} has {len(mbs)} microbatches "
                    f"on rank {bal.rank} (a corrupted state, or one of another run)"))
            if phase == "done":
                _log_pass(self.epoch, bal.rank, world, c)
            if not mbs:
                self._start, self._mb = pending, 0
                continue
            for j, mb in enumerate(mbs):
                if j < skip:
                    continue
                if j + 1 == len(mbs):
                    self._start, self._mb = pending, 0
                else:
                    self._mb = j + 1
                yield mb


def in_worker() -> None:
    """A ValueError when called in a DataLoader worker process: the stream's collectives (and
    its share of the source) belong to the training process; each worker would otherwise read
    the whole stream (every sample trained once per worker) or see a world of one rank."""
    from torch.utils.data import get_worker_info
    info = get_worker_info()
    if info is not None:
        raise ValueError(
            f"StreamingPackedDataset is iterated in DataLoader worker {info.id} of "
            f"{info.num_workers}: iterate it in the training process (num_workers=0), where its "
            f"step's collectives run; to read the source with workers pass "
            f"StatefulDataLoader(source, batch_size=None, num_workers=k) as its source")


def _keep(headers) -> int:
    """Samples a step must carry so that the next one can give every rank one: the ranks that
    hold a row read ahead offer it next step (a rank still reading always does); when some but
    fewer than all do, the others' share is carried (else a last row read ahead could be left
    alone in a step of its own, untrained: issue 29 item 3)."""
    ahead = sum(bool(h.get("peek")) for h in headers)
    return len(headers) - ahead if 0 < ahead < len(headers) else 0


def _log_pass(epoch: int, rank: int, world: int, c: dict) -> None:
    """The end of a pass, one line per rank: what was read here and where every sample went
    (trained, or counted: empty, skipped, unplanned -- with the first ids); a warning when a
    sample was not trained."""
    lost = c["unplanned"] + c["skipped"]
    seen = c["trained"] + lost
    msg = (f"stream epoch {epoch} done on rank {rank} of {world}: read {c['read']} rows here "
           f"({c['empty']} empty), trained {c['trained_here']} here; all ranks: trained "
           f"{c['trained']} of the {seen} samples read in {c['steps']} steps")
    if c["skipped"]:
        msg += f", skipped (over the capacity) {c['skipped']}: ids {c['skipped_ids'][:10]}"
    if c["unplanned"]:
        msg += (f", unplanned {c['unplanned']} (too few left at the end to give every rank "
                f"one): ids {c['unplanned_ids'][:10]} (stats['unplanned_ids'] lists them)")
    log.log(logging.WARNING if lost else logging.INFO, msg)


def check_state(state) -> None:
    """A ValueError naming the checkpoint and the key when ``state`` cannot be a stream state of
    :meth:`StreamingPackedDataset.state_dict` (missing keys, negative counts, an unknown
    phase, another version)."""
    if not isinstance(state, dict):
        raise ValueError(f"{CHECKPOINT}: load_state_dict takes the dict of state_dict(), got "
                         f"{type(state).__name__}")
    if state.get("version") != STATE_VERSION:
        raise ValueError(f"{CHECKPOINT}: version {state.get('version')!r} is not {STATE_VERSION}")
    need = _COUNTS + ("world_size", "source", "held", "exhausted", "phase", "counters")
    missing = [k for k in need if k not in state]
    if missing:
        raise ValueError(f"{CHECKPOINT}: no {', '.join(map(repr, missing))} (a corrupted state, "
                         f"or not a StreamingPackedDataset's)")

    def count(key, value, low=0):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{CHECKPOINT}: {key} {value!r} must be an integer >= {low}")
    for k in _COUNTS:
        count(k, state[k])
    count("world_size", state["world_size"], 1)
    if state["phase"] not in _PHASES:
        raise ValueError(f"{CHECKPOINT}: phase {state['phase']!r} is not one of {_PHASES}")
    src = state["source"]
    if not isinstance(src, dict):
        raise ValueError(f"{CHECKPOINT}: source {type(src).__name__} is not the source's state")
    if "consumed" in src:
        count("source consumed", src["consumed"])
    if not isinstance(state["counters"], dict):
        raise ValueError(f"{CHECKPOINT}: counters {type(state['counters']).__name__} is not a "
                         f"dict")
    held = state["held"]
    if held is not None:
        keys = ("ids", "ages", "lengths", "tokens")
        if not isinstance(held, dict) or any(k not in held for k in keys):
            raise ValueError(f"{CHECKPOINT}: held must be None or a dict of {keys}")
        if not len(held["ids"]) == len(held["ages"]) == len(held["lengths"]):
            raise ValueError(f"{CHECKPOINT}: held has {len(held['ids'])} ids, "
                             f"{len(held['ages'])} ages and {len(held['lengths'])} lengths")
