"""Megatron-core / Transformer Engine: the padded, unsharded microbatch and the batch dict that
Megatron's THD path consumes.

Current Megatron (``megatron.core.utils.get_thd_batch_on_this_cp_rank``) takes the *whole*
packed microbatch, every document padded to a multiple of ``2 cp`` tokens, and cuts the CP
shard itself with Transformer Engine's ``thd_get_partitioned_indices``; the per-rank shards of
:class:`~balancer.loader.collate.PackedCollator` are for loops that shard in the loader.

* :class:`PaddedCollator` — ``collate_fn`` giving that padded, unsharded microbatch: the
  collator's keys over ``cu_seqlens_padded[-1]`` tokens (pads: token ``pad_token_id``, labels
  -100, document id -1, positions counting on), ``cu_seqlens`` real and ``cu_seqlens_padded``;
  ``padded_for_cp`` says for which CP size. Each CP rank's zigzag shard is
  ``full[cp_shard.shard_index(lengths, cp, rank)]``, equal to the collator's shard and to TE's
  partition (:func:`te_partition_index`).
* :func:`megatron_batch` — ``tokens``/``labels`` (next token, 0 where masked)/``loss_mask``
  (float)/``position_ids`` of shape [1, T], ``attention_mask`` None, ``cu_seqlens`` and
  ``cu_seqlens_padded`` (int32) and ``max_seqlen`` (int32[1]), as Megatron's ``get_batch``
  hands them to ``get_thd_batch_on_this_cp_rank(batch, cu_seqlens, cu_seqlens_padded,
  max_seqlen)``. Megatron's loss is ``sum(loss * loss_mask)``; divide it by
  ``batch["step_loss_tokens"]`` for the plan's step normalisation. With an SFT labels or
  loss-mask column ``loss_mask`` is 0 on every token not trained (the user's mask, document
  starts, padding), so the same division gives the masked token mean of the step.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from ..loader import cp_shard
from ..loader.collate import IGNORE, FetchedMicrobatch, PackedCollator
from ..loader.refs import MicrobatchRef



def _unsharded(ref):
    """The ref with cp = 1 (same samples and metadata), so the collator packs it whole."""
    return ref.replace(cp=1, cp_rank=0) if isinstance(ref, MicrobatchRef) else list(ref)


def pad_microbatch(batch: dict, cp: int, pad_token_id: int = 0, token_columns=()) -> dict:
    """The unsharded ``cp == 1`` batch laid out with every document padded to a multiple of
    ``2 cp`` (numpy or torch arrays in, the same out); ``token_columns`` (the dataset's
    per-token columns in the batch) are padded with 0 like the collator pads them."""
    as_np = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    cu = np.asarray(as_np["cu_seqlens"], np.int64)
    lens = np.diff(cu)
    padded = cp_shard.padded_lengths(lens, cp)
    cu_p = np.concatenate([[0], np.cumsum(padded)])
    total = int(cu_p[-1])
    real = np.repeat(cu_p[:-1] - cu[:-1], lens) + np.arange(int(cu[-1]))
    out = dict(as_np)

    def scatter(key, fill, dtype):
        a = np.full(total, fill, dtype)
        a[real] = as_np[key]
        return a

    out["input_ids"] = scatter("input_ids", pad_token_id, np.int64)
    out["labels"] = scatter("labels", IGNORE, np.int64)
    out["shift_labels"] = scatter("shift_labels", IGNORE, np.int64)
    out["document_ids"] = scatter("document_ids", -1, np.int32)
    for c in token_columns:
        out[c] = scatter(c, 0, np.asarray(as_np[c]).dtype)
    out["position_ids"] = np.arange(total, dtype=np.int64) - np.repeat(cu_p[:-1], padded)
    out["cu_seqlens_padded"] = cu_p.astype(np.int32)
    out["max_seqlen_padded"] = int(padded.max(initial=0))
    out["padded_for_cp"] = int(cp)
    if any(isinstance(v, torch.Tensor) for v in batch.values()):
        out = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in out.items()}
    return out


class PaddedCollator:
    """``collate_fn`` for :class:`~balancer.loader.collate.PackedDataset`: the whole microbatch of the
    ref, padded for ``cp`` (default: the sampler's CP size) and not sharded; every CP rank of a
    DP replica gets the same batch (Megatron shards it)."""

    def __init__(self, cp: Optional[int] = None, return_tensors: str = "pt",
                 pad_token_id: int = 0):
        self.cp, self.pad_token_id = cp, pad_token_id
        self.return_tensors = return_tensors
        self._collator = PackedCollator(return_tensors="np", pad_token_id=pad_token_id)

    def __call__(self, fetched) -> dict:
        if not isinstance(fetched, FetchedMicrobatch):
            raise ValueError("PaddedCollator needs batches from PackedDataset")
        cp = self.cp or getattr(fetched.ref, "cp", 1)
        # the same documents with their labels and token columns, as one unsharded microbatch
        flat = self._collator(dataclasses.replace(fetched, ref=_unsharded(fetched.ref)))
        columns = tuple(getattr(fetched, "columns", None) or ())
        out = pad_microbatch(flat, cp, self.pad_token_id, columns)
        out["cp"] = cp
        if self.return_tensors == "pt":
            out = {k: torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else v
                   for k, v in out.items()}
        return out


def te_partition_index(cu_seqlens_padded, cp: int, cp_rank: int) -> np.ndarray:
    """Positions of CP rank ``cp_rank``'s tokens in the padded microbatch in Transformer Engine's
    order (``tex.thd_get_partitioned_indices``): per document, chunk ``cp_rank`` then chunk
    ``2 cp - 1 - cp_rank`` of ``2 cp`` equal chunks. Pure numpy (TE needs CUDA)."""
    cu = np.asarray(cu_seqlens_padded, np.int64)
    if cp == 1:
        return np.arange(int(cu[-1]), dtype=np.int64)
    out = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        n = b - a
        if n % (2 * cp):
            raise ValueError(f"a document of padded length {n} is not a multiple of 2 cp = {2 * cp}")
        c = n // (2 * cp)
        out += [np.arange(a + cp_rank * c, a + (cp_rank + 1) * c),
                np.arange(a + (2 * cp - 1 - cp_rank) * c, a + (2 * cp - cp_rank) * c)]
    return np.concatenate(out) if out else np.zeros(0, np.int64)


def megatron_batch(batch: dict, token_columns=()) -> dict:
    """The dict Megatron's THD ``get_batch`` works on, from a :class:`PaddedCollator` batch (or an
    unsharded cp == 1 batch). A loader-side CP shard is refused: Megatron shards the padded
    microbatch itself. ``loss_mask`` is 1 exactly where the next token is trained: with a
    labels or loss-mask column (``PackedDataset(labels_column= | loss_mask_column=)``) the
    masked tokens are 0, and its sum over a step is ``step_loss_tokens``. ``token_columns``
    (RL advantages, old log-probs...) are added as [1, T] under their own names."""
    if "cp_index" in batch:
        raise ValueError("this is a CP shard; Megatron cuts the shard itself from the padded, "
                         "unsharded microbatch: use balancer.integrations.megatron.PaddedCollator")
    shift = torch.as_tensor(batch["shift_labels"])
    keep = shift != IGNORE
    return {
        "tokens": torch.as_tensor(batch["input_ids"])[None],
        "labels": torch.where(keep, shift, torch.zeros_like(shift))[None],
        "loss_mask": keep.to(torch.float32)[None],
        "position_ids": torch.as_tensor(batch["position_ids"])[None],
        "attention_mask": None,
        "cu_seqlens": torch.as_tensor(batch["cu_seqlens"]).to(torch.int32),
        "cu_seqlens_padded": torch.as_tensor(batch["cu_seqlens_padded"]).to(torch.int32),
        "max_seqlen": torch.tensor([int(batch["max_seqlen_padded"])], dtype=torch.int32),
        **{c: torch.as_tensor(batch[c])[None] for c in token_columns},
    }
