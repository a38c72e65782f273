"""Planning multimodal steps: the LLM plan (the text-only planner on interleaved sequence
lengths) plus an encoder rank for every media item, and per-phase metrics.

Modes (:class:`MMConfig.mode`):

* ``home``: plan on LLM costs; every item is encoded on the DP rank whose sample needs it
  (what a plain packer does; the baseline);
* ``joint``: plan on LLM + encoder cost per sample (the encoder runs where the sample's text
  runs), a one-dimensional surrogate of the two-phase objective;
* ``post``: plan on LLM costs, then per step re-partition the step's items over the DP ranks to
  balance encoder work (OrchMLLM's post-balancing: embeddings travel back to the rank whose
  sample needs them, gradients the other way; see :mod:`packing.mm_partition`).

The step is then two phases separated by the embedding exchange: encoders (all items of the
step on their encoder ranks), then the LLM microbatches. Imbalance is reported per phase.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
from pydantic import BaseModel, Field

from packing.mm_partition import post_balance
from packing.pipeline import rank_step_times

from ..config import Layout, PlannerConfig
from .cost import MMCostModel
from .table import AUDIO, KINDS, MultimodalTable
from ..cost.blocks import microbatch_costs
from ..planning.planner import Plan, plan_epoch
from ..zigzag import cp_pad_unit
from ..frozen import FROZEN
from ..stats import summarize

MODES = ("home", "joint", "post")


class MMConfig(BaseModel):
    """Multimodal policy on top of :class:`~balancer.config.PlannerConfig`."""

    model_config = FROZEN
    mode: Literal["home", "joint", "post"] = Field(
        "post", description="how encoder work is placed: home, joint, post (see module doc)")
    over_capacity: Literal["error", "downscale"] = Field(
        "error", description="a sample whose media tokens overflow the LLM capacity, or an item "
                             "over the encoder capacity: raise, or shrink its media grids "
                             "(aspect kept; counted) until it fits")
    slack: float = Field(0.01, ge=0, description="post mode: fraction above a step's encoder "
                                                  "lower bound tolerated to keep items home")
    encoder_capacity: Optional[int] = Field(
        None, gt=0, description="encoder positions per encoder microbatch (one item must fit); "
                                "default from the cost model's memory")


@dataclass
class MMPlan:
    """An LLM :class:`Plan` plus the placement of every planned media item.

    Media arrays (length J, planned items only) are in entry order: step, home rank,
    microbatch, then the sample's own media order. ``media_step_offsets`` (int64[S + 1])
    delimits steps."""

    plan: Plan
    mode: str
    table: MultimodalTable
    media_id: np.ndarray       # int64[J] row in the table's media arrays
    media_step: np.ndarray     # int64[J]
    media_mb: np.ndarray       # int64[J] microbatch (global id) whose sequence holds it
    media_home: np.ndarray     # int64[J] DP rank of that microbatch
    media_rank: np.ndarray     # int64[J] DP rank that encodes it
    media_step_offsets: np.ndarray
    media_fwd: np.ndarray      # float64[J] encoder + projector forward
    media_bwd: np.ndarray
    stats: dict = field(default_factory=dict)

    def step_media(self, step: int) -> slice:
        return slice(int(self.media_step_offsets[step]), int(self.media_step_offsets[step + 1]))

    def encoded_by(self, step: int, rank: int) -> np.ndarray:
        """Indices (into the media arrays) of the items ``rank`` encodes in ``step``, by media
        id: the order of that rank's encoder output."""
        sl = self.step_media(step)
        idx = np.flatnonzero(self.media_rank[sl] == rank) + sl.start
        return idx[np.argsort(self.media_id[idx], kind="stable")]


# --------------------------------------------------------------------------------------------
# capacity policy


def fit_capacity(table: MultimodalTable, cost: MMCostModel, layout: Layout,
                 mm: MMConfig) -> tuple[MultimodalTable, dict]:
    """Apply the over-capacity policy: every media item within the encoder capacity and every
    sample holding media within the LLM capacity (CP padding included)."""
    unit = cp_pad_unit(layout.cp)
    cap = (layout.capacity // unit) * unit
    enc_cap = mm.encoder_capacity or (cost.encoder_capacity(layout.pp) if table.n_media else 0)
    stats = {"media_downscaled": 0, "samples_downscaled": 0}
    grid = table.media_grid.copy()
    pos = table.media_positions
    big = np.flatnonzero(pos > enc_cap) if table.n_media else np.zeros(0, np.int64)
    if big.size:
        j = int(big[0])
        s = int(table.media_sample[j])
        if mm.over_capacity == "error":
            raise ValueError(
                f"sample {s}: {KINDS[table.media_kind[j]]} (media item {j}) has {int(pos[j])} "
                f"encoder positions, over the encoder capacity {enc_cap}; use "
                f"over_capacity='downscale' or smaller images")
        grid[big] = _shrink_many(table, grid[big], table.media_kind[big], enc_cap / pos[big])
        stats["media_downscaled"] += int(big.size)
        table = table.with_grids(grid)
    lengths = table.lengths
    has_media = np.diff(table.media_offsets) > 0
    over = np.flatnonzero(has_media & (lengths > cap))
    if over.size:
        s = int(over[0])
        vt = int(lengths[s] - table.text[s])
        if mm.over_capacity == "error" or table.text[s] >= cap:
            raise ValueError(
                f"sample {s}: {vt} media tokens + {int(table.text[s])} text tokens = "
                f"{int(lengths[s])} exceed the LLM capacity {cap}"
                + ("; use over_capacity='downscale'" if table.text[s] < cap else
                   " (its text alone does)"))
        grid = table.media_grid.copy()
        for s in over:
            sl = table.media_of(int(s))
            for _ in range(64):
                vt = int(table.rules.llm_tokens(table.media_kind[sl], grid[sl]).sum())
                if table.text[s] + vt <= cap:
                    break
                f = (cap - table.text[s]) / vt
                new = np.stack([_shrink(table, grid[j], int(table.media_kind[j]), f * 0.98)
                                for j in range(sl.start, sl.stop)])
                if np.array_equal(new, grid[sl]):
                    raise ValueError(f"sample {int(s)}: its {sl.stop - sl.start} media items "
                                     f"cannot shrink below {vt} tokens to fit the LLM capacity "
                                     f"{cap} beside {int(table.text[s])} text tokens")
                grid[sl] = new
        stats["samples_downscaled"] = int(over.size)
        stats["media_downscaled"] += int(table.media_offsets[over + 1].sum()
                                         - table.media_offsets[over].sum())
        table = table.with_grids(grid)
    return table, stats


def _shrink_many(table, g, kind, factor):
    """:func:`_shrink` of many items at once (int64[k, 3] grids, float64[k] factors)."""
    g = g.copy()
    aud = kind == AUDIO
    step = table.rules.audio.positions_per_token
    g[aud, 2] = np.maximum(step, (g[aud, 2] * factor[aud]).astype(np.int64) // step * step)
    m = table.rules.vision.spatial_merge
    s = np.sqrt(np.maximum(factor[~aud], 0.0))
    for d in (1, 2):
        g[~aud, d] = np.maximum(m, (g[~aud, d] * s).astype(np.int64) // m * m)
    return g


def _shrink(table, g, kind, factor):
    """A media grid scaled to about ``factor`` of its positions (never below one token)."""
    g = g.copy()
    if kind == AUDIO:
        step = table.rules.audio.positions_per_token
        g[2] = max(step, int(g[2] * factor) // step * step)
        return g
    m = table.rules.vision.spatial_merge
    s = np.sqrt(max(factor, 0.0))
    g[1] = max(m, int(g[1] * s) // m * m)
    g[2] = max(m, int(g[2] * s) // m * m)
    return g


# --------------------------------------------------------------------------------------------
# planning


def plan_multimodal(table: MultimodalTable, cost: MMCostModel, layout: Layout,
                    config: Optional[PlannerConfig] = None, mm: Optional[MMConfig] = None,
                    epoch: int = 0) -> MMPlan:
    """Plan one epoch of multimodal samples (see the module docstring for the modes)."""
    config = config or PlannerConfig()
    mm = mm or MMConfig()
    t0 = time.perf_counter()
    table, fit_stats = fit_capacity(table, cost, layout, mm)
    samples = table.to_sample_table()
    mf, mb = cost.table_media_costs(table)
    enc = None
    if mm.mode == "joint" and table.n_media:
        # the planner balances each sample's encoder cost with its first piece (media go with
        # the piece at offset 0, never cut); the plan's microbatch costs stay the LLM's
        enc = np.bincount(table.media_sample, weights=mf + mb, minlength=len(table))
    plan = plan_epoch(samples, cost.llm, layout, config, epoch, sample_extra_cost=enc)
    out = place_media(plan, table, mf, mb, mm)
    out.stats.update(fit_stats)
    out.stats["plan_seconds"] = time.perf_counter() - t0
    plan.stats["plan_seconds"] = out.stats["plan_seconds"]
    return out


def place_media(plan: Plan, table: MultimodalTable, mf: np.ndarray, mb: np.ndarray,
                mm: MMConfig) -> MMPlan:
    """Media items of every planned sample with their step, microbatch, home and encoder rank."""
    lay = plan.layout
    n_mb = plan.n_microbatches
    ent_mb = np.repeat(np.arange(n_mb, dtype=np.int64), np.diff(plan.mb_offsets))
    mb_step, mb_rank = plan.mb_step, plan.mb_rank
    s = plan.entry_sample
    off = table.media_offsets
    cnt = np.where(np.asarray(plan.entry_start) == 0, off[s + 1] - off[s], 0)
    total = int(cnt.sum())
    first = np.zeros(cnt.shape[0], np.int64)
    if cnt.shape[0] > 1:
        np.cumsum(cnt[:-1], out=first[1:])
    media_id = np.repeat(off[s], cnt) + np.arange(total) - np.repeat(first, cnt)
    m_mb = np.repeat(ent_mb, cnt)
    m_step = mb_step[m_mb]
    home = mb_rank[m_mb]
    steps_off = np.zeros(plan.n_steps + 1, np.int64)
    np.cumsum(np.bincount(m_step, minlength=plan.n_steps), out=steps_off[1:])
    f, b = mf[media_id], mb[media_id]
    if mm.mode == "post" and total:
        rank = post_balance(f + b, home, steps_off, lay.dp, mm.slack)
    else:
        rank = home.copy()
    moved = rank != home
    tok = table.media_tokens[media_id]
    stats = {"media_planned": total, "media_moved": int(moved.sum()),
             "media_tokens_moved": int(tok[moved].sum()), "media_tokens": int(tok.sum())}
    return MMPlan(plan, mm.mode, table, media_id, m_step, m_mb, home, rank, steps_off, f, b,
                  stats)


# --------------------------------------------------------------------------------------------
# metrics


def check_media_coverage(mp: MMPlan) -> dict:
    """Every media item is planned exactly once or belongs to a left-over sample."""
    t = mp.table
    seen = np.bincount(mp.media_id, minlength=t.n_media)
    left = np.zeros(len(t), bool)
    left[mp.plan.leftover.sample] = True
    want = np.where(left[t.media_sample], 0, 1)
    return {"media_lost": int((seen < want).sum()), "media_duplicated": int((seen > want).sum())}


def phase_metrics(mp: MMPlan, cost: MMCostModel) -> dict:
    """Per-step arrays per phase: ``{encoder,llm}_rank`` float64[S, dp] (forward + backward per
    DP rank; LLM as 1F1B time when pp > 1), ``{encoder,llm}_lb`` float64[S] (max of total / dp
    and the largest indivisible unit: a media item, a document), and the two-phase step times
    (``step_time``: max encoder + max LLM with the exchange between them in post mode;
    max of the per-rank sums otherwise). ``llm_time``: each rank's LLM time, 1F1B simulated
    with pp > 1, the step's lockstep time on every rank in lockstep (``Layout.lockstep``), else
    ``llm_rank``."""
    plan, lay = mp.plan, mp.plan.layout
    S, dp = plan.n_steps, lay.dp
    enc = np.zeros((S, dp))
    np.add.at(enc, (mp.media_step, mp.media_rank), mp.media_fwd + mp.media_bwd)
    item = mp.media_fwd + mp.media_bwd
    max_item = np.zeros(S)
    np.maximum.at(max_item, mp.media_step, item)
    enc_lb = np.maximum(enc.sum(1) / dp, max_item)
    fwd, bwd = cost.llm.doc_costs(plan.entry_length)
    cf, cb = cost.llm.microbatch_constant
    mb_f, mb_b = microbatch_costs(cost.llm, plan.entry_length, plan.mb_offsets)
    mb_step, mb_rank = plan.mb_step, plan.mb_rank
    llm = np.zeros((S, dp))
    np.add.at(llm, (mb_step, mb_rank), mb_f + mb_b)
    if lay.pp > 1:
        llm_time, _ = rank_step_times(mb_f, mb_b, plan.step_mbs, dp, lay.pp)
    elif lay.lockstep:  # ranks wait for each other after every microbatch: every rank's LLM
        # phase lasts the step's lockstep time (as the text report times it)
        llm_time = np.repeat(plan.lockstep_times(mb_f + mb_b)[:, None], dp, axis=1)
    else:
        llm_time = llm
    ent_step = np.repeat(mb_step, np.diff(plan.mb_offsets))
    max_doc = np.zeros(S)
    np.maximum.at(max_doc, ent_step, fwd + bwd)
    llm_lb = np.maximum(llm.sum(1) / dp, max_doc + cf + cb)
    if mp.mode == "post":
        step_time = enc.max(1) + llm_time.max(1)
    else:
        step_time = (enc + llm_time).max(1)
    both_lb = np.maximum((enc.sum(1) + llm.sum(1)) / dp, np.maximum(enc_lb, llm_lb))
    return {"encoder_rank": enc, "encoder_lb": enc_lb, "llm_rank": llm, "llm_time": llm_time,
            "llm_lb": llm_lb, "step_time": step_time, "step_lb": both_lb}


def _ratio(num, den):
    return np.where(den > 0, num / np.where(den > 0, den, 1.0), 1.0)


def mm_summary(mp: MMPlan, cost: MMCostModel, min_step_fraction: float = 0.5) -> dict:
    """JSON block of one mode: per phase ``dp_imbalance`` (max / mean over ranks per step) and
    ``lower_bound_ratio`` (max / lower bound per step), summarised over the steps that hold at
    least ``min_step_fraction`` of the median step's LLM work (the epoch's final partial steps
    are few and say little about balance); plus whole-step times, traffic and coverage."""
    pm = phase_metrics(mp, cost)
    llm_tot = pm["llm_rank"].sum(1)
    full = llm_tot >= min_step_fraction * np.median(llm_tot) if llm_tot.size else llm_tot > 0
    out = {"mode": mp.mode, "strategy": mp.plan.config.strategy,
           "plan_seconds": float(mp.stats.get("plan_seconds", float("nan"))),
           "steps": mp.plan.n_steps, "steps_measured": int(full.sum())}
    lockstep = mp.plan.layout.lockstep
    for ph, rank_key in (("encoder", "encoder_rank"), ("llm", "llm_rank")):
        r = pm[rank_key][full]
        mean = r.mean(1)
        # in lockstep the LLM phase lasts its lockstep time, not the costliest rank's sum
        top = pm["llm_time"][full].max(1) if ph == "llm" and lockstep else r.max(1)
        out[ph] = {"dp_imbalance": summarize(_ratio(top, mean)),
                   "lower_bound_ratio": summarize(_ratio(r.max(1), pm[f"{ph}_lb"][full])),
                   "total": float(pm[rank_key].sum())}
    out["step"] = {"est_step_time_total": float(pm["step_time"].sum()),
                   "lower_bound_ratio": summarize(_ratio(pm["step_time"][full],
                                                         pm["step_lb"][full]))}
    tok = mp.stats["media_tokens_moved"]
    out["traffic"] = {"media_moved": mp.stats["media_moved"],
                      "media_planned": mp.stats["media_planned"],
                      "media_tokens_moved": tok,
                      "moved_token_fraction": tok / max(mp.stats["media_tokens"], 1)}
    out.update(check_media_coverage(mp))
    out["media_downscaled"] = mp.stats.get("media_downscaled", 0)
    return out


__all__ = ["MMConfig", "MMPlan", "MODES", "check_media_coverage", "fit_capacity", "mm_summary",
           "phase_metrics", "place_media", "plan_multimodal"]
