"""Hugging Face transformers inputs for one packed microbatch (cp == 1), exact per document.

transformers (5.x) builds the per-document causal mask of a packed row from ``position_ids``
only when the model gets neither an ``attention_mask`` nor a cache object; with the model's
default ``use_cache=True`` it creates a ``DynamicCache``, skips that detection and every token
attends across the documents before it (sdpa, eager and flex_attention alike). So:

* :func:`model_inputs` (``mask="positions"``, the default) returns the keys of
  ``DataCollatorWithFlattening`` (:func:`balancer.loader.adapters.hf_flattening`) **with**
  ``use_cache=False``: exact for sdpa, eager, flex_attention and flash_attention_2/3 (which take
  the ``cu_seq_lens_*`` keys) with everything else at the model's defaults;
* ``mask="additive"``: an explicit float 4D mask ``[1, 1, T, T]`` (0 = attend, the dtype's
  minimum elsewhere) in the model's dtype, for sdpa and eager (O(T^2) memory);
* ``mask="block"``: a FlexAttention ``BlockMask`` for ``attn_implementation="flex_attention"``.

:func:`check_inputs` refuses what is known to be wrong before the model runs: no mask and the
cache on, a 4D *boolean* mask for eager or flex_attention (they add the mask to the scores, so
True becomes +1 and False 0: nothing is masked), a ``BlockMask`` for another implementation, a
float mask in another dtype than the model's, and a 2D ``attention_mask`` next to packed
``position_ids`` (it switches the per-document mask off).

Call ``model(**model_inputs(batch, model))``; the HF loss (labels shifted inside the model, -100
at every document start) then never predicts across a document boundary.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..loader.adapters import flex_block_mask, hf_flattening

MASKS = ("positions", "additive", "block")


def _config(model):
    cfg = getattr(model, "config", model)
    if not hasattr(cfg, "_attn_implementation"):
        raise ValueError("give a transformers model (or its config) so that the attention "
                         "implementation is known")
    return cfg


def attn_implementation(model) -> str:
    return str(_config(model)._attn_implementation)


def _model_dtype(model, dtype):
    if dtype is not None:
        return dtype
    if isinstance(model, torch.nn.Module):
        p = next(model.parameters(), None)
        if p is not None:
            return p.dtype
    d = getattr(_config(model), "dtype", None) or getattr(_config(model), "torch_dtype", None)
    if isinstance(d, torch.dtype):
        return d
    raise ValueError("the additive mask needs the model's dtype: pass dtype=")


def additive_mask(batch: dict, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Float ``[1, 1, T, T]``: 0 where a query may attend (same document, key position <= query
    position), ``torch.finfo(dtype).min`` elsewhere (what transformers' eager masks hold)."""
    if not dtype.is_floating_point:
        raise ValueError(f"an additive mask must be a float dtype, got {dtype}")
    if batch.get("cp", 1) > 1:
        raise ValueError("HF models take an unsharded microbatch; use cp == 1")
    doc = torch.as_tensor(batch["document_ids"], device=device)
    pos = torch.as_tensor(batch["position_ids"], device=device)
    keep = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    out = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    out.masked_fill_(~keep, torch.finfo(dtype).min)
    return out[None, None]


def block_mask(batch: dict, device=None):
    """FlexAttention ``BlockMask`` of the microbatch (batch and head dimensions broadcast)."""
    if batch.get("cp", 1) > 1:
        raise ValueError("HF models take an unsharded microbatch; use cp == 1")
    return flex_block_mask(batch, device=device)


def model_inputs(batch: dict, model=None, mask: str = "positions", dtype=None,
                 device=None) -> dict:
    """Keyword arguments for ``model(**...)`` (input_ids, labels, position_ids [1, T],
    ``use_cache=False`` and, per ``mask``, the flash-attn keys, an additive float mask or a
    BlockMask). With ``model`` (a transformers model or its config) the result is checked
    against its attention implementation by :func:`check_inputs`."""
    if mask not in MASKS:
        raise ValueError(f"mask must be one of {MASKS}, got {mask!r}")
    out = hf_flattening(batch, flash_attn_kwargs=mask == "positions")
    if mask == "additive":
        out["attention_mask"] = additive_mask(batch, _model_dtype(model, dtype), device)
    elif mask == "block":
        out["attention_mask"] = block_mask(batch, device)
    if device is not None:
        out = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in out.items()}
    if model is not None:
        check_inputs(model, out)
    return out


def _is_block_mask(x) -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError:  # pragma: no cover - torch without flex attention
        return False
    return isinstance(x, BlockMask)


def _packed(position_ids) -> bool:
    """More than one document in a row: a position that is not its predecessor + 1."""
    if position_ids is None:
        return False
    p = torch.as_tensor(position_ids)
    p = p.reshape(1, -1) if p.dim() == 1 else p
    return bool((p[:, 1:] != p[:, :-1] + 1).any())


def check_inputs(model, inputs: dict, dtype: Optional[torch.dtype] = None) -> None:
    """Raise ValueError when ``model(**inputs)`` is known to attend across packed documents or
    to mask nothing. ``model`` is a transformers model or its config."""
    cfg = _config(model)
    impl = str(cfg._attn_implementation)
    am = inputs.get("attention_mask")
    packed = _packed(inputs.get("position_ids"))
    if _is_block_mask(am):
        if impl != "flex_attention":
            raise ValueError(f"a FlexAttention BlockMask needs attn_implementation="
                             f"'flex_attention', the model uses {impl!r}")
        return
    if isinstance(am, torch.Tensor) and am.dim() == 4:
        if am.dtype == torch.bool:
            if impl != "sdpa":
                raise ValueError(
                    f"a 4D boolean attention_mask is wrong for attn_implementation={impl!r}: it is "
                    "added to the scores (True -> +1, False -> 0), so nothing is masked; use "
                    "balancer.integrations.hf.model_inputs(batch, model, mask='additive')")
            return
        try:
            want = _model_dtype(model, dtype)
        except ValueError:
            want = None
        if not am.dtype.is_floating_point:
            raise ValueError(f"a 4D attention_mask must be float (additive) or bool, got {am.dtype}")
        if want is not None and am.dtype != want:
            raise ValueError(f"the additive mask is {am.dtype} but the model computes in {want} "
                             "(sdpa refuses it, eager rounds it): build it with the model's dtype")
        return
    if am is not None and packed:
        raise ValueError("a 2D attention_mask next to packed position_ids switches transformers' "
                         "per-document mask off (tokens attend across documents): drop the "
                         "attention_mask, or pass a 4D mask")
    if am is None and packed:
        use_cache = inputs.get("use_cache", getattr(cfg, "use_cache", False))
        if use_cache and not inputs.get("cache") and not inputs.get("past_key_values"):
            raise ValueError(
                "packed position_ids with use_cache on: transformers then creates a cache and "
                "skips the per-document mask it derives from position_ids, so tokens attend "
                "across documents; pass use_cache=False (balancer.integrations.hf.model_inputs "
                "does) or an explicit mask")
        if inputs.get("cache") is not None or inputs.get("past_key_values") is not None:
            raise ValueError("a cache object switches transformers' per-document mask off; "
                             "train packed rows without a cache")
