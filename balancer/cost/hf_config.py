"""A cost model from a Hugging Face ``config.json`` (issue #25): analytic forward FLOPs of every
layer, by layer type, read from the JSON alone (transformers is not needed).

Per token and forward pass, every matrix multiply costs ``2 x`` its weights: attention
projections (GQA/MQA: ``kv_heads``; MLA: DeepSeek's low-rank q / kv projections), the MLP
(gated: 3 matrices) or the mixture of experts (router + ``num_experts_per_tok`` routed experts
+ shared experts), linear-attention / state-space layers (projections, short convolution and a
recurrence linear in the tokens) and the LM head; embedding lookups cost nothing. The
attention core (``Q K^T`` and ``P V``) costs ``2 heads (d_qk + d_v)`` per query-key pair, and
the pairs depend on the layer type (:mod:`balancer.cost.attention`): full causal, sliding
window, chunked local. Linear-attention layers have no pairs: their work is linear in ``L``.

:func:`arch_from_config` reads a config into an :class:`Arch`; :func:`cost_fields` gives the
fields of its :class:`~balancer.cost.CostModel` (``b`` the linear FLOPs, one
:class:`~balancer.cost.attention.AttentionTerm` per attention pattern, backward = 2x linear and
2.5x attention as for :class:`~balancer.cost.ModelSpec`). Missing fields that have a documented
default (the transformers config class's) are named in one warning; an unknown ``model_type``
or ``layer_types`` entry is an error naming it and what is supported."""
from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Optional

from .attention import AttentionTerm

#: model_type -> family: how its layers are read
FAMILIES = {
    "llama": "dense", "mistral": "dense", "qwen2": "dense", "qwen3": "dense",
    "gemma": "dense", "gemma2": "dense", "gemma3_text": "dense", "olmo2": "dense",
    "phi3": "dense", "granite": "dense", "ministral": "dense",
    "mixtral": "moe", "qwen2_moe": "moe", "qwen3_moe": "moe", "olmoe": "moe",
    "gpt_oss": "moe", "deepseek_v3": "moe", "qwen3_next": "moe", "llama4_text": "moe",
}
#: multimodal wrappers whose language model is ``text_config``
WRAPPERS = {"gemma3": "gemma3_text", "llama4": "llama4_text", "mistral3": None}
#: layer_types entries understood, and the attention kind each is
LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding",
               "chunked_attention": "chunked", "linear_attention": "linear"}


def supported_model_types() -> list[str]:
    return sorted(set(FAMILIES) | set(WRAPPERS))


@dataclass
class Arch:
    """What the cost needs of one model, per token and forward pass (FLOPs) or per token
    (values): ``linear_flops`` every matrix multiply linear in the tokens, all layers plus the
    LM head; ``pair_flops`` per attention kind ``(kind, window) -> FLOPs per query-key pair``
    over its layers; ``kv_values`` K and V values per token of every softmax-attention layer
    (what context parallelism exchanges); ``act_values`` activation values per token kept for
    the backward pass; ``params`` weights (embedding included)."""

    model_type: str
    hidden: int
    layers: int
    vocab: int
    linear_flops: float = 0.0
    pair_flops: dict = field(default_factory=dict)
    layer_counts: dict = field(default_factory=dict)
    kv_values: dict = field(default_factory=dict)
    act_values: float = 0.0
    params: float = 0.0
    defaults_used: list = field(default_factory=list)

    def terms(self, attn_backward_ratio: float = 2.5) -> tuple[AttentionTerm, ...]:
        return tuple(AttentionTerm(kind=k, window=w, forward=f, backward=f * attn_backward_ratio,
                                   layers=self.layer_counts[(k, w)])
                     for (k, w), f in sorted(self.pair_flops.items(),
                                             key=lambda kv: (kv[0][0], kv[0][1] or 0)))


class _Reader:
    """Fields of one config, recording the defaults it had to use."""

    def __init__(self, cfg: dict, where: str):
        self.cfg, self.where, self.defaults = cfg, where, []

    def req(self, key: str) -> int:
        v = self.cfg.get(key)
        if v is None:
            raise ValueError(f"{self.where}: required field {key!r} is missing "
                             f"(model_type {self.cfg.get('model_type')!r})")
        return self._num(key, v)

    def opt(self, key: str, default):
        if key not in self.cfg:
            if default is not None:
                self.defaults.append(f"{key}={default!r}")
            return default
        v = self.cfg[key]
        return v if v is None or isinstance(v, (list, bool, str)) else self._num(key, v)

    def _num(self, key, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v < 0:
            raise ValueError(f"{self.where}: {key} must be a non-negative number, got {v!r}")
        return v


def _layer_types(r: _Reader, mt: str, n: int) -> list[str]:
    """Every layer's attention kind (``full``/``sliding``/``chunked``/``linear``)."""
    lt = r.cfg.get("layer_types")
    if lt is None:
        sw = r.cfg.get("sliding_window")
        if mt in ("gemma2", "gpt_oss"):
            lt = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
            r.defaults.append("layer_types=alternating sliding/full")
        elif mt == "gemma3_text":
            p = r.opt("sliding_window_pattern", 6)
            lt = ["sliding_attention" if (i + 1) % p else "full_attention" for i in range(n)]
        elif mt == "qwen3_next":
            p = r.opt("full_attention_interval", 4)
            lt = ["linear_attention" if (i + 1) % p else "full_attention" for i in range(n)]
        elif mt == "llama4_text":
            nope = r.cfg.get("no_rope_layers") or [int((i + 1) % 4 != 0) for i in range(n)]
            chunk = r.opt("attention_chunk_size", 8192)
            lt = ["chunked_attention" if rope and chunk else "full_attention" for rope in nope]
        elif mt == "qwen2" and r.cfg.get("use_sliding_window") and sw:
            mw = r.opt("max_window_layers", 28)
            lt = ["sliding_attention" if i >= mw else "full_attention" for i in range(n)]
        elif mt in ("mistral", "mixtral", "ministral") and sw:
            lt = ["sliding_attention"] * n
        else:
            lt = ["full_attention"] * n
    if not isinstance(lt, list) or len(lt) != n:
        raise ValueError(f"{r.where}: layer_types must list num_hidden_layers={n} entries, "
                         f"got {lt!r:.80}")
    kinds = []
    for i, t in enumerate(lt):
        t = {"attention": "full_attention", "mamba": "linear_attention"}.get(t, t)
        if t not in LAYER_KINDS:
            raise ValueError(f"{r.where}: layer_types[{i}] {t!r} is not supported; supported: "
                             f"{sorted(LAYER_KINDS)}")
        kinds.append(LAYER_KINDS[t])
    return kinds


def _moe_layers(r: _Reader, mt: str, n: int) -> list[bool]:
    """Which layers have a mixture-of-experts FFN."""
    if mt in ("mixtral", "gpt_oss", "olmoe"):
        return [True] * n
    if mt in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        step = r.opt("decoder_sparse_step", 1)
        only = set(r.opt("mlp_only_layers", []) or [])
        return [i not in only and step > 0 and (i + 1) % step == 0 for i in range(n)]
    if mt == "deepseek_v3":
        k = r.opt("first_k_dense_replace", 3)
        freq = r.opt("moe_layer_freq", 1)
        return [i >= k and i % freq == 0 for i in range(n)]
    if mt == "llama4_text":
        moe = r.cfg.get("moe_layers")
        if moe is None:
            step = r.opt("interleave_moe_layer_step", 1)
            moe = list(range(step - 1, n, step))
        return [i in set(moe) for i in range(n)]
    return [False] * n


def arch_from_config(cfg: dict, where: str = "config") -> Arch:
    """The :class:`Arch` of a Hugging Face config (a dict as in ``config.json``)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
    mt = cfg.get("model_type")
    if mt in WRAPPERS:
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ValueError(f"{where}: model_type {mt!r} needs a 'text_config' object (the "
                             f"language model)")
        cfg = dict(text)
        cfg.setdefault("model_type", WRAPPERS[mt])
        mt, where = cfg["model_type"], f"{where} text_config"
    if mt not in FAMILIES:
        raise ValueError(f"{where}: model_type {mt!r} is not supported; supported: "
                         f"{supported_model_types()}")
    r = _Reader(cfg, where)
    h, n, vocab = r.req("hidden_size"), r.req("num_hidden_layers"), r.req("vocab_size")
    heads = r.req("num_attention_heads")
    if heads < 1:
        raise ValueError(f"{where}: num_attention_heads {heads!r} must be at least 1")
    kv = r.opt("num_key_value_heads", heads) or heads
    hd = r.opt("head_dim", None)
    if not hd:   # no head width given: hidden_size is split over the heads
        if h % heads:
            raise ValueError(f"{where}: hidden_size {h} is not a multiple of "
                             f"num_attention_heads {heads} and no head_dim is given (the "
                             f"head width would be {h / heads:g}); give head_dim")
        hd = h // heads
    kinds = _layer_types(r, mt, n)
    moe = _moe_layers(r, mt, n)
    a = Arch(model_type=mt, hidden=h, layers=n, vocab=vocab)
    window = {"full": None, "linear": None,
              "sliding": r.cfg.get("sliding_window"),
              "chunked": r.opt("attention_chunk_size", 8192) if "chunked" in kinds else None}
    for k in ("sliding", "chunked"):
        if k in kinds and not window[k]:
            raise ValueError(f"{where}: layer_types has {k} layers but "
                             f"{'sliding_window' if k == 'sliding' else 'attention_chunk_size'} "
                             f"is {window[k]!r}")
    lin = 0.0
    act = 0.0
    params = float(h * vocab) * (1 if cfg.get("tie_word_embeddings") else 2)
    for i in range(n):
        kind = kinds[i]
        if kind == "linear":
            w, act_l = _linear_attention(r, h)
        else:
            w, qk, v, act_l = _attention(r, mt, h, heads, kv, hd)
            key = (kind, int(window[kind]) if window[kind] else None)
            a.pair_flops[key] = a.pair_flops.get(key, 0.0) + 2.0 * heads * (qk + v)
            a.layer_counts[key] = a.layer_counts.get(key, 0) + 1
            a.kv_values[key] = a.kv_values.get(key, 0.0) + kv_values(r, mt, kv, hd)
        lin += w
        params += w / 2
        f_w, f_act, f_params = _ffn(r, mt, h, moe[i])
        lin += f_w
        params += f_params
        act += act_l + f_act + 2 * h  # two norms' inputs
    lin += 2.0 * h * vocab  # LM head
    a.linear_flops = lin
    a.act_values = act
    a.params = params
    a.defaults_used = r.defaults
    return a


def kv_values(r: _Reader, mt: str, kv: int, hd: int) -> float:
    """K and V values per token of one attention layer (MLA: per head after up-projection,
    what a ring exchange of the decompressed K, V moves)."""
    if mt == "deepseek_v3":
        heads = r.req("num_attention_heads")
        return float(heads * (r.opt("qk_nope_head_dim", 128) + r.opt("qk_rope_head_dim", 64)
                              + r.opt("v_head_dim", 128)))
    return 2.0 * kv * hd


def _attention(r: _Reader, mt: str, h: int, heads: int, kv: int, hd: int):
    """``(projection FLOPs per token, d_qk, d_v, activation values per token)`` of one
    softmax-attention layer."""
    if mt == "deepseek_v3":  # multi-head latent attention
        nope, rope = r.opt("qk_nope_head_dim", 128), r.opt("qk_rope_head_dim", 64)
        v = r.opt("v_head_dim", 128)
        ql, kvl = r.opt("q_lora_rank", 1536), r.opt("kv_lora_rank", 512)
        qk = nope + rope
        q = (h * ql + ql * heads * qk) if ql else h * heads * qk
        w = q + h * (kvl + rope) + kvl * heads * (nope + v) + heads * v * h
        return 2.0 * w, qk, v, h + heads * qk * 2 + heads * v * 2 + (ql or 0) + kvl + rope
    gate = 2 if mt == "qwen3_next" else 1  # Qwen3-Next's gated attention output
    w = h * heads * hd * gate + 2 * h * kv * hd + heads * hd * h
    return 2.0 * w, hd, hd, h + heads * hd * (1 + gate) + 2 * kv * hd


#: chunk length of the chunked gated delta rule (fla's and transformers' default)
_GDN_CHUNK = 64


def _linear_attention(r: _Reader, h: int):
    """``(FLOPs per token, activation values per token)`` of one Gated DeltaNet layer
    (Qwen3-Next): projections, the depthwise causal convolution and the chunked delta rule
    (chunks of ``C = 64`` tokens, per value head and token ``2 (3 C d_k + 2 C d_v + 3 d_k d_v)``:
    the intra-chunk ``K K^T``, ``Q K^T``, the UT transform's two products and ``P V``, the
    state read by ``Q`` and by the decayed keys and the state update; linear in L)."""
    hk, hv = r.opt("linear_num_key_heads", 16), r.opt("linear_num_value_heads", 32)
    dk, dv = r.opt("linear_key_head_dim", 128), r.opt("linear_value_head_dim", 128)
    conv = r.opt("linear_conv_kernel_dim", 4)
    key_dim, val_dim = hk * dk, hv * dv
    proj = h * (2 * key_dim + 2 * val_dim) + h * 2 * hv + val_dim * h
    c = _GDN_CHUNK
    flops = 2.0 * proj + 2.0 * (2 * key_dim + val_dim) * conv \
        + hv * 2.0 * (3 * c * dk + 2 * c * dv + 3 * dk * dv)
    return flops, h + 2 * (2 * key_dim + 2 * val_dim) + val_dim


def _ffn(r: _Reader, mt: str, h: int, is_moe: bool):
    """``(FLOPs per token, activation values per token, parameters)`` of one layer's FFN."""
    if not is_moe:
        key = "intermediate_size_mlp" if mt == "llama4_text" else "intermediate_size"
        f = r.req(key)
        return 2.0 * 3 * h * f, h + 3 * f, 3.0 * h * f
    if mt in ("mixtral", "gpt_oss", "llama4_text"):
        e, k = r.req("num_local_experts"), r.opt("num_experts_per_tok", 2)
        f = r.req("intermediate_size")
    elif mt == "deepseek_v3":
        e, k = r.req("n_routed_experts"), r.opt("num_experts_per_tok", 8)
        f = r.req("moe_intermediate_size")
    else:
        e, k = r.req("num_experts"), r.opt("num_experts_per_tok", 8)
        f = r.req("moe_intermediate_size") if mt != "olmoe" else r.req("intermediate_size")
    shared = 0
    if mt == "deepseek_v3":
        shared = r.opt("n_shared_experts", 1) * f
    elif mt in ("qwen2_moe", "qwen3_next"):
        shared = r.opt("shared_expert_intermediate_size", 0)
    elif mt == "llama4_text":
        shared = f
    gate = h if mt in ("qwen2_moe", "qwen3_next") and shared else 0  # shared-expert gate
    w = h * e + k * 3 * h * f + 3 * h * shared + gate
    params = h * e + e * 3 * h * f + 3 * h * shared + gate
    return 2.0 * w, h + k * (h + 3 * f) + 3 * shared, float(params)


def read_config(path: str | os.PathLike) -> dict:
    """A ``config.json`` as a dict; a clear error when it is not JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read the model config ({e.strerror})") from None


def cost_fields(cfg: dict, *, name: str = "hf-config", where: str = "config",
                recompute: bool = False, attn_backward_ratio: float = 2.5,
                linear_backward_ratio: float = 2.0, device_bytes: float = 80e9,
                fixed_bytes: Optional[float] = None, flops_per_second: Optional[float] = None,
                bytes_per_value: int = 2) -> dict:
    """The fields of the :class:`~balancer.cost.CostModel` of a Hugging Face config (what
    :func:`balancer.cost.model.cost_model_from_config` builds): FLOPs, one attention term per
    (kind, window), activation memory per token (the capacity) and weights."""
    for k, v in (("attn_backward_ratio", attn_backward_ratio),
                 ("linear_backward_ratio", linear_backward_ratio)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{k} {v!r} must be a finite non-negative number")
    arch = arch_from_config(cfg, where)
    if arch.defaults_used:
        warnings.warn(f"{where}: fields missing, documented defaults used: "
                      f"{', '.join(arch.defaults_used)}", stacklevel=3)
    lin = arch.linear_flops
    per_token = (float(arch.layers * arch.hidden) if recompute else arch.act_values)
    if fixed_bytes is None:  # bf16 weights + grads; optimizer state sharded (ZeRO)
        fixed_bytes = 4.0 * arch.params
    mem = dict(bytes_per_token=per_token * bytes_per_value, fixed_bytes=fixed_bytes,
               device_bytes=device_bytes)
    return dict(name=name, unit="flops", forward=dict(b=lin),
                backward=dict(b=lin * linear_backward_ratio), recompute=recompute, memory=mem,
                flops_per_second=flops_per_second, attention=arch.terms(attn_backward_ratio))


__all__ = ["Arch", "FAMILIES", "LAYER_KINDS", "arch_from_config", "cost_fields", "read_config",
           "supported_model_types"]
