"""Fetching and collating packed (THD) microbatches.

``DataLoader(PackedDataset(ds), batch_sampler=PackedBatchSampler(...),
collate_fn=PackedCollator())`` yields one dict per microbatch of this rank. The dataset wrapper
receives the sampler's :class:`~balancer.loader.sampler.MicrobatchRef` in ``__getitems__`` and returns
the documents' token ids already cut to their ``[start, start + length)`` ranges; the collator
turns them into the batch below (torch tensors unless ``return_tensors="np"``).

Keys (T = tokens this rank holds, N = documents in the microbatch):

* ``input_ids`` int64[T]; ``labels`` int64[T]: the token itself where it is trained (every token
  unless the dataset has a labels or loss-mask column: :mod:`balancer.loader.columns`), -100
  elsewhere, at every document start and on padding (Hugging Face convention: the model shifts,
  so a document never predicts the next); ``shift_labels`` int64[T]: the next position's label in
  the same document, -100 at every document's last token and on padding (pre-shifted: what CP
  shards and Megatron-style losses need);
* every ``token_columns`` name of the dataset: its values [T] (dtype kept), 0 on padding;
* ``position_ids`` int64[T] restarting at 0 per document (chunk pieces too); ``document_ids``
  int32[T] (index of the document in the microbatch, -1 on padding);
* ``cu_seqlens`` int32[N + 1] (real lengths), ``cu_seqlens_padded`` int32[N + 1] (offsets in
  the padded layout; equal to ``cu_seqlens`` when cp == 1), ``max_seqlen`` /
  ``max_seqlen_padded`` Python ints: always of the whole microbatch, as flash-attn, Megatron and
  Transformer Engine take them;
* ``sample_ids``/``sample_starts`` int64[N]: which sample, and the piece's token offset in it;
* ``num_loss_tokens`` (int): trained tokens (labels not -100) this rank holds;
  ``microbatch_loss_tokens``: the whole microbatch's; ``step_loss_tokens``: the whole step's over
  all DP ranks and microbatches (normalise the summed token loss by it, then sum gradients over
  DP x CP); with a labels or mask column the sampler needs ``loss_tokens=`` (the collator refuses
  a microbatch whose trained tokens differ from the sampler's count);
* ``epoch``, ``position``, ``step``, ``slot``, ``step_microbatches``, ``mb`` (the plan's
  microbatch id), ``last_in_step`` (bool);
* with cp > 1: ``cp_index`` int64[T] (positions of this shard in the padded microbatch, see
  :mod:`balancer.loader.cp_shard`), ``cp_owner`` int64[N] (-1 zigzag, else the owning rank),
  ``cp_attention`` float64[cp] (causal attention pairs per CP rank), ``cp``, ``cp_rank``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from . import cp_shard
from .columns import (IGNORE, LossTokens, block_targets, check_length, ids_row, labels_row,
                      mask_row, token_row, trained_targets)
from .refs import MicrobatchRef, Ref, check_handed_in_order
from ..cost.model import CostModel



class FlatTokens(torch.utils.data.Dataset):
    """An in-memory token dataset: sample ``i`` is ``tokens[offsets[i]:offsets[i + 1]]``."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray):
        self.tokens, self.offsets = np.asarray(tokens), np.asarray(offsets, np.int64)

    @classmethod
    def from_lengths(cls, lengths, vocab: int = 32000, seed: int = 0) -> "FlatTokens":
        lengths = np.asarray(lengths, np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        rng = np.random.default_rng(seed)
        return cls(rng.integers(0, vocab, int(offsets[-1]), dtype=np.int64), offsets)

    def __len__(self):
        return int(self.offsets.shape[0] - 1)

    def __getitem__(self, i):
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]


@dataclass
class FetchedMicrobatch:
    """What :class:`PackedDataset` hands the collator: the ref and each document's tokens,
    cut to the ref's ranges; ``labels`` (None: every token after a document's first is trained)
    each document's labels, int64, -100 where not trained (from a labels or a loss-mask column);
    ``columns`` the user's per-token columns, name -> one array per document."""

    ref: Any
    docs: list
    labels: Optional[list] = None
    columns: dict = field(default_factory=dict)

    def pack_kwargs(self) -> dict:
        """The per-token inputs of :func:`pack_documents` besides ``docs``."""
        return {"labels": self.labels, "columns": self.columns}


#: batch keys a token column may not take
BATCH_KEYS = frozenset((
    "input_ids", "labels", "shift_labels", "position_ids", "document_ids", "cu_seqlens",
    "cu_seqlens_padded", "max_seqlen", "max_seqlen_padded", "sample_ids", "sample_starts",
    "num_loss_tokens", "microbatch_loss_tokens", "step_loss_tokens", "epoch", "position",
    "step", "slot", "step_microbatches", "mb", "last_in_step", "cp_index", "cp_owner",
    "cp_attention", "cp", "cp_rank", "attention_mask", "loss_mask"))


class PackedDataset(torch.utils.data.Dataset):
    """Wraps a map-style dataset of token ids for the packed loader.

    ``dataset[i]`` may be an array-like of token ids or a mapping holding ``tokens_column``; a
    Hugging Face ``datasets.Dataset`` is read through Arrow in one ``take`` per microbatch.

    What is trained (at most one; default every token after a document's first):
    ``labels_column`` token ids with -100 where not trained (the Hugging Face convention), or
    ``loss_mask_column`` 1 where trained, 0 elsewhere (TRL's ``completion_mask`` or
    ``assistant_masks``). ``token_columns``: more per-token columns (advantages, old
    log-probs, ``token_type_ids``...), each in the batch under its own name, packed, padded and
    CP-sharded like ``input_ids`` (padding 0). See :mod:`balancer.loader.columns`; give the
    sampler :meth:`loss_tokens` so ``step_loss_tokens`` counts the trained tokens."""

    def __init__(self, dataset, tokens_column: str = "input_ids",
                 labels_column: Optional[str] = None, loss_mask_column: Optional[str] = None,
                 token_columns=()):
        if labels_column is not None and loss_mask_column is not None:
            raise ValueError(f"give labels_column ({labels_column!r}) or loss_mask_column "
                             f"({loss_mask_column!r}), not both: each says what is trained")
        if isinstance(token_columns, str):
            raise ValueError(f"token_columns is a list of column names, got the string "
                             f"{token_columns!r} (write token_columns=[{token_columns!r}])")
        token_columns = tuple(token_columns)
        self.dataset, self.tokens_column = dataset, tokens_column
        self.labels_column, self.loss_mask_column = labels_column, loss_mask_column
        self.token_columns = token_columns
        self._trained_column = labels_column if labels_column is not None else loss_mask_column
        mine = [tokens_column] + ([self._trained_column] if self._trained_column else [])
        for c in token_columns:
            if token_columns.count(c) > 1 or c in mine:
                raise ValueError(f"token column {c!r} is named twice (token_columns "
                                 f"{list(token_columns)}, tokens/labels/mask {mine})")
            if c in BATCH_KEYS:
                raise ValueError(f"token column {c!r} would overwrite the batch's own {c!r}: "
                                 f"rename the column (keys taken: {', '.join(sorted(BATCH_KEYS))})")
        self._columns = mine + list(token_columns)
        self._arrow = None
        if hasattr(dataset, "with_format") and hasattr(dataset, "column_names"):
            for c in self._columns:
                if c not in dataset.column_names:
                    raise ValueError(f"dataset has no column {c!r} "
                                     f"(columns: {dataset.column_names})")
            self._arrow = dataset.select_columns(self._columns).with_format("arrow")

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return self._fetch([int(i)])[0]

    def _check_ids(self, ids: list) -> None:
        n = len(self)
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"sample {i} is outside the dataset's 0..{n - 1}")

    def _read(self, ids: list, columns: list) -> list:
        """Per column, the rows of ``ids`` (numpy arrays)."""
        self._check_ids(ids)
        if self._arrow is not None:
            table = self._arrow[ids]
            out = []
            for c in columns:
                col = table[c].combine_chunks()
                values = col.values.to_numpy(zero_copy_only=False)
                offs = col.offsets.to_numpy()
                out.append([values[offs[j]:offs[j + 1]] for j in range(len(ids))])
            return out
        out = [[] for _ in columns]
        for i in ids:
            row = self.dataset[i]
            if isinstance(row, dict):
                for k, c in enumerate(columns):
                    if c not in row:
                        raise ValueError(f"sample {i} has no column {c!r} (its keys: "
                                         f"{sorted(row)})")
                    out[k].append(np.asarray(row[c]))
            elif len(columns) > 1:
                raise ValueError(f"sample {i} is a bare token array, so it has no column "
                                 f"{columns[1]!r}: give rows as mappings of column -> values")
            else:
                out[0].append(np.asarray(row))
        return out

    def _fetch(self, ids: list) -> list:
        return self._read(ids, [self.tokens_column])[0]

    def _labels(self, i: int, tokens: np.ndarray, raw) -> np.ndarray:
        """Sample ``i``'s labels (int64, -100 where not trained), checked."""
        c = self._trained_column
        raw = np.asarray(raw)
        if raw.ndim == 1:
            check_length(raw, tokens.shape[0], i, c, self.tokens_column)
        if self.labels_column is not None:
            return labels_row(raw, i, c)
        return np.where(mask_row(raw, i, c), tokens, IGNORE).astype(np.int64)

    def _trained(self, i: int, raw) -> np.ndarray:
        """Sample ``i``'s per-token trained flags (bool), checked."""
        if self.labels_column is not None:
            return labels_row(raw, i, self._trained_column) != IGNORE
        return mask_row(raw, i, self._trained_column)

    def loss_tokens(self, block: int = 65536) -> Optional[LossTokens]:
        """Trained-token counts for the sampler (``PackedBatchSampler(..., loss_tokens=)``),
        from one pass over the labels or mask column in blocks of ``block`` rows; None without
        such a column (every token after a document's first is trained, as the plan counts)."""
        if self._trained_column is None:
            return None
        n = len(self)
        counts = np.zeros(n, np.int64)
        c = self._trained_column
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            if self._arrow is not None:  # vectorised over the block's flat values
                col = self._arrow[lo:hi][c].combine_chunks()
                counts[lo:hi] = block_targets(col.values.to_numpy(zero_copy_only=False),
                                              col.offsets.to_numpy(),
                                              self.labels_column is not None, c, lo)
                continue
            ids = list(range(lo, hi))
            for i, raw in zip(ids, self._read(ids, [c])[0]):
                counts[i] = trained_targets(self._trained(i, raw))
        return LossTokens(counts, self._piece_loss_tokens)

    def _piece_loss_tokens(self, sample: int, start: int, length: int) -> int:
        raw = self._read([sample], [self._trained_column])[0][0]
        return trained_targets(self._trained(sample, raw)[start:start + length])

    def __getitems__(self, ref) -> FetchedMicrobatch:
        if isinstance(ref, Ref):
            check_handed_in_order(ref)  # a wrapper handing this process every n-th: refused
        ids = list(ref)
        read = self._read(ids, self._columns)
        rows = [ids_row(r, i, self.tokens_column) for i, r in zip(ids, read[0])]
        k = 1
        labels = None
        if self._trained_column is not None:
            labels = [self._labels(i, t, r) for i, t, r in zip(ids, rows, read[1])]
            k = 2
        extra = {}
        for c, col in zip(self.token_columns, read[k:]):
            extra[c] = [token_row(r, i, c) for i, r in zip(ids, col)]
            for i, t, r in zip(ids, rows, extra[c]):
                check_length(r, t.shape[0], i, c, self.tokens_column)
        starts = ref.starts if isinstance(ref, Ref) else None
        if starts is None:  # a plain list of sample ids (or a ref without ranges): whole samples
            return FetchedMicrobatch(ref, rows, labels, extra)
        planned = ref.sample_lengths
        planned = [None] * len(ids) if planned is None else planned.tolist()
        docs, cut = [], []
        for i, row, s, ln, full in zip(ids, rows, starts.tolist(), ref.lengths.tolist(), planned):
            n = int(row.shape[0])
            if (full is not None and n != full) or s + ln > n:
                want = full if full is not None else f"at least {s + ln}"
                lost = "cut off" if full is not None and n > full else "missing"
                raise ValueError(
                    f"sample {i} has {n} tokens but the plan was made for {want} (dataset and "
                    f"plan disagree: tokens would be {lost}); re-plan from this dataset's "
                    f"lengths, or tokenize it to the same lengths the plan was made from")
            docs.append(row[s:s + ln])
            cut.append(slice(s, s + ln))
        if labels is not None:
            labels = [x[sl] for x, sl in zip(labels, cut)]
        extra = {c: [x[sl] for x, sl in zip(v, cut)] for c, v in extra.items()}
        return FetchedMicrobatch(ref, docs, labels, extra)


def _scatter(flat: np.ndarray, total: int, real: Optional[np.ndarray], fill) -> np.ndarray:
    """``flat`` (the documents back to back) in the padded layout (``fill`` on padding)."""
    if real is None:
        return flat
    out = np.full(total, fill, flat.dtype)
    out[real] = flat
    return out


def pack_documents(docs: list, cp: int = 1, cp_rank: int = 0,
                   owner: Optional[np.ndarray] = None, pad_token_id: int = 0,
                   labels: Optional[list] = None, columns: Optional[dict] = None) -> dict:
    """The packed arrays of one microbatch (numpy), this CP rank's shard when cp > 1.

    ``labels`` (one int64 array per document, -100 where not trained; None: every token is)
    decide ``labels``/``shift_labels`` and the loss-token counts; ``columns`` (name -> one array
    per document) are packed, padded with 0 and sharded like ``input_ids``."""
    lens = np.fromiter((d.shape[0] for d in docs), np.int64, len(docs))
    if (lens <= 0).any():
        raise ValueError(f"document {int(np.flatnonzero(lens <= 0)[0])} of the microbatch is empty")
    padded = cp_shard.padded_lengths(lens, cp)
    n, total = lens.shape[0], int(padded.sum())
    cu = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=cu[1:])
    cu_pad = np.zeros(n + 1, np.int64)
    np.cumsum(padded, out=cu_pad[1:])
    real = None if cp == 1 else np.repeat(cu_pad[:-1] - cu[:-1], lens) + np.arange(int(cu[-1]))
    ids = _scatter(np.concatenate(docs).astype(np.int64, copy=False), total, real, pad_token_id)
    if labels is None:
        target = ids
    else:
        if len(labels) != n or any(a.shape[0] != b for a, b in zip(labels, lens.tolist())):
            raise ValueError("labels must hold one array per document, of the document's length")
        target = _scatter(np.concatenate(labels).astype(np.int64, copy=False), total, real,
                          IGNORE)
    doc_start = cu_pad[:-1]
    pos = np.arange(total, dtype=np.int64) - np.repeat(doc_start, padded)
    doc_id = np.repeat(np.arange(n, dtype=np.int32), padded)
    is_pad = pos >= np.repeat(lens, padded)
    lab = target.copy()
    lab[doc_start] = IGNORE
    shift = np.empty_like(target)
    shift[:-1] = target[1:]
    shift[cu_pad[1:] - 1] = IGNORE  # last slot of every (padded) document
    if real is not None:
        shift[real[cu[1:] - 1]] = IGNORE  # last real token of every document
        lab[is_pad] = IGNORE
        shift[is_pad] = IGNORE
        doc_id = np.where(is_pad, -1, doc_id).astype(np.int32)
    extra = {}
    for name, arrs in (columns or {}).items():
        if len(arrs) != n or any(a.shape[0] != b for a, b in zip(arrs, lens.tolist())):
            raise ValueError(f"token column {name!r} must hold one array per document, of the "
                             f"document's length")
        extra[name] = _scatter(np.concatenate(arrs), total, real, 0)
    out = {"cu_seqlens": cu.astype(np.int32), "cu_seqlens_padded": cu_pad.astype(np.int32),
           "max_seqlen": int(lens.max(initial=0)), "max_seqlen_padded": int(padded.max(initial=0)),
           # trained tokens of the whole microbatch (every CP rank's): each label that is not
           # -100, document starts and padding excluded
           "microbatch_loss_tokens": int(np.count_nonzero(lab != IGNORE))}
    if cp > 1:
        idx = cp_shard.shard_index(lens, cp, cp_rank, owner)
        ids, lab, shift, pos, doc_id = (a[idx] for a in (ids, lab, shift, pos, doc_id))
        extra = {k: v[idx] for k, v in extra.items()}
        out.update(cp_index=idx, cp_owner=np.full(n, -1, np.int64) if owner is None else owner,
                   cp_attention=cp_shard.rank_attention(lens, cp, owner), cp=cp, cp_rank=cp_rank)
    out.update(input_ids=ids, labels=lab, shift_labels=shift, position_ids=pos,
               document_ids=doc_id, num_loss_tokens=int((shift != IGNORE).sum()))
    out.update(extra)
    return out


def check_loss_tokens(planned: Optional[int], trained: int, what: str) -> None:
    """Refuse a microbatch whose trained tokens differ from the sampler's count: the sampler was
    not given the dataset's :meth:`PackedDataset.loss_tokens`, so ``step_loss_tokens`` would
    count untrained tokens and the loss would be normalised wrongly."""
    if planned is not None and planned != trained:
        raise ValueError(
            f"{what} has {trained} trained tokens but the sampler counted {planned}: "
            f"give the sampler the dataset's counts (PackedBatchSampler(..., loss_tokens="
            f"packed_dataset.loss_tokens())) so step_loss_tokens counts the trained tokens")


class PackedCollator:
    """``collate_fn`` for :class:`PackedDataset` batches (see the module docstring for keys).

    ``cp_balance``: ``"zigzag"`` shards every document; ``"auto"`` keeps documents whole on one
    CP rank when :func:`balancer.loader.cp_shard.choose_owners` finds that balances the ranks better
    under ``cost`` (at most ``max_rank_tokens`` padded tokens per rank)."""

    def __init__(self, return_tensors: str = "pt", cp_balance: str = "zigzag",
                 cost: Optional[CostModel] = None, max_rank_tokens: Optional[int] = None,
                 pad_token_id: int = 0):
        if return_tensors not in ("pt", "np"):
            raise ValueError(f"return_tensors must be 'pt' or 'np', got {return_tensors!r}")
        if cp_balance not in ("zigzag", "auto"):
            raise ValueError(f"cp_balance must be 'zigzag' or 'auto', got {cp_balance!r}")
        self.return_tensors, self.cp_balance = return_tensors, cp_balance
        self.cost, self.max_rank_tokens, self.pad_token_id = cost, max_rank_tokens, pad_token_id

    def __call__(self, fetched) -> dict:
        if not isinstance(fetched, FetchedMicrobatch):
            raise ValueError("PackedCollator needs batches from PackedDataset (wrap the dataset: "
                             "DataLoader(PackedDataset(ds), batch_sampler=..., collate_fn=...))")
        ref, docs = fetched.ref, fetched.docs
        typed = isinstance(ref, MicrobatchRef)  # else a plain list of sample ids: cp 1, no meta
        cp, cp_rank = (ref.cp, ref.cp_rank) if typed else (1, 0)
        owner = None
        if cp > 1 and self.cp_balance == "auto":
            lens = np.fromiter((d.shape[0] for d in docs), np.int64, len(docs))
            owner = cp_shard.choose_owners(lens, cp, self.cost, self.max_rank_tokens)
        out = pack_documents(docs, cp, cp_rank, owner, self.pad_token_id,
                             **fetched.pack_kwargs())
        if typed and fetched.labels is not None:
            check_loss_tokens(ref.loss_tokens, out["microbatch_loss_tokens"],
                              f"microbatch {ref.mb}")
        out["sample_ids"] = np.asarray(list(ref), np.int64)
        # a copy: the ref's starts are a view of the plan (read-only, a memory map with a plan
        # store), and a tensor over them would let an in-place write change the plan or crash
        starts = ref.starts if typed else None
        out["sample_starts"] = np.zeros(len(docs), np.int64) if starts is None else \
            np.array(starts, np.int64)
        if typed:
            out.update(ref.batch_meta())
            if ref.slot is not None:
                out["last_in_step"] = ref.slot == ref.step_microbatches - 1
        if self.return_tensors == "pt":
            out = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
                   for k, v in out.items()}
        return out
