"""The run-time balancer: one step's samples, spread over the DP ranks, in; this rank's packed,
cost-balanced microbatches out; results back to the rank (and order) each sample came from.

Per step (:meth:`RuntimeBalancer.step`), on every rank of the DP group:

1. offer: the samples this rank holds (carried ones first, then the new ones) as ids, lengths
   and ages -> one ``all_gather_object`` (:mod:`~balancer.runtime.gather`);
2. plan: :class:`~balancer.runtime.plan.StepPlanner` on the gathered offers (the same plan on
   every rank, no further communication);
3. move: one ``all_to_all_single`` of the payload bytes (:mod:`~balancer.runtime.exchange`);
4. collate: every microbatch through :class:`balancer.loader.collate.PackedCollator` (the keys the
   offline loader yields), plus ``source_rank``/``source_index`` int64[N] and the payload's other
   fields (per-token ones ``[T, ...]`` in packed order, per-sample ones ``[N, ...]``);
5. carry: samples the plan keeps for later stay on their rank and are offered again next step.

:meth:`StepResult.restore` sends per-sample results (per token ``[T, ...]`` or per document
``[N, ...]`` of every microbatch) back with one more all-to-all (and a tiny all-gather of their
schema), in the order the samples were offered.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import numpy as np
import torch

from ..loader.collate import IGNORE, FetchedMicrobatch, PackedCollator
from ..loader.columns import labels_row, mask_row
from ..config import Layout, PlannerConfig
from ..cost.model import CostModel
from ..loader.refs import MicrobatchRef
from .exchange import all_to_all
from .gather import agree, gather_object, gather_offers, world_of
from .payload import TOKENS, Columns, FieldSpec
from .plan import StepPlan, StepPlanner

#: keys the collator (and this module) write; payload fields may not reuse them
RESERVED = frozenset({
    "labels", "shift_labels", "position_ids", "document_ids", "cu_seqlens", "cu_seqlens_padded",
    "max_seqlen", "max_seqlen_padded", "microbatch_loss_tokens", "num_loss_tokens", "sample_ids",
    "sample_starts", "epoch", "position", "step", "slot", "step_microbatches", "mb",
    "step_loss_tokens", "last_in_step", "cp_index", "cp_owner", "cp_attention", "cp", "cp_rank",
    "source_rank", "source_index"})


#: errors a rank's own input raises before the step's collective: sent to every rank instead
LOCAL_ERRORS = (ValueError, TypeError, KeyError, IndexError)


def raise_refused(headers: list, local: Optional[BaseException] = None) -> None:
    """Raise on every rank when any rank's input was refused (``headers[r]["error"]``): one
    ValueError naming each refusing rank and its message (chained to this rank's own); a
    RuntimeError instead when a rank failed (``headers[r]["failed"]``: its source raised, not
    a refusal of its input), naming each failing rank."""
    bad = [(r, h["error"]) for r, h in enumerate(headers) if h.get("error")]
    if not bad:
        return
    failed = [(r, m) for r, m in bad if headers[r].get("failed")]
    if failed:
        raise RuntimeError("failed on " + "; ".join(f"rank {r}: {m}" for r, m in failed)) \
            from local
    raise ValueError("input refused on " + "; ".join(f"rank {r}: {m}" for r, m in bad)) \
        from local


def integer_ids(ids) -> np.ndarray:
    """``ids`` as int64[n], or a ValueError naming the first that is not an integer (a float
    id was truncated before: 1.5 trained as sample 1)."""
    a = np.asarray(ids).reshape(-1)
    if a.dtype.kind in "iu":
        return a.astype(np.int64)
    bad = np.ones(a.shape[0], bool)
    if a.dtype.kind == "f":
        with np.errstate(invalid="ignore"):
            bad = ~np.isfinite(a) | (a != np.floor(a)) | (np.abs(a) >= 2.0 ** 63)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"ids: sample {i}'s id {a[i].item()!r} is not an integer")
    return a.astype(np.int64)


def fail_step(error: BaseException, group=None, step: int = 0,
              source: Optional[str] = None) -> None:
    """Take part in a step's offer collective with ``error`` instead of samples, then raise on
    every rank (:func:`raise_refused`): a refusal (:data:`LOCAL_ERRORS`) as a ValueError with
    its message, anything else as a RuntimeError with ``source`` and the error's type."""
    refused = isinstance(error, LOCAL_ERRORS)
    # a failure's message may span lines (a traceback's text): one line, so every rank's fits
    msg = str(error) if refused else \
        " ".join(f"{source or 'this rank'} raised {type(error).__name__}: {error}".split())
    hdr = {"step": step, "schema": None, "error": msg or repr(error),
           "failed": not refused}
    _, headers, _ = gather_offers(np.zeros(0, np.int64), np.zeros(0, np.int64),
                                  np.zeros(0, np.int64), hdr, group)
    raise_refused(headers, error)


def _resolve_schema(headers: list, rank: int):
    """The payload schema every rank with samples agrees on (an empty rank adopts it)."""
    known = [(r, h["schema"]) for r, h in enumerate(headers) if h.get("schema") is not None]
    if not known:
        return None
    r0, s0 = known[0]
    for r, s in known[1:]:
        if s != s0:
            raise ValueError(f"ranks send different payload fields: rank {r0} {_fmt(s0)}, rank {r} "
                             f"{_fmt(s)}")
    return s0


def _fmt(schema) -> str:
    return "[" + ", ".join(f"{f.name}:{f.kind}:{str(f.dtype).replace('torch.', '')}"
                           f"{list(f.trailing) if f.trailing else ''}" for f in schema) + "]"


@dataclass
class StepResult:
    """What one step gives this rank: ``plan`` (the step's :class:`StepPlan`, equal on every
    rank), ``microbatches`` (this rank's collated microbatches, ``plan.microbatches`` of them,
    possibly none), ``offered_ids`` int64[n] (what this rank offered, in order: carried first,
    then new), ``unplanned`` (this rank's samples that could not make a step at the end of a
    stream: ids and payload, handed back to the caller), ``stats`` (counts, bytes, seconds)."""

    plan: StepPlan
    rank: int
    microbatches: list
    offered_ids: np.ndarray
    unplanned_ids: np.ndarray
    unplanned: Optional[Columns]
    stats: dict
    _group: object = field(default=None, repr=False)

    def restore(self, outputs: Sequence[Mapping], kinds: Optional[Mapping] = None) -> dict:
        """Send every microbatch's results back to the samples' ranks. ``outputs[j][name]`` is
        a tensor of microbatch j: ``[T, ...]`` (one row per token, packed order) or ``[N, ...]``
        (one row per document); ``kinds[name]`` = ``"token"``/``"sample"`` says which when the
        shape cannot (inferred otherwise). Returns ``name -> list`` aligned with
        ``offered_ids``: ``[length, ...]`` or ``[...]`` per sample, None for a sample not
        trained this step. Every rank of the group must call it (collective)."""
        return restore(self, outputs, kinds)[0]


class RuntimeBalancer:
    """Balances each step's samples over the DP ranks of ``group`` (default: the whole world);
    ``layout.dp`` must equal its size. ``microbatches``/``min_microbatches``/``carry``/
    ``max_carry``/``over_length`` are :class:`StepPlanner`'s policies; ``cp_rank`` selects the CP
    shard the collator cuts (run one balancer per CP rank over its own DP group: every CP rank of
    a replica then gets the same microbatches).

    ``labels_field`` (token ids, -100 where not trained) or ``loss_mask_field`` (0/1) names a
    per-token payload field saying which tokens are trained (at most one): ``labels`` and
    ``shift_labels`` then train those only, and ``num_loss_tokens``, ``microbatch_loss_tokens``
    and ``step_loss_tokens`` count them (each rank counts its offered samples' trained tokens
    and sends the counts with its offers: no further collective). Per-token payload fields
    are packed, padded with 0 and CP-sharded like ``input_ids``."""

    def __init__(self, cost: CostModel, layout: Layout, config: Optional[PlannerConfig] = None,
                 *, group=None, microbatches=None, min_microbatches: int = 1, carry: bool = True,
                 max_carry: Optional[int] = None, over_length: str = "error", cp_rank: int = 0,
                 collator: Optional[PackedCollator] = None, labels_field: Optional[str] = None,
                 loss_mask_field: Optional[str] = None):
        if labels_field is not None and loss_mask_field is not None:
            raise ValueError(f"give labels_field ({labels_field!r}) or loss_mask_field "
                             f"({loss_mask_field!r}), not both: each says what is trained")
        self.labels_field, self.loss_mask_field = labels_field, loss_mask_field
        self._trained_field = labels_field if labels_field is not None else loss_mask_field
        self.rank, world = world_of(group)
        if layout.dp != world:
            raise ValueError(f"layout.dp {layout.dp} differs from the {world} ranks of the group "
                             f"(the balancer runs over the DP group)")
        if not 0 <= cp_rank < layout.cp:
            raise ValueError(f"cp_rank {cp_rank} is outside 0..{layout.cp - 1}")
        self.group, self.layout, self.cp_rank = group, layout, cp_rank
        self.planner = StepPlanner(cost, layout, config, microbatches=microbatches,
                                   min_microbatches=min_microbatches, carry=carry,
                                   max_carry=max_carry, over_length=over_length)
        self.collator = collator or PackedCollator()
        self.step_index = 0
        self.position = 0  # microbatches handed out by this rank so far
        self._held: Optional[Columns] = None
        self._held_ids = np.zeros(0, np.int64)
        self._held_ages = np.zeros(0, np.int64)

    # ---- carried samples (part of a resumable state) --------------------------------------
    @property
    def held(self) -> tuple:
        """(ids int64[c], ages int64[c], Columns or None): samples carried on this rank."""
        return self._held_ids, self._held_ages, self._held

    def set_held(self, ids, ages, cols: Optional[Columns]) -> None:
        self._held_ids = np.asarray(ids, np.int64).reshape(-1)
        self._held_ages = np.asarray(ages, np.int64).reshape(-1)
        self._held = cols if cols is not None and len(cols) else None
        n = 0 if self._held is None else len(self._held)
        if not self._held_ids.shape[0] == self._held_ages.shape[0] == n:
            raise ValueError(f"{self._held_ids.shape[0]} ids, {self._held_ages.shape[0]} ages and "
                             f"{n} carried samples differ")

    # ---- one step ---------------------------------------------------------------------------
    def step(self, samples: Optional[Columns] = None, ids=None, *, final=False, keep=0,
             header: Optional[dict] = None) -> StepResult:
        """Balance this rank's new ``samples`` (with ``ids`` int64[n], default
        ``rank + dp * i``) together with its carried ones, over every rank. ``final``: no
        samples follow (bool), or a function of every rank's ``header`` deciding it (e.g. "every
        stream has ended"). ``keep`` (int, or a function of the headers): samples to carry at
        least, when the next step brings fewer new ones than ranks (:meth:`StepPlanner.plan`).
        Collective: every rank of the group calls it, each with its own samples (possibly
        none)."""
        lay = self.layout
        dp = lay.dp
        try:
            offered, o_ids, o_ages = self._offer(samples, ids)
            trained = self._trained_counts(offered, o_ids)
            error = None
        except LOCAL_ERRORS as e:  # refused on every rank below, no rank left in a collective
            offered, o_ids, o_ages, error = None, np.zeros(0, np.int64), np.zeros(0, np.int64), e
            trained = None
        hdr = dict(header or {})
        hdr.update(step=self.step_index, schema=offered.schema if offered is not None else None,
                   error=None if error is None else (str(error) or repr(error)))
        if trained is not None:
            hdr["trained"] = trained
        o_len = offered.lengths if offered is not None else np.zeros(0, np.int64)
        offers, headers, gstats = gather_offers(o_ids, o_len, o_ages, hdr, self.group)
        raise_refused(headers, error)
        agree(headers, "step", "the step number (resume every rank from the same checkpoint)")
        schema = _resolve_schema(headers, self.rank)
        if schema is not None:
            self._check_schema(schema)
            if offered is None:
                offered = Columns.empty(schema)
        if callable(final):
            final = bool(final(headers))
        if callable(keep):
            keep = int(keep(headers))
        plan = self.planner.plan(offers, final=final, keep=keep)
        me = self.rank
        e_me = plan.entry[plan.rank_entries(me)] if plan.microbatches else np.zeros(0, np.int64)
        src = offers.rank[plan.entry]
        moved = bool((src != plan.entry_rank).any()) if plan.entry.size else False
        xstats = {"bytes_sent": 0, "bytes_received": 0, "seconds": 0.0, "collective": False}
        if plan.entry.size:
            send = [offered.take(offers.index[plan.transfers(me, d)]) for d in range(dp)]
            recv_len = [offers.length[plan.transfers(s, me)] for s in range(dp)]
            received, xstats = all_to_all(send, recv_len, schema, moved, self.group)
            t_c = time.perf_counter()
            microbatches = self._collate(plan, e_me, received, self._gathered_trained(headers))
            t_collate = time.perf_counter() - t_c
        else:
            microbatches, t_collate = [], 0.0
        # carried samples stay here, one step older; unplanned ones go back to the caller
        mine = lambda idx: idx[offers.rank[idx] == me]  # noqa: E731
        c, u = mine(plan.carried), mine(plan.unplanned)
        self.set_held(offers.sample_id[c], offers.age[c] + 1,
                      offered.take(offers.index[c]) if c.size else None)
        self.step_index += 1
        stats = dict(plan.stats, gather=gstats, exchange=xstats, headers=headers,
                     collate_seconds=t_collate)
        return StepResult(plan, me, microbatches, o_ids, offers.sample_id[u],
                          offered.take(offers.index[u]) if u.size else None, stats, self.group)

    def _offer(self, samples, ids):
        """(Columns or None, ids, ages) this rank offers: carried samples first, then new."""
        if samples is not None and len(samples):
            new_ids = np.arange(len(samples), dtype=np.int64) * self.layout.dp + self.rank \
                if ids is None else integer_ids(ids)
            if new_ids.shape[0] != len(samples):
                raise ValueError(f"{new_ids.shape[0]} ids for {len(samples)} samples")
        else:
            samples, new_ids = None, np.zeros(0, np.int64)
        parts = [p for p in (self._held, samples) if p is not None]
        if len(parts) == 2 and parts[0].schema != parts[1].schema:
            raise ValueError(f"new samples carry fields {_fmt(parts[1].schema)}, the carried ones "
                             f"{_fmt(parts[0].schema)}")
        offered = Columns.concat(parts) if parts else None
        return (offered, np.concatenate([self._held_ids, new_ids]),
                np.concatenate([self._held_ages, np.zeros(new_ids.shape[0], np.int64)]))

    def fail(self, error: BaseException, source: Optional[str] = None) -> None:
        """Take part in this step's collective with ``error`` (this rank's input was refused
        before it reached :meth:`step`): every rank raises the same ValueError naming the
        rank, instead of the others waiting in the all-gather. An error that is not a refusal
        (an OSError or RuntimeError of ``source``, e.g. "its stream source") makes every rank
        raise the same RuntimeError naming the rank, the source and the error."""
        fail_step(error, self.group, self.step_index, source)

    def _trained_counts(self, offered, ids) -> Optional[list]:
        """Trained tokens after each offered sample's first (the loss targets), checked; None
        without a labels or mask field."""
        if self._trained_field is None or offered is None:
            return None if self._trained_field is None else []
        if self._trained_field not in offered.token:
            raise ValueError(f"the payload has no per-token field {self._trained_field!r} (what "
                             f"is trained), only {sorted(offered.token)}")
        out = []
        for i in range(len(offered)):
            out.append(int(np.count_nonzero(self._trained(offered, i, int(ids[i]))[1:])))
        return out

    def _trained(self, cols, i: int, sample: int) -> np.ndarray:
        """bool per token of sample ``i`` of ``cols``: trained or not (checked, naming it)."""
        raw = cols.rows(self._trained_field, i).cpu().numpy()
        if self.labels_field is not None:
            return labels_row(raw, sample, self.labels_field) != IGNORE
        return mask_row(raw, sample, self.loss_mask_field)

    @staticmethod
    def _gathered_trained(headers: list) -> Optional[np.ndarray]:
        """int64 per offer (rank-major, as :class:`Offers`): trained tokens after the first."""
        if not any("trained" in h for h in headers):
            return None
        return np.concatenate([np.asarray(h.get("trained") or [], np.int64) for h in headers])

    def _check_schema(self, schema) -> None:
        names = {f.name: f for f in schema}
        if TOKENS not in names or names[TOKENS].kind != "token" or names[TOKENS].trailing != ():
            raise ValueError(f"the payload needs a 1-D per-token field {TOKENS!r}, got {_fmt(schema)}")
        bad = sorted(set(names) & RESERVED)
        if bad:
            raise ValueError(f"payload field(s) {bad} collide with keys the collator writes; "
                             f"rename them")
        f = names.get(self._trained_field) if self._trained_field else None
        if self._trained_field and (f is None or f.kind != "token" or f.trailing != ()):
            raise ValueError(f"the payload needs a 1-D per-token field {self._trained_field!r} "
                             f"(what is trained), got {_fmt(schema)}")

    def _collate(self, plan: StepPlan, e_me: np.ndarray, received: list,
                 trained: Optional[np.ndarray] = None) -> list:
        """This rank's microbatches from the received samples (entry order); ``trained`` int64
        per offer: loss targets when a labels or mask field says what is trained."""
        offers, m = plan.offers, plan.microbatches
        src = offers.rank[e_me]
        # position of every entry among the samples of its source, then in the concatenation
        within = np.zeros(e_me.shape[0], np.int64)
        base = np.zeros(len(received) + 1, np.int64)
        for s, cols in enumerate(received):
            sel = src == s
            within[sel] = np.arange(int(sel.sum()))
            base[s + 1] = base[s] + len(cols)
        allc = Columns.concat(received).take(base[src] + within)
        counts = np.diff(plan.mb_offsets[self.rank * m:(self.rank + 1) * m + 1])
        starts = np.concatenate([[0], np.cumsum(counts)])
        step_loss = plan.step_loss_tokens if trained is None else int(trained[plan.entry].sum())
        out = []
        for j in range(m):
            lo, hi = int(starts[j]), int(starts[j + 1])
            cols = allc.slice(lo, hi)
            ids = offers.sample_id[e_me[lo:hi]]
            toks = cols.token[TOKENS].cpu().numpy()
            cu = cols.offsets
            docs = [toks[cu[i]:cu[i + 1]] for i in range(hi - lo)]
            labels = None
            if trained is not None:
                labels = [np.where(self._trained(cols, i, int(ids[i])), d, IGNORE)
                          for i, d in enumerate(docs)]
            ref = MicrobatchRef(
                ids.tolist(), starts=np.zeros(hi - lo, np.int64), lengths=cols.lengths,
                epoch=0, position=self.position, step=self.step_index, slot=j,
                step_microbatches=m, mb=self.rank * m + j,
                loss_tokens=int((cols.lengths - 1).sum()) if trained is None else
                int(trained[e_me[lo:hi]].sum()), step_loss_tokens=step_loss,
                cp=self.layout.cp, cp_rank=self.cp_rank, dp_rank=self.rank)
            b = self.collator(FetchedMicrobatch(ref, docs, labels))
            as_t = (lambda a: torch.from_numpy(a)) if isinstance(b["input_ids"], torch.Tensor) \
                else (lambda a: a)
            b["source_rank"] = as_t(offers.rank[e_me[lo:hi]].copy())
            b["source_index"] = as_t(offers.index[e_me[lo:hi]].copy())
            for k, v in cols.token.items():
                if k != TOKENS:
                    b[k] = shard_tokens(v, b)
            b.update(cols.sample)
            out.append(b)
            self.position += 1
        return out


def shard_tokens(v: torch.Tensor, batch: dict) -> torch.Tensor:
    """A per-token field ``[T, ...]`` (documents back to back) in the batch's layout: as it is
    with cp == 1, else padded with 0 like ``input_ids`` and cut to this CP rank's shard."""
    if "cp_index" not in batch:
        return v
    as_np = (lambda a: a.numpy()) if isinstance(batch["cu_seqlens"], torch.Tensor) else \
        (lambda a: a)
    cu = np.asarray(as_np(batch["cu_seqlens"]), np.int64)
    cu_pad = np.asarray(as_np(batch["cu_seqlens_padded"]), np.int64)
    lens = np.diff(cu)
    real = np.repeat(cu_pad[:-1] - cu[:-1], lens) + np.arange(int(cu[-1]))
    full = v.new_zeros((int(cu_pad[-1]),) + tuple(v.shape[1:]))
    full[torch.from_numpy(real).to(v.device)] = v
    idx = np.asarray(as_np(batch["cp_index"]), np.int64)
    return full[torch.from_numpy(idx).to(v.device)]


# ---- the way back ------------------------------------------------------------------------------

def _kind(name, t, n_tok, n_doc, given):
    if given:
        if given not in ("token", "sample"):
            raise ValueError(f"kinds[{name!r}] must be 'token' or 'sample', got {given!r}")
        return given
    rows = t.shape[0] if t.dim() else -1
    if rows == n_tok and rows == n_doc:
        return "?"
    if rows == n_tok:
        return "token"
    if rows == n_doc:
        return "sample"
    raise ValueError(f"output {name!r}: {rows} rows, but the microbatch has {n_tok} tokens and "
                     f"{n_doc} documents")


def _output_view(outputs, m, lens, counts, kinds) -> dict:
    """This rank's view of the output schema: name -> (kind, (dtype, trailing), dtype); kind
    '?' where every microbatch has one token per document (inferred from the other ranks)."""
    if len(outputs) != m:
        raise ValueError(f"{len(outputs)} outputs for this rank's {m} microbatches")
    local = {}
    at = 0
    for j, out in enumerate(outputs):
        n_doc = int(counts[j])
        n_tok = int(lens[at:at + n_doc].sum())
        at += n_doc
        if j and set(out) != set(outputs[0]):
            raise ValueError(f"microbatch {j} returns {sorted(out)}, microbatch 0 "
                             f"{sorted(outputs[0])}: every microbatch needs the same outputs")
        for name, t in out.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"output {name!r} of microbatch {j} is not a tensor")
            k = _kind(name, t, n_tok, n_doc, kinds.get(name))
            spec = (str(t.dtype), tuple(t.shape[1:]))
            prev = local.get(name)
            if prev is not None and prev[1] != spec:
                raise ValueError(f"output {name!r}: {prev[1]} in one microbatch, {spec} in another")
            if prev is not None and "?" not in (prev[0], k) and prev[0] != k:
                raise ValueError(f"output {name!r} is per token in one microbatch and per document "
                                 f"in another; give kinds={{{name!r}: ...}}")
            local[name] = (k if prev is None or prev[0] == "?" else prev[0], spec, t.dtype)
    return local


def restore(result: StepResult, outputs: Sequence[Mapping],
            kinds: Optional[Mapping] = None) -> tuple[dict, dict]:
    """See :meth:`StepResult.restore`; also returns every output's :class:`FieldSpec`."""
    plan, me, group = result.plan, result.rank, result._group
    offers, m, dp = plan.offers, plan.microbatches, plan.dp
    kinds = dict(kinds or {})
    if m == 0:  # nothing was trained this step, on any rank (the same on every rank)
        if len(outputs):
            raise ValueError(f"{len(outputs)} outputs for this rank's 0 microbatches")
        return {}, {}
    e_me = plan.entry[plan.rank_entries(me)]
    lens = offers.length[e_me]
    counts = np.diff(plan.mb_offsets[me * m:(me + 1) * m + 1])
    try:
        local, error = _output_view(outputs, m, lens, counts, kinds), None
    except LOCAL_ERRORS as e:  # every rank raises it (below), none waits in the collective
        local, error = {}, e
    gathered = gather_object({"view": {n: v[:2] for n, v in local.items()},
                              "error": None if error is None else (str(error) or repr(error))},
                             group)
    raise_refused(gathered, error)
    views = [g["view"] for g in gathered]
    names = sorted(set().union(*[set(v) for v in views]))
    schema = []
    for name in names:
        seen = [v[name] for v in views if name in v]
        if len(seen) != len(views) or any(s[1] != seen[0][1] for s in seen):
            raise ValueError(f"output {name!r} differs between ranks: " +
                             ", ".join(f"rank {r}: {v.get(name)}" for r, v in enumerate(views)))
        ks = {s[0] for s in seen} - {"?"}
        if len(ks) > 1:
            raise ValueError(f"output {name!r} is per token on some ranks and per document on "
                             f"others; give kinds={{{name!r}: ...}}")
        dtype = getattr(torch, seen[0][1][0].replace("torch.", ""))
        schema.append(FieldSpec(name, dtype, ks.pop() if ks else "token", seen[0][1][1]))
    schema = tuple(sorted([f for f in schema if f.kind == "token"]) +
                   sorted([f for f in schema if f.kind == "sample"]))
    if plan.layout.cp > 1 and any(f.kind == "token" for f in schema):
        raise ValueError("per-token results of CP-sharded microbatches cannot be restored; "
                         "return per-document results or gather the CP shards first")
    tok = {f.name: torch.cat([o[f.name] for o in outputs]) if outputs else
           torch.empty((0, *f.trailing), dtype=f.dtype) for f in schema if f.kind == "token"}
    smp = {f.name: torch.cat([o[f.name] for o in outputs]) if outputs else
           torch.empty((0, *f.trailing), dtype=f.dtype) for f in schema if f.kind == "sample"}
    mine = Columns(lens, tok, smp)
    src = offers.rank[e_me]
    send = [mine.take(np.flatnonzero(src == s)) for s in range(dp)]
    back = [plan.transfers(me, d) for d in range(dp)]
    recv_len = [offers.length[b] for b in back]
    moved = bool((offers.rank[plan.entry] != plan.entry_rank).any()) if plan.entry.size else False
    received, _ = all_to_all(send, recv_len, schema, moved, group)
    n = result.offered_ids.shape[0]
    res = {f.name: [None] * n for f in schema}
    for d, cols in enumerate(received):
        idx = offers.index[back[d]]
        for f in schema:
            for i, li in enumerate(idx.tolist()):
                res[f.name][li] = cols.rows(f.name, i)
    return res, {f.name: f for f in schema}
