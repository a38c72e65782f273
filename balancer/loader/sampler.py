"""The DataLoader drop-in's batch sampler: this rank's microbatches of the shared plan, step by
step, resumable exactly at any point (mid-epoch, between epochs, with workers reading ahead).

``PackedBatchSampler`` is a ``Sampler[list[int]]`` for
``DataLoader(PackedDataset(ds), batch_sampler=sampler, collate_fn=PackedCollator())``. Every
element it yields is a :class:`MicrobatchRef`: a ``list`` of the microbatch's sample ids (so it
honours the ``batch_sampler`` contract) that also carries, as attributes, what the list cannot
say: the token range of every document (chunk pieces of over-long samples are
``tokens[start:start + length]``), the step, the loss-token counts and the CP coordinates. The
DataLoader passes the yielded object untouched (pickled, with its attributes, to workers) to
``dataset.__getitems__``, which is how :class:`balancer.loader.collate.PackedDataset` sees the slicing.

The plan is built (or loaded) once per epoch in the process that owns the sampler; workers only
fetch and collate, so packers never run per worker. ``__len__`` is this rank's exact microbatch
count for the current epoch and needs no collective: every rank builds the same plan from the
same inputs (``plan_fingerprint``).

Rank coordinates follow Megatron's default order (tensor-parallel fastest, then CP, then DP,
then PP): ``rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))``. All CP and PP
ranks of one DP replica receive the same microbatches; the collator cuts the CP shard.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Union

import numpy as np
from torch.utils.data import Sampler

from .columns import LossTokens, as_loss_tokens
from .cursor import EpochCursor, epoch_number
from .replan import Replanning
from .refs import MicrobatchRef
from ..config import Layout, PlannerConfig
from ..cost.model import CostModel
from ..planning.plan import Items, Plan
from ..samples import SampleTable
from ..world import World

STATE_VERSION = 1
PlanSource = Union[Plan, Callable[[int], Plan]]


def rank_coordinates(rank: int, layout: Layout, tp: int = 1) -> dict:
    """(tp, cp, dp, pp) ranks of a global rank in Megatron's default order."""
    world = tp * layout.cp * layout.dp * layout.pp
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside 0..{world - 1} (tp={tp} x cp={layout.cp} x "
                         f"dp={layout.dp} x pp={layout.pp})")
    r = rank // tp
    return {"tp_rank": rank % tp, "cp_rank": r % layout.cp,
            "dp_rank": (r // layout.cp) % layout.dp, "pp_rank": r // (layout.cp * layout.dp)}


def mb_loss_tokens(plan, sample_len: np.ndarray, loss_tokens: Optional[LossTokens]) -> np.ndarray:
    """Loss targets (int64[M]) of every microbatch of ``plan``: each document's length minus 1,
    or the trained tokens ``loss_tokens`` counts."""
    if loss_tokens is None:
        per_entry = plan.entry_length - 1  # every document's first token has no label
    else:
        if len(loss_tokens) != plan.n_samples:
            raise ValueError(f"loss_tokens covers {len(loss_tokens)} samples but the plan "
                             f"{plan.n_samples} (counts of another dataset?)")
        per_entry = loss_tokens.entries(plan.entry_sample, plan.entry_start, plan.entry_length,
                                        sample_len)
    csum = np.zeros(per_entry.shape[0] + 1, np.int64)
    np.cumsum(per_entry, out=csum[1:])
    return csum[plan.mb_offsets[1:]] - csum[plan.mb_offsets[:-1]]


def _whole(name: str, v) -> int:
    """A rank (or count) as an int; a ValueError naming it when it is not a whole number (0.5
    and True were served as ranks before)."""
    ok = not isinstance(v, (bool, np.bool_)) and isinstance(v, (int, float, np.integer,
                                                                np.floating))
    if not (ok and math.isfinite(v) and float(v).is_integer()):
        raise ValueError(f"{name} {v!r} is not an integer")
    return int(v)


class PackedBatchSampler(Replanning, Sampler):
    """Yields this rank's :class:`MicrobatchRef` s of the plan, step by step.

    Give either ``samples`` + ``cost`` + ``layout`` (+ ``config``) to plan each epoch in memory
    with :func:`balancer.plan_epoch` (carrying the tail between epochs when
    ``config.tail == 'carry'``), or ``plan=``: a prebuilt :class:`Plan` (one epoch) or a callable
    ``epoch -> Plan``, or ``plan_dir=``: a precomputed plan store (``python -m balancer
    precompute``), checked against ``layout``/``samples`` when they are given; ``verify_plan``:
    ``"once"`` (the first process to open an epoch hashes its arrays and checks them, the others
    trust its stamp: :mod:`balancer.store.verified`), ``True`` (every process), ``False``. Ranks default from the initialised process
    group (see the module docstring); ``num_replicas``/``rank`` follow ``DistributedSampler``
    and mean the DP size and DP rank. ``seed`` overrides ``config.seed``.

    ``loss_tokens``: the dataset's trained-token counts when only some tokens are trained (a
    labels or loss-mask column): ``PackedDataset(...).loss_tokens()``, a
    :class:`balancer.loader.columns.LossTokens`, or int64[n_samples] per-sample counts (then no
    sample may be cut into pieces). None: every token after a document's first is trained.
    ``step_loss_tokens`` and the refs' ``loss_tokens`` count these.
    """

    def __init__(self, samples: Optional[SampleTable] = None, cost: Optional[CostModel] = None,
                 layout: Optional[Layout] = None, config: Optional[PlannerConfig] = None, *,
                 plan: Optional[PlanSource] = None, num_replicas: Optional[int] = None,
                 rank: Optional[int] = None, dp_rank: Optional[int] = None,
                 cp_rank: Optional[int] = None, pp_rank: Optional[int] = None, tp: int = 1,
                 seed: Optional[int] = None, epoch: int = 0, plan_dir=None,
                 verify_plan="once", loss_tokens=None):
        if samples is not None and not hasattr(samples, "fingerprint"):
            samples = SampleTable(samples)  # lengths as a list or array: the one validation
        if plan_dir is not None:
            if plan is not None:
                raise ValueError("give plan= or plan_dir=, not both")
            from ..store import plan_store as store
            # the manifest is checked against the running job (layout, dataset, sample count,
            # format version) before anything is loaded; a mismatch names the value
            plan = store.plan_source(
                plan_dir, layout=layout,
                dataset_fingerprint=samples.fingerprint() if samples is not None else None,
                n_samples=len(samples) if samples is not None else None, verify=verify_plan)
        if plan is None and (samples is None or cost is None or layout is None):
            raise ValueError("give samples, cost and layout (to plan in memory), plan= or "
                             "plan_dir=")
        self.samples, self.cost = samples, cost
        self.loss_tokens = as_loss_tokens(loss_tokens)
        config = config or PlannerConfig()
        if seed is not None:
            config = config.model_copy(update={"seed": int(seed)})
        self.config = config
        self._source = plan
        if plan is not None:  # a prebuilt plan or a plan source: its config is the truth
            first = plan if isinstance(plan, Plan) else plan(epoch)
            if seed is not None and first.config.seed != seed:
                raise ValueError(f"seed {seed} differs from the plan's seed {first.config.seed}")
            self.config = first.config
            self._first = first
            layout = layout or first.layout
        if layout is not None and getattr(layout, "cp_mode", "fixed") == "hybrid":
            raise ValueError("layout cp_mode='hybrid': PackedBatchSampler serves fixed CP; use "
                             "balancer.loader.hybrid.HybridBatchSampler and HybridCollator")
        self.layout = layout
        self._set_ranks(num_replicas, rank, dp_rank, cp_rank, pp_rank, tp)
        self._carry: dict[int, Optional[Items]] = {0: None}
        self._plan: Optional[Plan] = None
        # the closed loop's refit models: (epoch, first window, model), in the order applied;
        # window w of epoch e is planned with the last one at or before (e, w) (:meth:`refit`)
        self._refits: list[tuple[int, int, CostModel]] = []
        self._window_steps: Optional[np.ndarray] = None
        # where the epoch stands, passes and the read-ahead guard: the loader's one contract
        self.cursor = EpochCursor(epoch_number(epoch, "PackedBatchSampler(epoch=...)"),
                                  self._epoch_length, "microbatch")

    @property
    def epoch(self) -> int:
        """The selected epoch (:meth:`set_epoch`)."""
        return self.cursor.epoch

    @property
    def _position(self) -> int:  # microbatches of the epoch handed out (kept for integrations)
        return self.cursor.position

    @_position.setter
    def _position(self, value: int) -> None:
        self.cursor.position = self.cursor.next = int(value)

    def _epoch_length(self, epoch: int) -> int:
        assert epoch == self.cursor.epoch
        return int(self.plan.step_mbs.sum())

    # ---- ranks ----------------------------------------------------------------------------
    def _set_ranks(self, num_replicas, rank, dp_rank, cp_rank, pp_rank, tp):
        lay = self.layout
        num_replicas, rank, dp_rank, cp_rank, pp_rank, tp = (
            None if v is None else _whole(name, v) for name, v in (
                ("num_replicas", num_replicas), ("rank", rank), ("dp_rank", dp_rank),
                ("cp_rank", cp_rank), ("pp_rank", pp_rank), ("tp", tp)))
        if num_replicas is not None and num_replicas != lay.dp:
            raise ValueError(f"num_replicas {num_replicas} differs from the layout's dp {lay.dp}")
        if num_replicas is not None and rank is not None:  # DistributedSampler convention
            coords = {"dp_rank": rank, "cp_rank": 0, "pp_rank": 0}
        elif rank is not None:
            coords = rank_coordinates(rank, lay, tp)
        elif dp_rank is not None:
            coords = {"dp_rank": dp_rank, "cp_rank": cp_rank or 0, "pp_rank": pp_rank or 0}
        else:
            what = f"tp={tp} x cp={lay.cp} x dp={lay.dp} x pp={lay.pp}"
            rank = World.current().rank_in(tp * lay.cp * lay.dp * lay.pp, what,
                                           "dp_rank= (and cp_rank=, pp_rank=) or rank=",
                                           data_ranks=lay.cp * lay.dp * lay.pp)
            coords = rank_coordinates(rank, lay, tp)
        for name, size in (("dp_rank", lay.dp), ("cp_rank", lay.cp), ("pp_rank", lay.pp)):
            v = coords.get(name, 0)
            if not 0 <= v < size:
                raise ValueError(f"{name} {v} is outside 0..{size - 1}")
        self.dp_rank, self.cp_rank, self.pp_rank = coords["dp_rank"], coords["cp_rank"], \
            coords["pp_rank"]

    # ---- plans ----------------------------------------------------------------------------
    def _build(self, epoch: int) -> Plan:
        src = self._source
        if isinstance(src, Plan):
            if src.epoch != epoch:
                raise ValueError(f"the sampler holds the plan of epoch {src.epoch} only; "
                                 f"give plan=callable to train epoch {epoch}")
            plan = src
        elif src is not None:
            first, self._first = getattr(self, "_first", None), None  # the probe, used once
            plan = first if first is not None and first.epoch == epoch else src(epoch)
            if plan.epoch != epoch:
                raise ValueError(f"plan source returned epoch {plan.epoch} for epoch {epoch}")
        else:
            known = max(e for e in self._carry if e <= epoch)
            plan = None
            # the planner (numba) only when planning here
            from ..planning.planner import plan_epoch_windows
            for e in range(known, epoch + 1):  # thread the carried tail up to this epoch
                plan, self._window_steps = plan_epoch_windows(
                    self.samples, self._window_cost(e), self.layout, self.config, e,
                    self._carry[e])
                self._carry[e + 1] = plan.leftover if self.config.tail == "carry" else None
        if plan.layout != self.layout:
            raise ValueError(f"plan layout {plan.layout} differs from the sampler's {self.layout}")
        if self.samples is not None and plan.dataset_fingerprint != self.samples.fingerprint():
            raise ValueError(f"plan was made for dataset {plan.dataset_fingerprint}, the sampler "
                             f"has {self.samples.fingerprint()}")
        return plan

    @property
    def plan(self) -> Plan:
        """The current epoch's plan (built on first use, in this process)."""
        if self._plan is None or self._plan.epoch != self.epoch:
            self._plan = self._build(self.epoch)
            self._index_plan(self._plan)
        return self._plan

    def _index_plan(self, plan: Plan) -> None:
        """Per-microbatch and per-step arrays the iterator reads (vectorised, built once)."""
        if self.samples is not None:
            self._sample_len = self.samples.lengths
        else:  # a given plan: a sample's planned length is where its last piece ends
            total = np.zeros(plan.n_samples, np.int64)
            np.maximum.at(total, plan.entry_sample, plan.entry_start + plan.entry_length)
            lo = plan.leftover
            if len(lo):
                np.maximum.at(total, lo.sample, lo.start + lo.length)
            self._sample_len = total
        self._mb_loss = mb_loss_tokens(plan, self._sample_len, self.loss_tokens)
        so = plan.step_offsets
        self._step_loss = np.add.reduceat(self._mb_loss, so[:-1]) if plan.n_steps else \
            np.zeros(0, np.int64)
        # this rank's microbatch ids in order: step s holds step_mbs[s] of them
        m = plan.step_mbs
        step = np.repeat(np.arange(plan.n_steps), m)
        first = np.cumsum(m) - m
        slot = np.arange(int(m.sum())) - np.repeat(first, m)
        self._my_step, self._my_slot = step, slot
        self._my_mb = so[step] + self.dp_rank * m[step] + slot
        self._fingerprint = None  # hashing every array takes ~0.6 s at 10M samples: on demand

    @property
    def plan_fingerprint(self) -> str:
        """The current plan's fingerprint (equal on every rank)."""
        plan = self.plan
        if self._fingerprint is None:
            self._fingerprint = plan.fingerprint()
        return self._fingerprint

    def step_loss_tokens(self, step: int) -> int:
        """Loss tokens of ``step`` over every DP rank and microbatch (from the plan)."""
        self.plan
        return int(self._step_loss[step])

    # ---- Sampler protocol -----------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to iterate. A different epoch starts at its first microbatch. The
        current one keeps its position: a restored checkpoint resumes there, and an epoch whose
        microbatches have all been handed out stays finished (a pass yields nothing) until
        another epoch is selected, so a checkpoint taken after an epoch's loop resumes exactly
        whether the trainer saved that epoch or the next as its counter.

        After a restore, moving to another epoch before iterating the restored one is an error
        when that epoch is unfinished (its remaining microbatches would be skipped) or when the
        move goes back. A ``set_epoch`` made before a StatefulDataLoader restores the sampler
        (it does so lazily, at ``iter(loader)``) is applied after the restore
        (:mod:`balancer.loader.cursor`)."""
        self.cursor.set_epoch(epoch)

    def __len__(self) -> int:
        return int(self.plan.step_mbs.sum())

    def ref(self, position: int) -> MicrobatchRef:
        """The ``position``-th microbatch of this rank in the current epoch."""
        plan = self.plan
        mb = int(self._my_mb[position])
        lo, hi = int(plan.mb_offsets[mb]), int(plan.mb_offsets[mb + 1])
        step = int(self._my_step[position])
        ids = plan.entry_sample[lo:hi]
        return MicrobatchRef(
            ids.tolist(), starts=plan.entry_start[lo:hi], lengths=plan.entry_length[lo:hi],
            sample_lengths=np.asarray(self._sample_len[ids], np.int64), epoch=self.epoch,
            position=position, step=step, slot=int(self._my_slot[position]),
            step_microbatches=int(plan.step_mbs[step]), mb=mb,
            loss_tokens=int(self._mb_loss[mb]), step_loss_tokens=int(self._step_loss[step]),
            cp=self.layout.cp, cp_rank=self.cp_rank, dp_rank=self.dp_rank)

    def __iter__(self):
        """One pass over this rank's microbatches of the epoch from where the sampler stands
        (see :meth:`set_epoch`). A pass that ran to the end makes the next pass start the epoch
        over (as DistributedSampler does without ``set_epoch``); a pass left unfinished (a
        ``break``, an iterator thrown away) does not move where the next pass starts."""
        return self.cursor.iterate(self.ref)

    # ---- resumption -----------------------------------------------------------------------
    def state_dict(self, after: Optional[dict] = None) -> dict:
        """Where to resume: ``{"epoch", "position", ...}``, exact at any point (mid-epoch,
        before or after ``set_epoch``, after an epoch's loop has ended).

        Without ``after``: after the last microbatch this sampler handed out, exact for direct
        iteration, ``num_workers=0`` and torchdata's ``StatefulDataLoader`` (checkpoint with
        ``loader.state_dict()``, which snapshots the sampler as each batch is requested). A
        DataLoader with workers reads ahead of the training loop: once it has taken
        microbatches of the current epoch, ``state_dict()`` without ``after`` is an error
        saying so. Pass ``after=`` the last batch the loop consumed (a collated dict or a
        :class:`MicrobatchRef`; its ``epoch``/``position`` locate it); after ``set_epoch(e + 1)``
        the batch that ended epoch ``e`` gives the start of ``e + 1``."""
        plan = self.plan
        epoch, position = self.cursor.state(after)
        carry = self._carry.get(epoch)
        # the epoch order, only when not the default (states written before it existed match)
        order = {} if self.config.order == "permutation" else {"order": self.config.order}
        return {**order,
            "version": STATE_VERSION, "epoch": epoch, "position": position,
            "plan_fingerprint": self.plan_fingerprint,
            "dataset_fingerprint": plan.dataset_fingerprint, "n_samples": plan.n_samples,
            "layout": self.layout.model_dump(), "seed": self.config.seed,
            "strategy": plan.config.strategy, "cost_model": plan.cost_model,
            "dp_rank": self.dp_rank, "cp_rank": self.cp_rank,
            # the delay queue that crosses epochs: items carried into this epoch
            "carry_in": None if carry is None else {
                "sample": carry.sample.tolist(), "start": carry.start.tolist(),
                "length": carry.length.tolist()},
            # the closed loop's models (refit): the plan is re-made from them on resume
            "refits": [{"epoch": e, "window": w, "model": m.model_dump(mode="json")}
                       for e, w, m in self._refits],
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``; refuses a different layout, seed, dataset or plan. The next
        pass yields the rest of the checkpoint's epoch (nothing when it had ended); see
        :meth:`set_epoch` for moving on."""
        if not isinstance(state, dict):
            raise ValueError(f"load_state_dict takes the dict of state_dict(), got "
                             f"{type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"sampler state version {state.get('version')!r} is not "
                             f"{STATE_VERSION}")
        mine = {"layout": self.layout.model_dump(), "seed": self.config.seed,
                "order": self.config.order}
        if self.samples is not None:
            mine["dataset_fingerprint"] = self.samples.fingerprint()
            mine["n_samples"] = len(self.samples)
        state = {"order": "permutation", **state}  # a state without it: the default order
        _check_state_fields(state, list(mine))
        for key, value in mine.items():
            if state[key] != value:
                raise ValueError(f"cannot resume: the checkpoint's {key} is {state[key]!r} but "
                                 f"this sampler's is {value!r}"
                                 + (_layout_diff(state[key], value) if key == "layout" else ""))
        epoch = int(state["epoch"])
        c = state["carry_in"]
        if self._source is None:  # epoch 0 never has a carry; later ones come from the state
            self._carry = {0: None}
            self._carry[epoch] = None if c is None else Items(
                *(np.asarray(c[k], np.int64) for k in ("sample", "start", "length")))
        refits = [(int(r["epoch"]), int(r["window"]), CostModel.model_validate(r["model"]))
                  for r in state.get("refits", ())]
        self._refits = []
        self._plan = None

        def same_plan():
            if refits and self._source is not None:  # a refit stored plan: planned here now
                self._plan_in_memory()
            self._refits, self._plan = refits, None
            if self.plan_fingerprint != state["plan_fingerprint"]:
                raise ValueError(f"cannot resume: epoch {epoch}'s plan is {self.plan_fingerprint} "
                                 f"here but {state['plan_fingerprint']} in the checkpoint "
                                 f"(different strategy, cost model, config or data, or a "
                                 f"balancer version that plans differently: resume with the "
                                 f"version that wrote the checkpoint, or from a stored plan)")
        self.cursor.restore(epoch, int(state["position"]), same_plan)


def _check_state_fields(state: dict, compared: list) -> None:
    """Refuse a damaged or hand-edited state naming the key, before it is used."""
    missing = [k for k in ("epoch", "position", "plan_fingerprint", "carry_in", *compared)
               if k not in state]
    if missing:
        raise ValueError(f"sampler state: missing {', '.join(map(repr, missing))} (not a "
                         f"state_dict() of PackedBatchSampler?)")
    for k in ("epoch", "position"):
        v = state[k]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"sampler state: {k!r} is {v!r}, expected an integer >= 0")
    c = state["carry_in"]
    if c is not None:
        if not isinstance(c, dict):
            raise ValueError(f"sampler state: 'carry_in' is {type(c).__name__}, expected None "
                             f"or a dict of 'sample', 'start', 'length' lists")
        for k in ("sample", "start", "length"):
            if k not in c:
                raise ValueError(f"sampler state: 'carry_in' has no {k!r} (keys: {sorted(c)})")
        if len({len(c[k]) for k in ("sample", "start", "length")}) != 1:
            raise ValueError(f"sampler state: 'carry_in' lists differ in length (sample "
                             f"{len(c['sample'])}, start {len(c['start'])}, length "
                             f"{len(c['length'])}); they must have the same length")
    refits = state.get("refits", ())
    if not isinstance(refits, (list, tuple)):
        raise ValueError(f"sampler state: 'refits' is {type(refits).__name__}, expected a list")
    for i, r in enumerate(refits):
        for k in ("epoch", "window", "model"):
            if not isinstance(r, dict) or k not in r:
                raise ValueError(f"sampler state: 'refits'[{i}] has no {k!r}")


def _layout_diff(saved, mine) -> str:
    """``" (differs in sync: 'step' in the checkpoint, 'microbatch' here)"``: the layout fields
    that differ, a field left out of a dump (its default) read as the default."""
    if not isinstance(saved, dict):
        return ""
    fields = Layout.model_fields
    get = lambda d, k: d.get(k, fields[k].default if k in fields else None)  # noqa: E731
    diff = [f"{k}: {get(saved, k)!r} in the checkpoint, {get(mine, k)!r} here"
            for k in dict.fromkeys([*saved, *mine]) if get(saved, k) != get(mine, k)]
    return f" (differs in {'; '.join(diff)})" if diff else ""


__all__ = ["MicrobatchRef", "PackedBatchSampler", "epoch_number", "rank_coordinates"]
