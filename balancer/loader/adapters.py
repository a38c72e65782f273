"""Adapters from a :class:`~balancer.loader.collate.PackedCollator` batch to what consumers take.

* :func:`flash_attn_kwargs` — ``flash_attn_varlen_func(q, k, v, **kwargs, causal=True)`` with
  ``q``/``k``/``v`` of shape ``[T, heads, head_dim]`` (fp16/bf16, on the GPU) and
  ``kwargs = flash_attn_kwargs(batch, device=q.device)`` (cu_seqlens int32 on q's device,
  max lengths Python ints); ``causal=True`` is what keeps it causal inside every document (the
  cu_seqlens keep documents apart). torch's ``varlen_attn`` takes the same with
  ``cu_seq_q=..``/``cu_seq_k=..``/``max_q=..``/``max_k=..`` and ``is_causal=True``;
* :func:`hf_flattening` — the keys of Hugging Face ``DataCollatorWithFlattening`` with
  ``return_flash_attn_kwargs=True`` (tensors with a leading batch dimension of 1) plus
  ``use_cache=False``: without it transformers builds a cache and skips the per-document mask
  it derives from ``position_ids`` (see :mod:`balancer.integrations.hf` for explicit masks);
* :func:`packed_seq_params` — the fields of Megatron-core ``PackedSeqParams(qkv_format="thd")``
  as a dataclass (``PackedSeqParams(**fields.as_dict())``; Megatron is never imported here);
  it refuses CP shards that keep documents whole (``cp_balance="auto"``): Transformer Engine and
  Megatron's THD RoPE expect every document zigzag-partitioned;
* :func:`document_mask_mod` / :func:`flex_block_mask` — a FlexAttention document-causal mask
  from per-token document ids and positions (works for CP shards against gathered keys too).

With cp > 1 the cu_seqlens handed on are those of the whole microbatch (Transformer Engine and
Megatron cut the CP shard themselves from ``cu_seqlens_padded``); the real and padded ones are
kept apart by name, never mixed.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch


def flash_attn_kwargs(batch: dict, device=None) -> dict:
    """``cu_seqlens_q/k`` (int32, on ``device`` when given) and ``max_seqlen_q/k`` (int) of the
    microbatch (cp == 1), for ``flash_attn_varlen_func(q, k, v, **kwargs, causal=True)``."""
    if batch.get("cp", 1) > 1:
        raise ValueError("flash-attn varlen kwargs describe an unsharded microbatch; with cp > 1 "
                         "use packed_seq_params (Transformer Engine shards it)")
    cu, m = torch.as_tensor(batch["cu_seqlens"], dtype=torch.int32), int(batch["max_seqlen"])
    if device is not None:
        cu = cu.to(device)
    return {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": m, "max_seqlen_k": m}


def hf_flattening(batch: dict, flash_attn_kwargs: bool = True) -> dict:
    """``input_ids``/``labels``/``position_ids`` of shape [1, T] and, with
    ``flash_attn_kwargs``, ``cu_seq_lens_q/k`` and ``max_length_q/k``, as
    ``transformers.DataCollatorWithFlattening`` returns them, and ``use_cache=False``: with it,
    ``model(**hf_flattening(batch))`` keeps attention inside every document for sdpa, eager,
    flex_attention and flash_attention_2 at the model's defaults (a cache object switches off
    the per-document mask transformers derives from ``position_ids``)."""
    if batch.get("cp", 1) > 1:
        raise ValueError("DataCollatorWithFlattening has no CP sharding; use cp == 1")
    out = {k: torch.as_tensor(batch[k])[None] for k in ("input_ids", "labels", "position_ids")}
    if flash_attn_kwargs:
        cu, m = torch.as_tensor(batch["cu_seqlens"]), int(batch["max_seqlen"])
        out.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=m, max_length_k=m)
    out["use_cache"] = False
    return out


@dataclass(frozen=True)
class PackedSeqFields:
    """Megatron-core ``PackedSeqParams`` fields for ``qkv_format="thd"``."""

    qkv_format: str
    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    cu_seqlens_q_padded: torch.Tensor
    cu_seqlens_kv_padded: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items()}


def packed_seq_params(batch: dict) -> PackedSeqFields:
    """Real and padded cu_seqlens of the whole microbatch (int32) and the padded max length
    (what TE's THD kernels index the padded layout with).

    Refuses a CP shard that keeps documents whole on one rank (``cp_owner >= 0``, from
    ``PackedCollator(cp_balance="auto")``): Transformer Engine's THD attention and Megatron's
    THD RoPE assume every document is split into ``2 cp`` chunks with chunks ``r`` and
    ``2 cp - 1 - r`` on rank ``r`` (``thd_get_partitioned_indices``), so such a shard is read
    wrongly. Use ``cp_balance="zigzag"`` or the padded, unsharded microbatch
    (:class:`balancer.integrations.megatron.PaddedCollator`), which Megatron shards itself."""
    owner = batch.get("cp_owner")
    if owner is not None and bool((torch.as_tensor(owner) >= 0).any()):
        whole = int((torch.as_tensor(owner) >= 0).sum())
        raise ValueError(
            f"{whole} document(s) of this CP shard are kept whole on one rank (cp_balance='auto'); "
            "Transformer Engine and Megatron expect every document zigzag-partitioned over the "
            f"{batch.get('cp')} CP ranks: use PackedCollator(cp_balance='zigzag') or "
            "balancer.integrations.megatron.PaddedCollator (Megatron shards it itself)")
    cu = torch.as_tensor(batch["cu_seqlens"])
    cu_p = torch.as_tensor(batch["cu_seqlens_padded"])
    m = int(batch["max_seqlen_padded"])
    return PackedSeqFields("thd", cu, cu, cu_p, cu_p, m, m)


def document_mask_mod(q_doc: torch.Tensor, q_pos: torch.Tensor, kv_doc=None, kv_pos=None):
    """FlexAttention ``mask_mod(b, h, q_idx, kv_idx)``: same document and causal by position.
    Padding (document id -1) attends only to itself, so no row is empty. ``kv_*`` default to the
    query side (unsharded); for a CP shard pass the gathered whole-microbatch ids/positions."""
    kv_doc = q_doc if kv_doc is None else kv_doc
    kv_pos = q_pos if kv_pos is None else kv_pos

    def mask_mod(b, h, q_idx, kv_idx):
        same = (q_doc[q_idx] == kv_doc[kv_idx]) & (q_doc[q_idx] >= 0)
        return same & (kv_pos[kv_idx] <= q_pos[q_idx])

    return mask_mod


def flex_block_mask(batch: dict, device=None):
    """A FlexAttention ``BlockMask`` for an unsharded microbatch (cp == 1)."""
    from torch.nn.attention.flex_attention import create_block_mask
    doc = torch.as_tensor(batch["document_ids"])
    pos = torch.as_tensor(batch["position_ids"])
    t = doc.shape[0]
    return create_block_mask(document_mask_mod(doc, pos), None, None, t, t,
                             device=device or doc.device)


def dense_document_mask(q_doc, q_pos, kv_doc=None, kv_pos=None) -> torch.Tensor:
    """bool[Tq, Tk] with the same meaning as :func:`document_mask_mod` (True = attend); padding
    queries see themselves only when ``kv`` is the query side, otherwise nothing."""
    kv_doc = q_doc if kv_doc is None else kv_doc
    kv_pos = q_pos if kv_pos is None else kv_pos
    q_doc, q_pos = torch.as_tensor(q_doc), torch.as_tensor(q_pos)
    kv_doc, kv_pos = torch.as_tensor(kv_doc), torch.as_tensor(kv_pos)
    return ((q_doc[:, None] == kv_doc[None, :]) & (q_doc[:, None] >= 0)
            & (kv_pos[None, :] <= q_pos[:, None]))
