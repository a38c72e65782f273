"""A small decoder-only transformer for packed (THD) microbatches, written with torch only.

``TinyLM(vocab, dim, layers, heads).forward(input_ids[T], position_ids[T], cu_seqlens[N+1],
max_seqlen) -> logits float[T, vocab]``: pre-norm blocks, rotary positions from
``position_ids`` (so a document's logits do not depend on where it sits in the pack) and
varlen-correct causal attention: no token attends across a ``cu_seqlens`` boundary. The
attention runs document by document with SDPA (``attention="loop"``: work ``sum L_d^2``, which
is what the cost model predicts), document by document in query tiles of ``TILE`` tokens
(``attention="tiled"``: the same work with a bounded working set, as flash-attention kernels
run on a GPU; on a CPU an untiled ``L x L`` score matrix falls out of cache and the time per
``L^2`` swings by 40% with ``L``, which no quadratic cost model can follow), or as one SDPA call
with a block-diagonal causal mask (``attention="mask"``: work ``T^2``, a cross-check).

The calibration tool imports exactly this class and signature; keep it stable.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from balancer.cli.args import at_least, positive_float  # noqa: F401 (tools/train.py's flags)

IGNORE = -100


def rope(x: torch.Tensor, position_ids: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding of ``x`` [T, H, D] at ``position_ids`` [T] (D even)."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d))
    ang = position_ids.to(torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().to(x.dtype)[:, None, :], ang.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out


def block_causal_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """bool[T, T]: True where query t may attend key s (same document, s <= t)."""
    cu = cu_seqlens.to(torch.int64)
    t = torch.arange(total, device=cu.device)
    doc = torch.bucketize(t, cu[1:], right=True)
    return (doc[:, None] == doc[None, :]) & (t[None, :] <= t[:, None])


ATTENTION_MODES = ("loop", "tiled", "mask")
TILE = 128  # query rows per tile of ``attention="tiled"``


def _causal(q, k, v, tile: int) -> torch.Tensor:
    """Causal attention of one document, q, k, v [H, L, D]; ``tile`` > 0 runs it in query
    tiles (tile i attends keys ``0 .. end of tile i``), so no score block exceeds
    ``tile x L``."""
    n = q.shape[1]
    if tile <= 0 or n <= tile:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    outs = [F.scaled_dot_product_attention(q[:, :tile], k[:, :tile], v[:, :tile], is_causal=True)]
    for s in range(tile, n, tile):
        e = min(n, s + tile)
        mask = torch.ones(e - s, e, dtype=torch.bool, device=q.device).tril(diagonal=s)
        outs.append(F.scaled_dot_product_attention(q[:, s:e], k[:, :e], v[:, :e], attn_mask=mask))
    return torch.cat(outs, dim=1)


def varlen_attention(q, k, v, cu_seqlens, mode: str = "loop") -> torch.Tensor:
    """Causal attention inside each document. q, k, v: [T, H, D] -> [T, H, D]."""
    if mode == "mask":
        mask = block_causal_mask(cu_seqlens, q.shape[0])
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), attn_mask=mask)
        return o.transpose(0, 1)
    bounds = cu_seqlens.tolist()
    tile = TILE if mode == "tiled" else 0
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        o = _causal(q[lo:hi].transpose(0, 1), k[lo:hi].transpose(0, 1), v[lo:hi].transpose(0, 1),
                    tile)
        outs.append(o.transpose(0, 1))
    if bounds[-1] < q.shape[0]:  # trailing tokens outside every document attend to nothing
        outs.append(torch.zeros_like(q[bounds[-1]:]))
    return torch.cat(outs) if outs else torch.zeros_like(q)


def masked_attention(q, k, v, mask) -> torch.Tensor:
    """q [Tq, H, D] against k, v [Tk, H, D] under bool mask [Tq, Tk]; rows with no key give 0
    (CP padding queries)."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                       attn_mask=mask)
    return torch.where(mask.any(dim=1)[None, :, None], o, 0.0).transpose(0, 1)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, attention: str):
        super().__init__()
        if dim % heads or (dim // heads) % 2:
            raise ValueError(f"dim {dim} must split into {heads} heads of even width")
        self.heads, self.attention = heads, attention
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def qkv_heads(self, x, position_ids):
        t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(t, 3, self.heads, d // self.heads).unbind(1)
        return rope(q, position_ids), rope(k, position_ids), v

    def forward(self, x, position_ids, cu_seqlens):
        q, k, v = self.qkv_heads(x, position_ids)
        a = varlen_attention(q, k, v, cu_seqlens, self.attention)
        x = x + self.proj(a.reshape(x.shape))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Decoder-only LM over packed documents (see the module docstring)."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, attention: str = "loop"):
        super().__init__()
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {attention!r}")
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, attention) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be 1-D (packed THD), got shape "
                             f"{tuple(input_ids.shape)}")
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x, position_ids, cu_seqlens)
        return self.head(self.norm(x))


def add_model_args(group) -> None:
    """The TinyLM flags (``--vocab --dim --layers --heads --attention``) on an argparse group;
    the trainer, the calibration tool and the proof take the same ones (check the parsed
    values with :func:`check_model_args`: ``--dim`` a multiple of ``--heads``)."""
    group.add_argument("--vocab", type=at_least(2), default=256, help="vocabulary size")
    group.add_argument("--dim", type=at_least(1), default=64, help="TinyLM width")
    group.add_argument("--layers", type=at_least(1), default=2, help="TinyLM blocks")
    group.add_argument("--heads", type=at_least(1), default=4, help="TinyLM attention heads")
    group.add_argument("--attention", choices=ATTENTION_MODES, default="tiled",
                       help="TinyLM attention (tiled: flash-style query tiles)")


def check_model_args(parser, args) -> None:
    """``parser.error`` (exit 2) when ``--dim`` is not a multiple of ``--heads``."""
    if args.dim % args.heads:
        parser.error(f"argument --heads: --dim {args.dim} is not a multiple of --heads "
                     f"{args.heads} (each head gets dim / heads channels)")


def model_from_args(args) -> "TinyLM":
    """The TinyLM the :func:`add_model_args` flags describe."""
    return TinyLM(args.vocab, args.dim, args.layers, args.heads, attention=args.attention)


def token_loss_sum(logits: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over labelled positions (``shift_labels`` != -100)."""
    return F.cross_entropy(logits.float(), shift_labels, ignore_index=IGNORE, reduction="sum")
