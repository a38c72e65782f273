"""The DataLoader drop-in's batch sampler: this rank's microbatches of the shared plan, step by
step, resumable mid-epoch.

``PackedBatchSampler`` is a ``Sampler[list[int]]`` for
``DataLoader(PackedDataset(ds), batch_sampler=sampler, collate_fn=PackedCollator())``. Every
element it yields is a :class:`MicrobatchRef`: a ``list`` of the microbatch's sample ids (so it
honours the ``batch_sampler`` contract) that also carries, as attributes, what the list cannot
say: the token range of every document (chunk pieces of over-long samples are
``tokens[start:start + length]``), the step, the loss-token counts and the CP coordinates. The
DataLoader passes the yielded object untouched (pickled, with its attributes, to workers) to
``dataset.__getitems__``, which is how :class:`balancer.collate.PackedDataset` sees the slicing.

The plan is built (or loaded) once per epoch in the process that owns the sampler; workers only
fetch and collate, so packers never run per worker. ``__len__`` is this rank's exact microbatch
count for the current epoch and needs no collective: every rank builds the same plan from the
same inputs (``plan_fingerprint``).

Rank coordinates follow Megatron's default order (tensor-parallel fastest, then CP, then DP,
then PP): ``rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))``. All CP and PP
ranks of one DP replica receive the same microbatches; the collator cuts the CP shard.
"""
from __future__ import annotations

from typing import Callable, Optional, Union

import numpy as np
from torch.utils.data import Sampler

from .config import Layout, PlannerConfig
from .cost import CostModel
from .planner import Items, Plan, plan_epoch
from .samples import SampleTable

STATE_VERSION = 1
PlanSource = Union[Plan, Callable[[int], Plan]]


class MicrobatchRef(list):
    """Sample ids of one microbatch (``list[int]``) plus its metadata as attributes:

    * ``starts``/``lengths`` (int64[N]): token range of every document inside its sample;
    * ``sample_lengths`` (int64[N]): the planned token count of each document's whole sample
      (the loader refuses a row of another length: the plan would cut or miss tokens);
    * ``epoch``, ``position`` (index among this rank's microbatches of the epoch), ``step``,
      ``slot`` (index inside this rank's step), ``step_microbatches`` (this rank's microbatches
      in the step, equal on every DP rank), ``mb`` (global microbatch id in the plan);
    * ``loss_tokens``: tokens with a label in this microbatch (each document's length minus 1,
      whole CP group); ``step_loss_tokens``: the same summed over every DP rank and microbatch
      of the step (the loss normaliser, from the plan, no collective);
    * ``cp``, ``cp_rank``, ``dp_rank``.
    """

    def __init__(self, samples, **meta):
        super().__init__(samples)
        self.__dict__.update(meta)

    def __repr__(self):
        return (f"MicrobatchRef(epoch={self.epoch}, step={self.step}, slot={self.slot}, "
                f"samples={list.__repr__(self)})")


def rank_coordinates(rank: int, layout: Layout, tp: int = 1) -> dict:
    """(tp, cp, dp, pp) ranks of a global rank in Megatron's default order."""
    world = tp * layout.cp * layout.dp * layout.pp
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside 0..{world - 1} (tp={tp} x cp={layout.cp} x "
                         f"dp={layout.dp} x pp={layout.pp})")
    r = rank // tp
    return {"tp_rank": rank % tp, "cp_rank": r % layout.cp,
            "dp_rank": (r // layout.cp) % layout.dp, "pp_rank": r // (layout.cp * layout.dp)}


class PackedBatchSampler(Sampler):
    """Yields this rank's :class:`MicrobatchRef` s of the plan, step by step.

    Give either ``samples`` + ``cost`` + ``layout`` (+ ``config``) to plan each epoch in memory
    with :func:`balancer.plan_epoch` (carrying the tail between epochs when
    ``config.tail == 'carry'``), or ``plan=``: a prebuilt :class:`Plan` (one epoch) or a callable
    ``epoch -> Plan``, or ``plan_dir=``: a precomputed plan store (``python -m balancer
    precompute``), checked against ``layout``/``samples`` when they are given. Ranks default from the initialised process
    group (see the module docstring); ``num_replicas``/``rank`` follow ``DistributedSampler``
    and mean the DP size and DP rank. ``seed`` overrides ``config.seed``.
    """

    def __init__(self, samples: Optional[SampleTable] = None, cost: Optional[CostModel] = None,
                 layout: Optional[Layout] = None, config: Optional[PlannerConfig] = None, *,
                 plan: Optional[PlanSource] = None, num_replicas: Optional[int] = None,
                 rank: Optional[int] = None, dp_rank: Optional[int] = None,
                 cp_rank: Optional[int] = None, pp_rank: Optional[int] = None, tp: int = 1,
                 seed: Optional[int] = None, epoch: int = 0, plan_dir=None,
                 verify_plan: bool = True):
        if plan_dir is not None:
            if plan is not None:
                raise ValueError("give plan= or plan_dir=, not both")
            from . import store
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
        self.layout = layout
        self._set_ranks(num_replicas, rank, dp_rank, cp_rank, pp_rank, tp)
        self._carry: dict[int, Optional[Items]] = {0: None}
        self._plan: Optional[Plan] = None
        self.epoch = int(epoch)
        self._position = 0
        self._completed = False

    # ---- ranks ----------------------------------------------------------------------------
    def _set_ranks(self, num_replicas, rank, dp_rank, cp_rank, pp_rank, tp):
        lay = self.layout
        if num_replicas is not None and num_replicas != lay.dp:
            raise ValueError(f"num_replicas {num_replicas} differs from the layout's dp {lay.dp}")
        if num_replicas is not None and rank is not None:  # DistributedSampler convention
            coords = {"dp_rank": rank, "cp_rank": 0, "pp_rank": 0}
        elif rank is not None:
            coords = rank_coordinates(rank, lay, tp)
        elif dp_rank is not None:
            coords = {"dp_rank": dp_rank, "cp_rank": cp_rank or 0, "pp_rank": pp_rank or 0}
        else:
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized():
                world = dist.get_world_size()
                expect = tp * lay.cp * lay.dp * lay.pp
                if world != expect:
                    raise ValueError(f"process group has {world} ranks but tp={tp} x cp={lay.cp} "
                                     f"x dp={lay.dp} x pp={lay.pp} = {expect}")
                coords = rank_coordinates(dist.get_rank(), lay, tp)
            else:
                coords = {"dp_rank": 0, "cp_rank": 0, "pp_rank": 0}
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
            for e in range(known, epoch + 1):  # thread the carried tail up to this epoch
                plan = plan_epoch(self.samples, self.cost, self.layout, self.config, e,
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
        counts = np.diff(plan.mb_offsets)
        tokens = plan.mb_tokens()
        self._mb_loss = tokens - counts  # every document's first token has no label
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
        if self.samples is not None:
            self._sample_len = self.samples.lengths
        else:  # a given plan: a sample's planned length is where its last piece ends
            total = np.zeros(plan.n_samples, np.int64)
            np.maximum.at(total, plan.entry_sample, plan.entry_start + plan.entry_length)
            lo = plan.leftover
            if len(lo):
                np.maximum.at(total, lo.sample, lo.start + lo.length)
            self._sample_len = total
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
        """Select the epoch to iterate; a different epoch starts at its first microbatch, the
        current one keeps a restored position."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self._position = 0
        self._completed = False

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
            sample_lengths=np.asarray(self._sample_len[ids], np.int64), epoch=self.epoch, position=position, step=step,
            slot=int(self._my_slot[position]), step_microbatches=int(plan.step_mbs[step]), mb=mb,
            loss_tokens=int(self._mb_loss[mb]), step_loss_tokens=int(self._step_loss[step]),
            cp=self.layout.cp, cp_rank=self.cp_rank, dp_rank=self.dp_rank)

    def __iter__(self):
        n = len(self)
        start = 0 if self._completed else self._position
        self._completed = False
        for pos in range(start, n):
            ref = self.ref(pos)
            self._position = pos + 1  # state_dict() now means "this one was handed out"
            yield ref
        self._completed = True

    # ---- resumption -----------------------------------------------------------------------
    def state_dict(self, after: Optional[dict] = None) -> dict:
        """Where to resume. Without ``after``: after the last microbatch this sampler handed
        out (exact for ``num_workers=0`` and for ``StatefulDataLoader``, which snapshots the
        sampler itself). With workers and a plain DataLoader the sampler runs ahead of the
        trainer, so pass the last batch the trainer consumed (a collated dict or a
        :class:`MicrobatchRef`; its ``epoch``/``position`` locate it)."""
        plan = self.plan
        epoch, position = self.epoch, self._position
        if after is not None:
            get = after.get if isinstance(after, dict) else lambda k: getattr(after, k)
            epoch, position = int(get("epoch")), int(get("position")) + 1
            if epoch != self.epoch:
                raise ValueError(f"batch of epoch {epoch} given, the sampler is at epoch "
                                 f"{self.epoch}")
        carry = self._carry.get(epoch)
        return {
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
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state``; refuses a different layout, seed, dataset or plan."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"sampler state version {state.get('version')!r} is not "
                             f"{STATE_VERSION}")
        mine = {"layout": self.layout.model_dump(), "seed": self.config.seed}
        if self.samples is not None:
            mine["dataset_fingerprint"] = self.samples.fingerprint()
            mine["n_samples"] = len(self.samples)
        for key, value in mine.items():
            if state[key] != value:
                raise ValueError(f"cannot resume: the checkpoint's {key} is {state[key]!r} but "
                                 f"this sampler's is {value!r}")
        epoch = int(state["epoch"])
        c = state["carry_in"]
        if self._source is None:  # epoch 0 never has a carry; later ones come from the state
            self._carry = {0: None}
            self._carry[epoch] = None if c is None else Items(
                *(np.asarray(c[k], np.int64) for k in ("sample", "start", "length")))
        self.epoch, self._plan, self._completed = epoch, None, False
        if self.plan_fingerprint != state["plan_fingerprint"]:
            raise ValueError(f"cannot resume: epoch {epoch}'s plan is {self.plan_fingerprint} here "
                             f"but {state['plan_fingerprint']} in the checkpoint (different "
                             f"strategy, cost model, config or data)")
        position = int(state["position"])
        if not 0 <= position <= len(self):
            raise ValueError(f"cannot resume: position {position} is outside 0..{len(self)}")
        self._position = position
