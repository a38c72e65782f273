"""Per-sample payload held column-wise, the unit the exchange moves: the token ids and any other
per-token tensors (log-probs, masks) as flat CSR columns, per-sample tensors (advantages,
rewards, padded response rows) as stacked rows.

A :class:`Columns` of n samples has ``lengths`` int64[n] (numpy) and ``offsets`` int64[n + 1];
``token[name]`` is a tensor ``[sum(lengths), *trailing]`` whose rows
``offsets[i]:offsets[i + 1]`` belong to sample i, and ``sample[name]`` a tensor
``[n, *trailing]``. The :data:`Schema` (names, dtypes, kinds, trailing shapes) is what the ranks
must agree on for bytes to be decoded without sending shapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Optional, Sequence

import numpy as np
import torch

TOKENS = "input_ids"  # the token field every Columns carries


class FieldSpec(NamedTuple):
    """One payload field: ``kind`` is ``"token"`` (one row per token) or ``"sample"`` (one row
    per sample); ``trailing`` the shape of one row."""

    name: str
    dtype: torch.dtype
    kind: str
    trailing: tuple

    @property
    def row_bytes(self) -> int:
        return int(torch.empty((), dtype=self.dtype).element_size() * int(np.prod(self.trailing,
                                                                                  dtype=np.int64)))


Schema = tuple  # tuple[FieldSpec, ...], token fields first, then sample fields, each sorted


def token_ids(t: torch.Tensor, where: str) -> torch.Tensor:
    """``t`` as int64 token ids; a ValueError naming ``where`` for a float, complex or bool
    tensor (a cast would truncate silently)."""
    if t.numel() and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise ValueError(f"{where}: token ids of dtype {t.dtype}, not integers")
    return t.to(torch.int64)


def csr_positions(offsets: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """int64 positions of the rows of samples ``idx`` (in that order) in a CSR column."""
    idx = np.asarray(idx, np.int64)
    lens = offsets[idx + 1] - offsets[idx]
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    starts = np.repeat(offsets[idx] - (np.cumsum(lens) - lens), lens)
    return starts + np.arange(total, dtype=np.int64)


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(lengths.shape[0] + 1, np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


@dataclass
class Columns:
    """Payload of ``len(lengths)`` samples (see the module docstring)."""

    lengths: np.ndarray
    token: dict
    sample: dict

    def __post_init__(self):
        self.lengths = np.asarray(self.lengths, np.int64).reshape(-1)
        self.offsets = _offsets(self.lengths)
        total, n = int(self.offsets[-1]), self.lengths.shape[0]
        for name, t in self.token.items():
            if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != total:
                raise ValueError(f"token field {name!r}: expected a tensor of {total} rows (one per "
                                 f"token), got {tuple(getattr(t, 'shape', ()))}")
        for name, t in self.sample.items():
            if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] != n:
                raise ValueError(f"sample field {name!r}: expected a tensor of {n} rows (one per "
                                 f"sample), got {tuple(getattr(t, 'shape', ()))}")
        both = set(self.token) & set(self.sample)
        if both:
            raise ValueError(f"field(s) {sorted(both)} given both per token and per sample")

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def schema(self) -> Schema:
        tok = tuple(FieldSpec(k, v.dtype, "token", tuple(v.shape[1:]))
                    for k, v in sorted(self.token.items()))
        smp = tuple(FieldSpec(k, v.dtype, "sample", tuple(v.shape[1:]))
                    for k, v in sorted(self.sample.items()))
        return tok + smp

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def empty(cls, schema: Schema, device=None) -> "Columns":
        tok, smp = {}, {}
        for f in schema:
            (tok if f.kind == "token" else smp)[f.name] = torch.empty(
                (0, *f.trailing), dtype=f.dtype, device=device)
        return cls(np.zeros(0, np.int64), tok, smp)

    @classmethod
    def from_sequences(cls, tokens: Sequence, token_fields: Optional[Mapping] = None,
                       sample_fields: Optional[Mapping] = None) -> "Columns":
        """``tokens``: one 1-D tensor (or array/list) of token ids per sample;
        ``token_fields[name]``: one tensor per sample with as many rows as its tokens;
        ``sample_fields[name]``: a tensor ``[n, ...]`` or a list of n equal-shaped tensors."""
        seqs = []
        for i, t in enumerate(tokens):
            t = torch.as_tensor(t)
            if sum(d > 1 for d in t.shape) > 1:  # [1, L] (a tokenizer's batch of one) is 1-D
                raise ValueError(f"sample {i}: token ids of shape {list(t.shape)}, not 1-D")
            seqs.append(t.reshape(-1))
        lengths = np.fromiter((s.shape[0] for s in seqs), np.int64, len(seqs))
        for i, t in enumerate(seqs):
            token_ids(t, f"sample {i}")
        tok = {TOKENS: token_ids(torch.cat(seqs), "tokens") if seqs else
               torch.zeros(0, dtype=torch.int64)}
        for name, vals in (token_fields or {}).items():
            vals = [torch.as_tensor(v) for v in vals]
            if len(vals) != len(seqs):
                raise ValueError(f"token field {name!r}: {len(vals)} tensors for {len(seqs)} samples")
            for i, v in enumerate(vals):
                if v.dim() < 1 or v.shape[0] != lengths[i]:
                    raise ValueError(f"token field {name!r}, sample {i}: {tuple(v.shape)} rows "
                                     f"for {int(lengths[i])} tokens")
            if vals:  # with no samples the dtype is unknown: a rank offering nothing adopts
                tok[name] = torch.cat(vals)  # the other ranks' fields

        smp = {}
        for name, vals in (sample_fields or {}).items():
            v = vals if isinstance(vals, torch.Tensor) else torch.stack(
                [torch.as_tensor(v) for v in vals])
            if v.dim() < 1 or v.shape[0] != len(seqs):
                raise ValueError(f"sample field {name!r}: {v.shape[0] if v.dim() else 0} rows for "
                                 f"{len(seqs)} samples (shape {tuple(v.shape)})")
            smp[name] = v
        return cls(lengths, tok, smp)

    @classmethod
    def from_padded(cls, batch: Mapping, mask_key: str = "attention_mask",
                    drop: Sequence = ("position_ids",)) -> "Columns":
        """A dict of padded tensors: ``batch[mask_key]`` [B, S] marks the real tokens (any
        pattern, e.g. left-padded prompt + right-padded response); every tensor of shape
        [B, S, ...] becomes a token field (its rows where the mask is set, in order), every
        other tensor with B rows a sample field (rows travel whole). Keys in ``drop`` are left
        out (position ids are rebuilt per document by the collator)."""
        mask = batch[mask_key]
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise ValueError(f"{mask_key!r} must be a [B, S] tensor")
        b, s = mask.shape
        keep = mask.bool()
        lengths = keep.sum(1).cpu().numpy().astype(np.int64)
        tok, smp = {}, {}
        for k, v in batch.items():
            if k == mask_key or k in drop:
                continue
            if not isinstance(v, torch.Tensor):
                raise ValueError(f"batch[{k!r}] is a {type(v).__name__}: only tensors travel "
                                 f"(drop it or turn it into a tensor)")
            if v.dim() >= 2 and tuple(v.shape[:2]) == (b, s):
                tok[k] = v[keep]
            elif v.dim() >= 1 and v.shape[0] == b:
                smp[k] = v
            else:
                raise ValueError(f"batch[{k!r}] has shape {tuple(v.shape)}: neither [B={b}, S={s}, "
                                 f"...] (per token) nor [B={b}, ...] (per sample)")
        if TOKENS in tok:
            tok[TOKENS] = token_ids(tok[TOKENS], f"batch[{TOKENS!r}]")
        return cls(lengths, tok, smp)

    # ---- selection ------------------------------------------------------------------------
    def take(self, idx) -> "Columns":
        """The samples ``idx`` (int array), in that order."""
        idx = np.asarray(idx, np.int64)
        pos = torch.from_numpy(csr_positions(self.offsets, idx))
        rows = torch.from_numpy(idx)
        tok = {k: v.index_select(0, pos.to(v.device)) for k, v in self.token.items()}
        smp = {k: v.index_select(0, rows.to(v.device)) for k, v in self.sample.items()}
        return Columns(self.lengths[idx], tok, smp)

    def slice(self, lo: int, hi: int) -> "Columns":
        """Samples ``lo..hi-1`` as views (no copy)."""
        a, b = int(self.offsets[lo]), int(self.offsets[hi])
        return Columns(self.lengths[lo:hi], {k: v[a:b] for k, v in self.token.items()},
                       {k: v[lo:hi] for k, v in self.sample.items()})

    @staticmethod
    def concat(parts: Sequence["Columns"], schema: Optional[Schema] = None) -> "Columns":
        parts = [p for p in parts if p is not None]
        if not parts:
            if schema is None:
                raise ValueError("nothing to concatenate and no schema")
            return Columns.empty(schema)
        if len(parts) == 1:
            return parts[0]
        lengths = np.concatenate([p.lengths for p in parts])
        tok = {k: torch.cat([p.token[k] for p in parts]) for k in parts[0].token}
        smp = {k: torch.cat([p.sample[k] for p in parts]) for k in parts[0].sample}
        return Columns(lengths, tok, smp)

    def rows(self, name: str, i: int) -> torch.Tensor:
        """Field ``name`` of sample ``i``: ``[length, ...]`` for a token field, ``[...]`` for a
        sample field."""
        if name in self.token:
            return self.token[name][int(self.offsets[i]):int(self.offsets[i + 1])]
        return self.sample[name][i]
