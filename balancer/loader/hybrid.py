"""The DataLoader drop-in of the hybrid DP x CP mode: per microbatch round,
each rank of the pool gets its whole documents and its zigzag shards of the documents its CP
group shares, with the group (ranks) each shard belongs to.

``DataLoader(PackedDataset(ds), batch_sampler=HybridBatchSampler(...),
collate_fn=HybridCollator())`` yields, on every rank of the pool, exactly the same number of
batches per step (one per round of the plan, :mod:`packing.hybrid_cp`). Pool rank ``p`` of
``P = dp x cp`` (``pp == 1``; the trainer's global rank by default) in round ``r`` belongs to
one aligned group ``[offset, offset + size)`` of that round; the group's items are documents
(or, for ``fixed_cp<c>`` strategies that cut, pieces ``[start, start + length)`` of them),
each either zigzag-sharded over the whole group (every member holds chunks ``i`` and
``2 size - 1 - i`` of it, ``i`` its index in the group, :mod:`balancer.loader.cp_shard`) or whole on
one member. The rank's batch:

* ``whole``: the packed (THD) keys of :func:`balancer.loader.collate.pack_documents` (cp = 1) of the
  documents it holds whole, or None; ``whole_sample_ids``/``whole_sample_starts`` int64[Nw];
* ``shard``: the packed keys of the group's sharded documents, this member's zigzag shard
  (``cp = size``, ``cp_rank = index``: ``cp_index`` locates the shard in the padded group
  microbatch), or None; ``shard_sample_ids``/``shard_sample_starts`` int64[Ns];
* ``group_ranks`` (tuple of pool ranks of the group), ``group_size``, ``group_rank`` (this
  rank's index in it); every member of a group receives the same ``shard_sample_ids``;
* ``whole`` and ``shard`` hold the dataset's ``token_columns`` too; labels follow its labels or
  loss-mask column (:mod:`balancer.loader.columns`);
* ``num_loss_tokens`` (trained tokens this rank holds: whole plus its shard), ``step_loss_tokens``
  (the whole step's over the pool, from the plan: the loss normaliser, no collective),
  ``epoch``, ``step``, ``round`` (index inside the step), ``step_rounds``, ``position``,
  ``last_in_step``.

``HybridBatchSampler.state_dict()`` / ``load_state_dict()`` resume at the next round exactly
(``state_dict(after=batch)`` when DataLoader workers read ahead).

Summing ``token loss / step_loss_tokens`` over every rank and round of a step, and gradients
over the pool, trains every token of every document exactly once per epoch
(``tests/loader/test_hybrid_loader.py`` proves it on 4 gloo ranks).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
import torch
from torch.utils.data import Sampler

from .collate import FetchedMicrobatch, check_loss_tokens, pack_documents
from .cursor import EpochCursor, epoch_number
from .refs import HybridRef
from .columns import as_loss_tokens
from ..config import Layout, PlannerConfig, renamed
from ..cost.cp import CPCostModel
from ..planning.hybrid import default_strategies, hybrid_config, plan_hybrid_epoch
from ..samples import SampleTable
from ..world import World


class HybridBatchSampler(Sampler):
    """Yields this pool rank's :class:`HybridRef` of every round of the epoch's hybrid plan.

    ``layout`` must have ``cp_mode='hybrid'`` (its ``rank_capacity`` must equal the cost
    model's) and ``pp == 1``; the pool is ``dp x cp`` ranks. Each epoch is planned in the
    process that owns the sampler, in the order :func:`balancer.planning.planner.epoch_order` ``(seed,
    epoch)`` gives, cut into global batches of ``batch_tokens`` (default ``dp x cp x
    microbatches x rank_capacity``), each planned by ``strategy`` (default ``hybrid_stream``:
    tall documents move at most ``max_delay`` steps to share tall rounds; ``hybrid``: every
    global batch on its own, the default before; ``megatron_hybrid`` or ``fixed_cp<c>``: a
    fixed CP baseline through the same loader; ``megatron_hybrid`` bounds memory per
    document, as Megatron runs every document of a group as its own forward/backward, so a
    rank's packed batch in a round may hold more than ``rank_capacity`` tokens: a baseline to
    compare, not to train at the memory limit). ``samples`` may be a SampleTable or the
    lengths (list or array). ``rank`` defaults to the process group's rank (the group must be
    the pool: with tensor parallelism, pass ``rank=``); a process started by a launcher with no
    group yet is refused rather than served rank 0. Every rank builds the same plan
    from the same inputs; ``len()`` is the epoch's rounds, equal on every rank.

    ``config`` is a :class:`~balancer.config.PlannerConfig`, as ``PackedBatchSampler`` takes:
    ``strategy``, ``seed``, ``global_batch_tokens``, ``max_delay`` and ``over_length`` are read
    (fields left unset take the hybrid mode's defaults: ``hybrid_stream``, 0, ``dp x cp x
    microbatches x rank_capacity``, 2, ``"error"``; a fixed-mode-only field set is refused);
    the keywords ``strategy``, ``seed``, ``batch_tokens``, ``max_delay``, ``over_length`` set
    the same fields (one that disagrees with the config is an error). Older names, still
    taken: ``model=`` for ``cost``, ``over_limit=`` for ``over_length``.

    ``plan`` trains from plans made ahead of time instead: a plan directory written by
    ``python -m balancer precompute --cp-mode hybrid`` /
    :func:`balancer.store.hybrid.precompute_hybrid` (checked against this sampler's
    layout, cost model, dataset, strategy, seed, batch tokens, delay bound and over-limit
    policy; every epoch's arrays are verified when loaded: ``verify_plan="once"``, by the
    first process to open the epoch, the others trusting its stamp as ``PackedBatchSampler``
    does; ``True``: by every process), or any ``epoch -> HybridPlan`` callable (``item_doc``
    sample ids). The batches are the same as without it.

    ``loss_tokens``: the dataset's trained-token counts when only some tokens are trained, as
    :class:`~balancer.loader.sampler.PackedBatchSampler` takes them (``PackedDataset(...,
    loss_mask_column=...).loss_tokens()``); ``step_loss_tokens`` then counts those, and the
    collator refuses a round whose trained tokens differ from the sampler's count."""

    @renamed(model="cost", over_limit="over_length")
    def __init__(self, samples: SampleTable, cost: CPCostModel, layout: Layout,
                 config: Optional[PlannerConfig] = None, *, strategy: Optional[str] = None,
                 seed: Optional[int] = None, epoch: int = 0, rank: Optional[int] = None,
                 batch_tokens: Optional[int] = None, max_delay: Optional[int] = None,
                 over_length: Optional[str] = None,
                 plan: Optional[Union[str, Path, Callable]] = None, verify_plan="once",
                 loss_tokens=None):
        model, over_limit = cost, over_length
        self.loss_tokens = as_loss_tokens(loss_tokens)
        if not hasattr(samples, "fingerprint"):
            samples = SampleTable(samples)  # lengths as a list or array: the one validation
        if layout.cp_mode != "hybrid":
            raise ValueError(f"HybridBatchSampler needs a layout with cp_mode='hybrid', got "
                             f"{layout.cp_mode!r} (PackedBatchSampler serves fixed CP)")
        if layout.pp != 1:
            raise ValueError(f"HybridBatchSampler plans one pipeline stage: pp {layout.pp} must "
                             f"be 1")
        if layout.rank_capacity != model.rank_capacity:
            raise ValueError(f"layout rank_capacity {layout.rank_capacity} differs from the cost "
                             f"model's {model.rank_capacity}")
        self.samples, self.model, self.layout = samples, model, layout
        self.P = layout.dp * layout.cp
        if rank is None:
            rank = self._process_rank()
        if not 0 <= int(rank) < self.P:
            raise ValueError(f"rank {rank} is outside the pool 0..{self.P - 1} (dp {layout.dp} x "
                             f"cp {layout.cp})")
        self.rank = int(rank)
        named = [strategy, getattr(config, "strategy", None)
                 if "strategy" in getattr(config, "model_fields_set", ()) else None]
        for name in named:
            if name is not None and name not in default_strategies(self.P):
                raise ValueError(f"strategy {name!r} is not a hybrid-mode strategy of a pool "
                                 f"of {self.P} ranks (choose from "
                                 f"{', '.join(sorted(default_strategies(self.P)))})")
        if over_limit not in (None, "error", "chunk"):
            raise ValueError(f"over_length / over_limit must be 'error' or 'chunk', got "
                             f"{over_limit!r}")
        if batch_tokens is not None and not int(batch_tokens) > 0:
            raise ValueError(f"batch_tokens must be a positive number of tokens, got "
                             f"{batch_tokens!r} (None: dp x cp x microbatches x rank_capacity)")
        if max_delay is not None and int(max_delay) < 0:
            raise ValueError(f"max_delay must be >= 0, got {max_delay!r}")
        # one vocabulary with PackedBatchSampler: a PlannerConfig in the hybrid mode's defaults
        self.config = config = hybrid_config(
            config, strategy=strategy, seed=None if seed is None else int(seed),
            global_batch_tokens=batch_tokens, max_delay=None if max_delay is None else
            int(max_delay), over_length=over_limit)
        self.strategy, self.seed, self.max_delay = config.strategy, config.seed, config.max_delay
        self.over_limit = over_limit = config.over_length
        self.cost = cost
        self.batch_tokens = int(config.global_batch_tokens or self.P * layout.microbatches
                                * layout.rank_capacity)
        # where the epoch stands, passes and the read-ahead guard: the loader's one contract
        self.cursor = EpochCursor(epoch_number(epoch, "HybridBatchSampler(epoch=...)"),
                                  lambda e: self.plan.n_rounds, "round")
        self._plan = None
        self._plan_epoch = None
        if isinstance(plan, (str, Path)):
            from ..store.hybrid import hybrid_plan_source
            plan = hybrid_plan_source(plan, layout=layout, cost=cost, samples=samples,
                                      strategy=self.strategy, seed=self.seed,
                                      batch_tokens=self.batch_tokens, max_delay=self.max_delay,
                                      over_limit=over_limit, verify=verify_plan)
        elif plan is not None and not callable(plan):
            raise TypeError(f"plan must be a plan directory or an epoch -> HybridPlan callable, "
                            f"got {type(plan).__name__}")
        self._source = plan

    def _process_rank(self) -> int:
        """This process's rank in the pool from the process group (whose size must be the
        pool's), or 0 for a single process; a launched process without a group is refused."""
        return World.current().rank_in(
            self.P, f"the hybrid pool is dp {self.layout.dp} x cp {self.layout.cp}", "rank=")

    @property
    def epoch(self) -> int:
        """The selected epoch (:meth:`set_epoch`)."""
        return self.cursor.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch to iterate: the contract of
        :meth:`PackedBatchSampler.set_epoch <balancer.loader.sampler.PackedBatchSampler.set_epoch>`
        (:mod:`balancer.loader.cursor`)."""
        self.cursor.set_epoch(epoch)

    @property
    def plan(self):
        """The epoch's :class:`packing.hybrid_cp.HybridPlan` (``item_doc`` are sample ids)."""
        if self._plan_epoch != self.epoch:
            if self._source is not None:
                plan = self._source(self.epoch)
                if plan.n_ranks != self.P:
                    raise ValueError(f"the plan of epoch {self.epoch} is for a pool of "
                                     f"{plan.n_ranks} ranks, this sampler's is {self.P}")
            else:
                plan = plan_hybrid_epoch(self.samples.lengths, self.model, self.P,
                                         self.batch_tokens, strategy=self.strategy,
                                         seed=self.seed, epoch=self.epoch,
                                         max_delay=self.max_delay, over_limit=self.over_limit)
            self._plan, self._plan_epoch = plan, self.epoch
            self._item_loss = self._item_loss_tokens(plan)
            self._step_loss = self._loss_tokens(plan, self._item_loss)
        return self._plan

    def _item_loss_tokens(self, plan) -> np.ndarray:
        """int64[items]: loss targets of every item (its length minus 1, or its trained tokens
        when the sampler has ``loss_tokens``)."""
        if self.loss_tokens is None:
            return plan.item_length - 1
        if len(self.loss_tokens) != len(self.samples):
            raise ValueError(f"loss_tokens covers {len(self.loss_tokens)} samples but the "
                             f"dataset {len(self.samples)} (counts of another dataset?)")
        return self.loss_tokens.entries(plan.item_doc, plan.item_start, plan.item_length,
                                        self.samples.lengths)

    @staticmethod
    def _loss_tokens(plan, item_loss: Optional[np.ndarray] = None) -> np.ndarray:
        """int64[S]: labelled tokens of every step (each item's ``item_loss``, default its
        length minus 1)."""
        g_of = plan.group_of_entry()
        rnd = plan.round_of_group()[g_of]
        step = np.searchsorted(plan.step_rounds, rnd, side="right") - 1
        per = (plan.item_length - 1 if item_loss is None else item_loss)[plan.entry_item]
        # integer sums: float64 bincount weights are exact only below 2**53 tokens
        out = np.zeros(plan.n_steps, np.int64)
        np.add.at(out, step, per)
        return out

    def __len__(self) -> int:
        return self.plan.n_rounds

    def ref(self, rnd: int) -> HybridRef:
        """This rank's items of round ``rnd``."""
        plan = self.plan
        lo, hi = plan.round_groups[rnd], plan.round_groups[rnd + 1]
        g = lo + int(np.searchsorted(plan.group_offset[lo:hi], self.rank, side="right")) - 1
        off, size = int(plan.group_offset[g]), int(plan.group_size[g])
        me = self.rank - off
        ent = slice(int(plan.group_entries[g]), int(plan.group_entries[g + 1]))
        items, owner = plan.entry_item[ent], plan.entry_owner[ent]
        # a group of one holds its items whole (owner 0); a sharded item is every member's
        keep = (owner == -1) | (owner == me)
        sharded = (owner == -1) & (size > 1)
        items, sharded = items[keep], sharded[keep]
        step = int(np.searchsorted(plan.step_rounds, rnd, side="right") - 1)
        docs = plan.item_doc[items]
        return HybridRef(docs.tolist(), starts=plan.item_start[items].copy(),
                         lengths=plan.item_length[items].copy(),
                         sample_lengths=self.samples.lengths[docs].copy(), sharded=sharded,
                         group_offset=off, group_size=size, group_rank=me, epoch=self.epoch,
                         step=step, round=int(rnd - plan.step_rounds[step]),
                         step_rounds=int(plan.step_rounds[step + 1] - plan.step_rounds[step]),
                         position=int(rnd), step_loss_tokens=int(self._step_loss[step]),
                         loss_tokens=int(self._item_loss[items].sum()))

    def __iter__(self):
        """One pass over this rank's rounds of the epoch from where the sampler stands (the
        pass contract of :class:`~balancer.loader.sampler.PackedBatchSampler`)."""
        return self.cursor.iterate(self.ref)

    # ---- checkpoints ------------------------------------------------------------------------
    def state_dict(self, after: Optional[dict] = None) -> dict:
        """Where to resume: after the last round handed out, exact for direct iteration,
        ``num_workers=0`` and a StatefulDataLoader's own ``dl.state_dict()``; with DataLoader
        workers reading ahead, pass ``after=`` the collated batch the training loop last
        finished (without it, mid-epoch, it is an error saying so). A finished epoch stays
        finished until ``set_epoch`` selects the next (the same contract as
        :meth:`PackedBatchSampler.state_dict <balancer.loader.sampler.PackedBatchSampler.state_dict>`)."""
        self.plan
        epoch, pos = self.cursor.state(after)
        return self._state(epoch, pos)

    def _state(self, epoch: int, pos: int) -> dict:
        return {"version": 1, "epoch": epoch, "position": pos, "seed": self.seed,
                "strategy": self.strategy, "layout": self.layout.model_dump(),
                "n_samples": len(self.samples), "dataset": self.samples.fingerprint(),
                "batch_tokens": self.batch_tokens}

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`; a different layout, seed, strategy, budget or
        dataset is an error naming the key and both values."""
        if not isinstance(state, dict):
            raise ValueError(f"load_state_dict takes the dict of state_dict(), got "
                             f"{type(state).__name__}")
        mine = self._state(self.epoch, 0)
        for k in ("version", "seed", "strategy", "layout", "n_samples", "dataset",
                  "batch_tokens"):
            if state.get(k) != mine[k]:
                raise ValueError(f"checkpoint {k} {state.get(k)!r} differs from this sampler's "
                                 f"{mine[k]!r}")
        try:
            epoch, pos = epoch_number(state["epoch"], "load_state_dict"), state["position"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"checkpoint epoch/position unreadable: {e}") from None
        if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)) or pos < 0:
            raise ValueError(f"sampler state: 'position' is {pos!r}, expected an integer >= 0")
        pos = int(pos)
        self.cursor.restore(epoch, pos, lambda: None)


class HybridCollator:
    """``collate_fn`` for :class:`balancer.loader.collate.PackedDataset` batches of a
    :class:`HybridBatchSampler` (keys in the module docstring; torch tensors unless
    ``return_tensors='np'``)."""

    def __init__(self, return_tensors: str = "pt", pad_token_id: int = 0):
        if return_tensors not in ("pt", "np"):
            raise ValueError(f"return_tensors must be 'pt' or 'np', got {return_tensors!r}")
        self.return_tensors, self.pad_token_id = return_tensors, pad_token_id

    def __call__(self, fetched) -> dict:
        if not isinstance(fetched, FetchedMicrobatch) or not isinstance(fetched.ref, HybridRef):
            raise ValueError("HybridCollator needs batches of PackedDataset under a "
                             "HybridBatchSampler")
        ref, docs = fetched.ref, fetched.docs
        ids = np.asarray(list(ref), np.int64)
        sh = np.asarray(ref.sharded, bool)
        out = {"group_ranks": tuple(range(ref.group_offset, ref.group_offset + ref.group_size)),
               "group_size": ref.group_size, "group_rank": ref.group_rank,
               "whole_sample_ids": ids[~sh], "whole_sample_starts": ref.starts[~sh],
               "shard_sample_ids": ids[sh], "shard_sample_starts": ref.starts[sh]}
        kw = fetched.pack_kwargs()

        def part(keep: np.ndarray) -> dict:  # docs, labels and token columns of some items
            pick = np.flatnonzero(keep).tolist()
            lab = kw["labels"]
            return {"docs": [docs[i] for i in pick],
                    "labels": None if lab is None else [lab[i] for i in pick],
                    "columns": {c: [v[i] for i in pick] for c, v in kw["columns"].items()}}
        whole, shard = part(~sh), part(sh)
        out["whole"] = pack_documents(whole.pop("docs"), 1, 0, None, self.pad_token_id,
                                      **whole) if (~sh).any() else None
        out["shard"] = pack_documents(shard.pop("docs"), ref.group_size, ref.group_rank, None,
                                      self.pad_token_id, **shard) if sh.any() else None
        if fetched.labels is not None:
            check_loss_tokens(ref.loss_tokens, sum(
                p["microbatch_loss_tokens"] for p in (out["whole"], out["shard"])
                if p is not None), f"round {ref.position}")
        out["num_loss_tokens"] = sum(p["num_loss_tokens"] for p in (out["whole"], out["shard"])
                                     if p is not None)
        out.update(ref.batch_meta())
        out["last_in_step"] = ref.round == ref.step_rounds - 1
        if self.return_tensors == "pt":
            for k in ("whole", "shard"):
                if out[k] is not None:
                    out[k] = {a: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                              for a, v in out[k].items()}
            for k in ("whole_sample_ids", "whole_sample_starts", "shard_sample_ids",
                      "shard_sample_starts"):
                out[k] = torch.from_numpy(out[k])
        return out


def aligned_groups(n_ranks: int) -> list[tuple[int, ...]]:
    """Every aligned power-of-two block of two or more ranks of a pool, in a fixed order (sizes
    ascending, then offsets): the process groups a hybrid trainer creates up front, the same
    ``new_group`` calls on every rank."""
    out = []
    g = 2
    while g <= n_ranks:
        out += [tuple(range(o, o + g)) for o in range(0, n_ranks - g + 1, g)]
        g *= 2
    return out


__all__ = ["HybridBatchSampler", "HybridCollator", "HybridRef", "aligned_groups"]
