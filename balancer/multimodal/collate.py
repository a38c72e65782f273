"""Collating multimodal steps: the encoder batch every DP rank encodes, the exchange that sends
each embedding to the rank whose sample needs it, and the packed LLM microbatches with
placeholder tokens where the embeddings go.

A sample's text carries one *marker* token per media item (``MediaTokens``: the k-th image marker
is the k-th image, and so on per kind); collation expands every marker into as many placeholder
tokens (the marker id repeated) as the item has LLM tokens, as Qwen2-VL's ``<|image_pad|>``.

Per step and DP rank (all numpy, computed from the plan alone, no communication):

* :func:`encoder_batch`: ``pixel_values`` float[P, in_dim] of the items this rank encodes
  (rows of each item in its ``(t, h, w)`` patch order), ``grid_thw`` int64[k, 3],
  ``cu_positions`` int32[k + 1], ``media_ids`` int64[k], ``media_kinds`` int8[k],
  ``media_tokens`` int64[k]: the encoder's output has ``sum(media_tokens)`` rows, item after
  item in ``media_ids`` order;
* :func:`step_route`: ``send_rows`` int64[R] (rows of the local encoder output, grouped by
  destination rank, to send), ``send_splits`` int64[dp], ``recv_splits`` int64[dp] (an
  ``all_to_all_single`` with these splits moves the embeddings; autograd moves the gradients
  back), and ``recv_row`` (media id -> first row of the item in the received buffer);
* :func:`collate_microbatch`: :func:`balancer.loader.collate.pack_documents` of the expanded sequences
  plus ``embed_positions`` int64[V] (positions in this rank's (CP shard of the) sequence) and
  ``embed_rows`` int64[V] (rows of the received buffer): ``inputs_embeds[embed_positions] =
  received[embed_rows]``; labels are -100 on placeholders and where the next token is one, and
  where the example's ``labels`` / ``loss_mask`` does not train the text token;
  ``microbatch_loss_tokens`` counts the targets of ``shift_labels`` over every CP rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ..loader.collate import IGNORE, pack_documents
from ..loader.columns import check_length, labels_row, mask_row
from .plan import MMPlan
from .table import AUDIO, IMAGE, KINDS, VIDEO
from ..zigzag import cp_pad_unit


@dataclass(frozen=True)
class MediaTokens:
    """Marker / placeholder token ids per kind."""

    image: int = 151655
    video: int = 151656
    audio: int = 151646

    def of(self, kind: int) -> int:
        return (self.image, self.video, self.audio)[kind]


@dataclass
class MMExample:
    """One sample as the dataset returns it: text ids with one marker per media item, and the
    encoder input of every item (table order: images, videos, audio), float[positions, in_dim].

    What is trained (at most one; default every text token): ``labels`` one per text token
    (token ids, -100 where not trained) or ``loss_mask`` one 0/1 per text token; a marker's
    placeholders are never trained (:mod:`balancer.loader.columns`)."""

    input_ids: np.ndarray
    media: list
    labels: Optional[np.ndarray] = None
    loss_mask: Optional[np.ndarray] = None


def text_labels(ex: MMExample, sample: int) -> np.ndarray:
    """int64 per text token: the token where trained, -100 elsewhere (checked, naming the
    sample)."""
    ids = np.asarray(ex.input_ids, np.int64)
    if ex.labels is not None and ex.loss_mask is not None:
        raise ValueError(f"sample {sample}: give labels or loss_mask, not both")
    for name in ("labels", "loss_mask"):
        v = getattr(ex, name)
        if v is not None:
            check_length(np.asarray(v).reshape(-1), ids.shape[0], sample, name, "input_ids")
    if ex.labels is not None:
        return labels_row(ex.labels, sample, "labels")
    if ex.loss_mask is not None:
        return np.where(mask_row(ex.loss_mask, sample, "loss_mask"), ids, IGNORE)
    return ids


Fetch = Callable[[int], MMExample]


def expand_sample(ex: MMExample, sample: int, kinds: np.ndarray, tokens: np.ndarray,
                  markers: MediaTokens) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, starts)``: the sample's LLM sequence with every marker expanded into its item's
    placeholder tokens, and the position of each item's first placeholder (table order)."""
    ids = np.asarray(ex.input_ids, np.int64)
    k = kinds.shape[0]
    if len(ex.media) != k:
        raise ValueError(f"sample {sample}: the dataset gives {len(ex.media)} media items, the "
                         f"table {k}")
    where = np.full(k, -1, np.int64)  # marker position of every item (table order)
    for kd in (IMAGE, VIDEO, AUDIO):
        items = np.flatnonzero(kinds == kd)
        pos = np.flatnonzero(ids == markers.of(kd))
        if pos.shape[0] != items.shape[0]:
            raise ValueError(f"sample {sample}: {pos.shape[0]} {KINDS[kd]} markers for "
                             f"{items.shape[0]} {KINDS[kd]} items")
        where[items] = pos
    reps = np.ones(ids.shape[0], np.int64)
    reps[where] = tokens
    out = np.repeat(ids, reps)
    cum = np.zeros(ids.shape[0] + 1, np.int64)
    np.cumsum(reps, out=cum[1:])
    return out, cum[where]


def _expanded_labels(ex: MMExample, sample: int, first: np.ndarray, tokens: np.ndarray, n: int,
                     markers: MediaTokens) -> tuple[np.ndarray, np.ndarray]:
    """``(labels, placeholder)``: int64[n] the sample's text labels on its expanded sequence of
    ``n`` tokens, -100 on every placeholder (item ``k``'s ``tokens[k]`` from ``first[k]``), and
    bool[n] where the placeholders are."""
    text = text_labels(ex, sample)
    ids = np.asarray(ex.input_ids, np.int64)
    is_marker = np.isin(ids, [markers.image, markers.video, markers.audio])
    ph = np.zeros(n, bool)
    within = np.arange(int(tokens.sum())) - np.repeat(np.cumsum(tokens) - tokens, tokens)
    ph[np.repeat(first, tokens) + within] = True
    out = np.full(n, IGNORE, np.int64)
    out[~ph] = text[~is_marker]  # every other token is a text token, in order
    return out, ph


def encoder_batch(mp: MMPlan, step: int, rank: int, fetch: Fetch) -> dict:
    """What ``rank`` encodes in ``step`` (see the module docstring)."""
    idx = mp.encoded_by(step, rank)
    t = mp.table
    mids = mp.media_id[idx]
    rows, grids = [], []
    for m in mids.tolist():
        s = int(t.media_sample[m])
        ex = fetch(s)
        x = np.asarray(ex.media[m - int(t.media_offsets[s])])
        want = int(t.media_positions[m])
        if x.shape[0] != want:
            raise ValueError(f"sample {s}: media item {m} has {x.shape[0]} encoder positions, "
                             f"its grid {tuple(t.media_grid[m])} needs {want}")
        rows.append(x)
        grids.append(t.media_grid[m])
    cu = np.zeros(len(rows) + 1, np.int64)
    np.cumsum([r.shape[0] for r in rows], out=cu[1:])
    dim = rows[0].shape[1] if rows else 0
    return {"pixel_values": np.concatenate(rows) if rows else np.zeros((0, dim), np.float32),
            "grid_thw": np.asarray(grids, np.int64).reshape(-1, 3),
            "cu_positions": cu.astype(np.int32), "media_ids": mids,
            "media_kinds": t.media_kind[mids], "media_tokens": t.media_tokens[mids]}


@dataclass
class StepRoute:
    """The embedding exchange of one rank in one step (see the module docstring)."""

    send_rows: np.ndarray
    send_splits: np.ndarray
    recv_splits: np.ndarray
    recv_row: dict


def step_route(mp: MMPlan, step: int, rank: int) -> StepRoute:
    """Rows to send to every rank and where every needed item lands in the received buffer.
    Senders order each destination's rows by media id; the receiver's buffer is grouped by
    source rank, then by media id: both sides derive the same order from the plan."""
    dp = mp.plan.layout.dp
    t = mp.table
    sl = mp.step_media(step)
    ids, home, enc = mp.media_id[sl], mp.media_home[sl], mp.media_rank[sl]
    tok = t.media_tokens[ids]
    # sender side: local encoder output is the items encoded here, by media id
    mine = np.flatnonzero(enc == rank)
    mine = mine[np.argsort(ids[mine], kind="stable")]
    first = np.zeros(mine.shape[0] + 1, np.int64)
    np.cumsum(tok[mine], out=first[1:])
    send_rows, send_splits = [], np.zeros(dp, np.int64)
    for d in range(dp):
        sel = np.flatnonzero(home[mine] == d)
        for j in sel.tolist():
            send_rows.append(np.arange(first[j], first[j + 1]))
        send_splits[d] = int(tok[mine[sel]].sum())
    # receiver side
    need = np.flatnonzero(home == rank)
    need = need[np.lexsort((ids[need], enc[need]))]
    recv_splits = np.bincount(enc[need], weights=tok[need], minlength=dp).astype(np.int64)
    starts = np.zeros(need.shape[0], np.int64)
    if need.shape[0] > 1:
        np.cumsum(tok[need][:-1], out=starts[1:])
    return StepRoute(np.concatenate(send_rows) if send_rows else np.zeros(0, np.int64),
                     send_splits, recv_splits,
                     dict(zip(ids[need].tolist(), starts.tolist())))


def collate_microbatch(mp: MMPlan, mb: int, fetch: Fetch, route: StepRoute,
                       markers: MediaTokens = MediaTokens(), cp_rank: int = 0,
                       pad_token_id: int = 0) -> dict:
    """The packed LLM microbatch ``mb`` (numpy; this CP rank's shard when cp > 1) with the
    placeholder-to-embedding map (see the module docstring)."""
    plan, t = mp.plan, mp.table
    cp = plan.layout.cp
    sl = plan.entries(mb)
    samples = plan.entry_sample[sl]
    starts, lengths = np.asarray(plan.entry_start[sl]), plan.entry_length[sl]
    docs, labels, item_pos, item_ids = [], [], [], []
    trained = 0
    unit = cp_pad_unit(cp)
    offset = 0
    for s, st, ln in zip(samples.tolist(), starts.tolist(), lengths.tolist()):
        ex = fetch(s)
        msl = t.media_of(s)
        ids, first = expand_sample(ex, s, t.media_kind[msl], t.media_tokens[msl], markers)
        full = int(t.text[s]) + int(t.media_tokens[msl].sum())
        if ids.shape[0] != full:
            raise ValueError(
                f"sample {s} has {ids.shape[0]} tokens (media expanded) but the plan was made "
                f"for {full} (dataset and plan disagree: tokens would be "
                f"{'cut off' if ids.shape[0] > full else 'missing'}); re-plan from this "
                f"dataset's lengths, or give the dataset the plan was made from")
        # the text's labels on the expanded sequence (placeholders never trained)
        lab, ph = _expanded_labels(ex, s, first, t.media_tokens[msl], ids.shape[0], markers)
        ids, lab, ph = ids[st:st + ln], lab[st:st + ln], ph[st:st + ln]
        # targets: trained tokens after the first whose previous token is no placeholder (the
        # shift below drops a placeholder's prediction of the next token)
        trained += int(np.count_nonzero((lab[1:] != IGNORE) & ~ph[:-1]))
        if msl.stop > msl.start and st != 0:
            raise ValueError(f"sample {s}: a piece of a sample with media (never cut)")
        docs.append(ids)
        labels.append(lab)
        item_pos.append(first + offset)
        item_ids.append(np.arange(msl.start, msl.stop))
        offset += -(-ln // unit) * unit
    out = pack_documents(docs, cp, cp_rank, None, pad_token_id, labels=labels)
    item_pos = np.concatenate(item_pos) if item_pos else np.zeros(0, np.int64)
    item_ids = np.concatenate(item_ids) if item_ids else np.zeros(0, np.int64)
    tok = t.media_tokens[item_ids]
    within = np.arange(int(tok.sum())) - np.repeat(np.cumsum(tok) - tok, tok)
    pos = np.repeat(item_pos, tok) + within
    missing = [m for m in item_ids.tolist() if m not in route.recv_row]
    if missing:
        raise ValueError(f"media item {missing[0]} of microbatch {mb} is not in this step's "
                         f"route (route of another step or rank?)")
    rows = np.repeat(np.array([route.recv_row[m] for m in item_ids.tolist()], np.int64),
                     tok) + within
    # sequence positions in the padded layout -> positions in this CP shard
    if cp > 1:
        total = int(out["cu_seqlens_padded"][-1])
        inv = np.full(total, -1, np.int64)
        inv[out["cp_index"]] = np.arange(out["cp_index"].shape[0])
        local = inv[pos]
        keep = local >= 0
        pos, rows = local[keep], rows[keep]
    ids = out["input_ids"]
    ph = np.zeros(ids.shape[0], bool)
    ph[pos] = True
    out["labels"] = np.where(ph, IGNORE, out["labels"])
    # the token before a placeholder must not be trained to predict it
    nxt_ph = np.zeros_like(ph)
    if cp == 1:
        nxt_ph[:-1] = ph[1:]
    else:
        full_ph = np.zeros(int(out["cu_seqlens_padded"][-1]), bool)
        full_pos = np.repeat(item_pos, tok) + within
        full_ph[full_pos] = True
        nxt_full = np.zeros_like(full_ph)
        nxt_full[:-1] = full_ph[1:]
        nxt_ph = nxt_full[out["cp_index"]]
    out["shift_labels"] = np.where(ph | nxt_ph, IGNORE, out["shift_labels"])
    out["num_loss_tokens"] = int((out["shift_labels"] != IGNORE).sum())
    out["microbatch_loss_tokens"] = trained  # every CP rank's (placeholders never trained)
    out.update(embed_positions=pos, embed_rows=rows, media_ids=item_ids,
               sample_ids=samples.astype(np.int64), sample_starts=starts.astype(np.int64))
    return out


def exchange_local(encoder_outputs: list, routes: list) -> list:
    """The all-to-all of one step done in one process (``encoder_outputs[r]`` and ``routes[r]``
    for every rank r): returns every rank's received buffer. Works on numpy arrays or torch
    tensors (autograd flows through the indexing)."""
    dp = len(routes)
    outs = []
    for d in range(dp):
        parts = []
        for r in range(dp):
            cut = np.zeros(dp + 1, np.int64)
            np.cumsum(routes[r].send_splits, out=cut[1:])
            rows = routes[r].send_rows[cut[d]:cut[d + 1]]
            parts.append(encoder_outputs[r][rows])
        if hasattr(parts[0], "detach"):
            import torch
            outs.append(torch.cat(parts))
        else:
            outs.append(np.concatenate(parts))
    return outs


def exchange(encoder_output, route: StepRoute, group=None):
    """The exchange across processes: ``all_to_all_single`` (autograd-aware, so the gradient of
    every embedding returns to the rank that encoded it). Single process: a local gather."""
    import torch
    from ..world import World
    rows = torch.from_numpy(route.send_rows).to(encoder_output.device)
    send = encoder_output.index_select(0, rows)
    if not World.current(group).multi:
        return send
    from torch.distributed.nn.functional import all_to_all_single
    out = send.new_empty((int(route.recv_splits.sum()),) + tuple(send.shape[1:]))
    return all_to_all_single(out, send, route.recv_splits.tolist(), route.send_splits.tolist(),
                             group=group)


__all__ = ["MMExample", "MediaTokens", "StepRoute", "collate_microbatch", "encoder_batch",
           "exchange", "exchange_local", "expand_sample", "step_route"]
