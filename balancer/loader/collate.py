"""Fetching and collating packed (THD) microbatches.

``DataLoader(PackedDataset(ds), batch_sampler=PackedBatchSampler(...),
collate_fn=PackedCollator())`` yields one dict per microbatch of this rank. The dataset wrapper
receives the sampler's :class:`~balancer.loader.sampler.MicrobatchRef` in ``__getitems__`` and returns
the documents' token ids already cut to their ``[start, start + length)`` ranges; the collator
turns them into the batch below (torch tensors unless ``return_tensors="np"``).

Keys (T = tokens this rank holds, N = documents in the microbatch):

* ``input_ids`` int64[T]; ``labels`` int64[T]: the token itself, -100 at every document start and
  on padding (Hugging Face convention: the model shifts, so a document never predicts the next);
  ``shift_labels`` int64[T]: the next token of the same document, -100 at every document's last
  token and on padding (pre-shifted: what CP shards and Megatron-style losses need);
* ``position_ids`` int64[T] restarting at 0 per document (chunk pieces too); ``document_ids``
  int32[T] (index of the document in the microbatch, -1 on padding);
* ``cu_seqlens`` int32[N + 1] (real lengths), ``cu_seqlens_padded`` int32[N + 1] (offsets in
  the padded layout; equal to ``cu_seqlens`` when cp == 1), ``max_seqlen`` /
  ``max_seqlen_padded`` Python ints: always of the whole microbatch, as flash-attn, Megatron and
  Transformer Engine take them;
* ``sample_ids``/``sample_starts`` int64[N]: which sample, and the piece's token offset in it;
* ``num_loss_tokens`` (int): labelled tokens this rank holds; ``microbatch_loss_tokens``: the
  whole microbatch's; ``step_loss_tokens``: the whole step's over all DP ranks and microbatches
  (normalise the summed token loss by it, then sum gradients over DP x CP);
* ``epoch``, ``position``, ``step``, ``slot``, ``step_microbatches``, ``mb`` (the plan's
  microbatch id), ``last_in_step`` (bool);
* with cp > 1: ``cp_index`` int64[T] (positions of this shard in the padded microbatch, see
  :mod:`balancer.loader.cp_shard`), ``cp_owner`` int64[N] (-1 zigzag, else the owning rank),
  ``cp_attention`` float64[cp] (causal attention pairs per CP rank), ``cp``, ``cp_rank``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from . import cp_shard
from .refs import MicrobatchRef, Ref
from ..cost.model import CostModel

IGNORE = -100


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
    """What :class:`PackedDataset` hands the collator: the ref and each document's tokens."""

    ref: Any
    docs: list


class PackedDataset(torch.utils.data.Dataset):
    """Wraps a map-style dataset of token ids for the packed loader.

    ``dataset[i]`` may be an array-like of token ids or a mapping holding ``tokens_column``; a
    Hugging Face ``datasets.Dataset`` is read through Arrow in one ``take`` per microbatch."""

    def __init__(self, dataset, tokens_column: str = "input_ids"):
        self.dataset, self.tokens_column = dataset, tokens_column
        self._arrow = None
        if hasattr(dataset, "with_format") and hasattr(dataset, "column_names"):
            if tokens_column not in dataset.column_names:
                raise ValueError(f"dataset has no column {tokens_column!r} "
                                 f"(columns: {dataset.column_names})")
            self._arrow = dataset.select_columns([tokens_column]).with_format("arrow")

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return self._fetch([int(i)])[0]

    def _fetch(self, ids: list) -> list:
        n = len(self)
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"sample {i} is outside the dataset's 0..{n - 1}")
        if self._arrow is not None:
            col = self._arrow[ids][self.tokens_column].combine_chunks()
            values = col.values.to_numpy(zero_copy_only=False)
            offs = col.offsets.to_numpy()
            return [values[offs[j]:offs[j + 1]] for j in range(len(ids))]
        out = []
        for i in ids:
            row = self.dataset[i]
            if isinstance(row, dict):
                row = row[self.tokens_column]
            out.append(np.asarray(row))
        return out

    def __getitems__(self, ref) -> FetchedMicrobatch:
        ids = list(ref)
        rows = self._fetch(ids)
        starts = ref.starts if isinstance(ref, Ref) else None
        if starts is None:  # a plain list of sample ids (or a ref without ranges): whole samples
            return FetchedMicrobatch(ref, rows)
        planned = ref.sample_lengths
        planned = [None] * len(ids) if planned is None else planned.tolist()
        docs = []
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
        return FetchedMicrobatch(ref, docs)


def pack_documents(docs: list, cp: int = 1, cp_rank: int = 0,
                   owner: Optional[np.ndarray] = None, pad_token_id: int = 0) -> dict:
    """The packed arrays of one microbatch (numpy), this CP rank's shard when cp > 1."""
    lens = np.fromiter((d.shape[0] for d in docs), np.int64, len(docs))
    if (lens <= 0).any():
        raise ValueError(f"document {int(np.flatnonzero(lens <= 0)[0])} of the microbatch is empty")
    padded = cp_shard.padded_lengths(lens, cp)
    n, total = lens.shape[0], int(padded.sum())
    cu = np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=cu[1:])
    cu_pad = np.zeros(n + 1, np.int64)
    np.cumsum(padded, out=cu_pad[1:])
    if cp == 1:
        ids = np.concatenate(docs).astype(np.int64, copy=False)
        real = None
    else:
        ids = np.full(total, pad_token_id, np.int64)
        real = np.repeat(cu_pad[:-1] - cu[:-1], lens) + np.arange(int(cu[-1]))
        ids[real] = np.concatenate(docs)
    doc_start = cu_pad[:-1]
    pos = np.arange(total, dtype=np.int64) - np.repeat(doc_start, padded)
    doc_id = np.repeat(np.arange(n, dtype=np.int32), padded)
    is_pad = pos >= np.repeat(lens, padded)
    labels = ids.copy()
    labels[doc_start] = IGNORE
    shift = np.empty_like(ids)
    shift[:-1] = ids[1:]
    shift[cu_pad[1:] - 1] = IGNORE  # last slot of every (padded) document
    if real is not None:
        shift[real[cu[1:] - 1]] = IGNORE  # last real token of every document
        labels[is_pad] = IGNORE
        shift[is_pad] = IGNORE
        doc_id = np.where(is_pad, -1, doc_id).astype(np.int32)
    out = {"cu_seqlens": cu.astype(np.int32), "cu_seqlens_padded": cu_pad.astype(np.int32),
           "max_seqlen": int(lens.max(initial=0)), "max_seqlen_padded": int(padded.max(initial=0)),
           "microbatch_loss_tokens": int(cu[-1] - n)}
    if cp > 1:
        idx = cp_shard.shard_index(lens, cp, cp_rank, owner)
        ids, labels, shift, pos, doc_id = (a[idx] for a in (ids, labels, shift, pos, doc_id))
        out.update(cp_index=idx, cp_owner=np.full(n, -1, np.int64) if owner is None else owner,
                   cp_attention=cp_shard.rank_attention(lens, cp, owner), cp=cp, cp_rank=cp_rank)
    out.update(input_ids=ids, labels=labels, shift_labels=shift, position_ids=pos,
               document_ids=doc_id, num_loss_tokens=int((shift != IGNORE).sum()))
    return out


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
        out = pack_documents(docs, cp, cp_rank, owner, self.pad_token_id)
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
