"""Cost of context parallelism per document and group size: compute per rank plus the exposed
part of the K/V exchange.

A document of ``L`` tokens on a CP group of ``g`` ranks (``g`` a power of two) is padded to a
multiple of ``2 g`` and zigzag-sharded (:mod:`balancer.loader.cp_shard`): rank ``r`` holds chunks ``r``
and ``2 g - 1 - r``. Per rank, per training step of that document:

* **compute** = attention x (the largest rank's share of the causal query-key pairs, from
  :func:`balancer.zigzag.zigzag_attention`) + linear x (padded tokens / g / L) + the per-document
  constant. Attention and linear parts are the forward and backward coefficients of the
  :class:`~balancer.cost.CostModel` (its ``doc_parts``: the CostFormula protocol; the FLOP formulas stay in
  :class:`~balancer.cost.ModelSpec`), full recompute adding one more forward to the backward.
* **exchange**: every rank receives the K and V of the other ``g - 1`` shares in every layer, in
  the forward pass (``(g - 1) / g * padded * kv_bytes_per_token`` bytes) and ``backward_exchange``
  times that in the backward pass (ring attention sends K, V again and returns dK, dV), plus one
  more forward exchange under full recompute. The bandwidth is the intra-node one when the group
  fits in a node (aligned power-of-two groups with ``g <= gpus_per_node`` always do) and the
  inter-node one otherwise (a flat ring is as fast as its slowest link); every ring step of every
  layer also pays a latency.
* **exposed** part of an exchange of ``t`` seconds next to ``a`` seconds of this document's
  attention in the same pass: ``(1 - overlap) * t + max(0, overlap * t - a)``: the fraction
  ``overlap`` of the exchange can hide behind the attention compute, the rest cannot. Short
  documents have little attention to hide behind, which is why they should not be sharded.

The per-rank time is ``compute + exposed``; ``g = 1`` is the document whole on one rank: its
cost model cost, no padding, no exchange. :meth:`CPCostModel.table` evaluates all of it for every
document and every group size at once (float64[n, n_sizes], vectorised numpy), which the hybrid
planner (:mod:`packing.hybrid_cp`) consumes.

Costs are in seconds: the cost model must have ``unit="seconds"`` or FLOPs with
``flops_per_second``. With ``pp`` pipeline stages a stage computes ``1 / pp`` of the model and
exchanges K/V of ``layers / pp`` layers.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
from pydantic import (BaseModel, Field, ValidationError, field_validator, model_serializer,
                      model_validator)

from packing.validate import MAX_LENGTH, as_sizes

from .. import resources
from .attention import busiest_share
from .hf_config import arch_from_config, read_config
from .model import (BUILTIN, CostModel, ModelSpec, _part, load_cost_model, one_line,
                    preset_path, read_yaml)
from ..frozen import FROZEN, FROZEN_FINITE

_FROZEN = FROZEN_FINITE  # balancer.frozen: the one model_config
#: most ranks in one pool (dp x cp of a stage)
MAX_POOL = 2 ** 16
#: documents per vectorised block of :meth:`CPCostModel.table` (bounds its scratch memory)
_BLOCK = 1 << 15


def _max_shares(lengths: np.ndarray, sizes: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """float64[n, k]: the busiest zigzag rank's share of each document's attention pairs on
    each group size (``zigzag_attention(lengths, g).max(axis=1) / pairs``, in one compiled
    pass; imported here so that importing the cost model compiles nothing)."""
    from packing.zigzag_work import zigzag_max_pairs
    return zigzag_max_pairs(lengths, sizes) / pairs[:, None]


def _is_pow2(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


class CPHardware(BaseModel):
    """Interconnect figures of the CP exchange. Defaults are an H100 SXM node (DGX/HGX H100: 8
    GPUs on NVLink 4, one 400 Gb/s ConnectX-7 NIC per GPU), at about 80% of the peak, which is
    what NCCL's bus bandwidth typically reaches on large transfers; calibrate them on your
    cluster (``tools/calibrate_cp.py`` under torchrun, or ``nccl-tests`` all_gather_perf) and
    pass your own (``CPHardware.from_yaml``, ``--cp-hardware FILE``)."""

    model_config = _FROZEN
    gpus_per_node: int = Field(
        8, ge=1, le=MAX_POOL,
        description="GPUs sharing the fast intra-node fabric; a power of two, so aligned "
                    "power-of-two CP groups never straddle a node unless larger than one")
    intra_node_bandwidth: float = Field(
        360e9, gt=0, le=1e15,
        description="bytes/s one GPU receives inside a node: NVLink 4 is 450 GB/s per "
                    "direction per H100 SXM (900 GB/s bidirectional), 80% of it effective")
    inter_node_bandwidth: float = Field(
        40e9, gt=0, le=1e15,
        description="bytes/s one GPU receives across nodes: one 400 Gb/s (50 GB/s) "
                    "InfiniBand/RoCE NIC per GPU, 80% of it effective")
    intra_node_latency: float = Field(
        5e-6, ge=0, le=1.0, description="seconds per ring step per layer inside a node")
    inter_node_latency: float = Field(
        1.5e-5, ge=0, le=1.0, description="seconds per ring step per layer across nodes")
    overlap: float = Field(
        1.0, ge=0, le=1,
        description="fraction of each K/V exchange that can overlap with the document's own "
                    "attention compute of the same pass (1 = all of it, up to the attention "
                    "time; 0.5 = only half of it, the other half is always exposed)")
    kv_bytes: int = Field(2, ge=1, le=8, description="bytes per K/V value (2 = bf16/fp16)")
    backward_exchange: float = Field(
        2.0, ge=0, le=16,
        description="backward exchange volume / forward exchange volume (ring attention "
                    "passes K, V again and returns dK, dV: 2)")

    @classmethod
    def from_yaml(cls, path, **overrides) -> "CPHardware":
        """Figures from a YAML mapping of these fields (what ``tools/calibrate_cp.py`` writes),
        then ``overrides``; unknown keys and bad values are one error naming the file."""
        doc = read_yaml(path, "CP hardware file")
        try:
            return cls(**{**doc, **overrides})
        except ValidationError as e:
            raise ValueError(f"{path}: {one_line(e)}") from None

    @field_validator("gpus_per_node")
    @classmethod
    def _pow2(cls, v):
        if not _is_pow2(v):
            raise ValueError(f"gpus_per_node {v} is not a power of two (aligned power-of-two "
                             f"groups are assumed to tile nodes)")
        return v


def cp_presets() -> list[str]:
    """The cost presets the CP cost model can use: those with a ``model:`` mapping or an
    ``hf_config:``."""
    return sorted(n for n in resources.preset_names("models")
                  if {"model", "hf_config"} & set(read_yaml(preset_path(n, "models"),
                                                            "cost preset")))


class KVLayers(BaseModel):
    """The K/V a CP group exchanges for the softmax-attention layers of one pattern (issue
    #25): a window or chunk limits it to the keys a rank's chunks can see."""

    model_config = _FROZEN
    kind: str = Field(description="full, sliding or chunked (balancer.cost.attention)")
    window: Optional[int] = Field(None, gt=0, le=MAX_LENGTH,
                                  description="window / chunk tokens (sliding, chunked)")
    layers: int = Field(gt=0, le=2 ** 24, description="layers of this pattern, whole model")
    values: float = Field(gt=0, description="K and V values per token per layer")

    def tokens(self, padded: np.ndarray, g: int) -> np.ndarray:
        """Tokens of K/V one rank receives per layer: the other ranks' share of the document
        (full causal), at most ``2 (window - 1)`` (the keys before its two chunks) under a
        window or chunk."""
        other = (g - 1) / g * padded
        if self.kind == "full":
            return other
        return np.minimum(other, 2.0 * (self.window - 1))


def _hf_cp_parts(cfg: dict, where: str):
    """``(ModelSpec, kv_layers)`` of a Hugging Face config: the spec gives the layers (pp,
    latency), the K/V layers the exchange."""
    arch = arch_from_config(cfg, where)
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    heads = int(text["num_attention_heads"])
    hd = text.get("head_dim") or arch.hidden // heads
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = ModelSpec(hidden=arch.hidden, layers=arch.layers, heads=heads,
                         kv_heads=None, head_dim=int(hd), vocab=arch.vocab,
                         ffn=int(text.get("intermediate_size") or 1))
    kv = tuple(KVLayers(kind=k, window=w, layers=arch.layer_counts[(k, w)],
                        values=v / arch.layer_counts[(k, w)])
               for (k, w), v in sorted(arch.kv_values.items(),
                                       key=lambda kv_: (kv_[0][0], kv_[0][1] or 0)))
    return spec, kv


class CPCostTable(NamedTuple):
    """Per-document costs of every group size, as the hybrid planner consumes them.

    * ``sizes`` int64[K]: group sizes ``1, 2, 4, ..., 2^(K-1)`` (the largest <= the pool);
    * ``time`` float64[n, K]: seconds per rank (compute + exposed exchange) of the document
      sharded over ``sizes[k]`` ranks (``k = 0``: whole on one rank);
    * ``compute`` float64[n, K] and ``exposed`` float64[n, K]: the two parts of ``time``;
    * ``tokens`` int64[n, K]: tokens each rank holds (CP padding included);
    * ``work`` float64[n]: the document's compute whole on one rank (no padding, no exchange),
      what the no-cut lower bound divides over the pool;
    * ``round_constant`` float: seconds per rank per microbatch round (the cost model's
      per-microbatch constant ``c``);
    * ``rank_capacity`` int: the per-rank token limit (a rank holds at most this many tokens in
      one round).
    """

    sizes: np.ndarray
    time: np.ndarray
    compute: np.ndarray
    exposed: np.ndarray
    tokens: np.ndarray
    work: np.ndarray
    round_constant: float
    rank_capacity: int


class CPCostModel(BaseModel):
    """Per-rank time of documents on CP groups: a :class:`CostModel` (compute), the
    :class:`ModelSpec` it was built from (K/V bytes), interconnect figures and the per-rank
    token limit."""

    model_config = FROZEN
    cost: CostModel = Field(description="compute of one document, whole model")
    spec: ModelSpec = Field(description="the model: layers, KV heads, head width")
    hardware: CPHardware = Field(default_factory=CPHardware, description="interconnect")
    rank_capacity: int = Field(gt=0, le=MAX_LENGTH,
                               description="tokens one rank holds in one round (memory)")
    pp: int = Field(1, ge=1, le=MAX_POOL, description="pipeline stages (a stage is 1/pp)")
    kv_layers: tuple[KVLayers, ...] = Field(
        (), description="K/V exchanged per attention pattern (a model from a Hugging Face "
                        "config); empty: every layer full attention with the spec's K/V heads")

    @model_serializer(mode="wrap")
    def _omit_no_kv_layers(self, handler):
        # without K/V layers the model serializes as before they existed (stored hybrid plans
        # compare their manifest's model with the job's)
        out = handler(self)
        if not self.kv_layers and isinstance(out, dict):
            out.pop("kv_layers", None)
        return out

    @model_validator(mode="after")
    def _needs_seconds(self):
        c = self.cost
        if not (c.unit == "seconds" or (c.unit == "flops" and c.flops_per_second)):
            raise ValueError(f"cost model {c.name!r} is in {c.unit} without a throughput: the CP "
                             f"cost model needs seconds (unit: seconds, or flops with "
                             f"flops_per_second) to weigh compute against communication")
        if self.spec.layers % self.pp:
            raise ValueError(f"layers {self.spec.layers} is not a multiple of pp {self.pp}")
        return self

    # ---- constructors ---------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, rank_capacity: int, hardware: Optional[CPHardware] = None,
                    pp: int = 1) -> "CPCostModel":
        """A model preset with a ``model:`` mapping (``configs/models``): its cost model and
        its ModelSpec."""
        if Path(str(name)).suffix == ".json":  # a Hugging Face config.json
            spec, kv = _hf_cp_parts(read_config(name), str(name))
            return cls(cost=load_cost_model(name), spec=spec, hardware=hardware or CPHardware(),
                       rank_capacity=rank_capacity, pp=pp, kv_layers=kv)
        path = preset_path(name, "models")
        if path is None and name in BUILTIN:
            raise ValueError(f"cost model {name!r} is a built-in formula without a 'model:' "
                             f"mapping (layers, heads, kv_heads, ...) for the K/V bytes; "
                             f"presets that have one: {cp_presets()}")
        if path is None:
            raise ValueError(f"unknown cost model {name!r}: not a YAML file and not one of "
                             f"{cp_presets()} (the presets with a 'model:' mapping)")
        doc = read_yaml(path, "cost preset")
        if "hf_config" in doc:
            cfg = doc["hf_config"]
            if isinstance(cfg, str):
                cfg = read_config(Path(path).parent / cfg)
            spec, kv = _hf_cp_parts(cfg, f"{path}: hf_config")
            return cls(cost=load_cost_model(name), spec=spec, hardware=hardware or CPHardware(),
                       rank_capacity=rank_capacity, pp=pp, kv_layers=kv)
        if "model" not in doc:
            raise ValueError(f"{path}: the CP cost model needs a preset with a 'model:' "
                             f"mapping (layers, heads, kv_heads, ...) for the K/V bytes")
        spec = ModelSpec(**doc["model"])
        return cls(cost=load_cost_model(name), spec=spec, hardware=hardware or CPHardware(),
                   rank_capacity=rank_capacity, pp=pp)

    def with_hardware(self, **changes) -> "CPCostModel":
        """The same model with some interconnect figures changed (validated)."""
        hw = CPHardware(**{**self.hardware.model_dump(), **changes})
        return self.model_copy(update={"hardware": hw})

    # ---- figures --------------------------------------------------------------------------
    @property
    def layers(self) -> int:
        """Layers of one pipeline stage."""
        return self.spec.layers // self.pp

    def kv_bytes_per_token(self) -> float:
        """Bytes of K and V of one token over the stage's layers:
        ``2 * kv_heads * head_dim * kv_bytes * layers`` (with ``kv_layers``: their values)."""
        if self.kv_layers:
            return sum(k.values * k.layers for k in self.kv_layers) / self.pp \
                * self.hardware.kv_bytes
        kv = self.spec.kv_heads or self.spec.heads
        return 2.0 * kv * self.spec.hd * self.hardware.kv_bytes * self.layers

    def sizes(self, n_ranks: int) -> np.ndarray:
        """Group sizes for a pool of ``n_ranks``: powers of two up to the largest <= n_ranks."""
        n_ranks = int(n_ranks)
        if not 1 <= n_ranks <= MAX_POOL:
            raise ValueError(f"pool of {n_ranks} ranks: must be 1..{MAX_POOL}")
        return 1 << np.arange(n_ranks.bit_length(), dtype=np.int64)

    def doc_limit(self, group: int) -> int:
        """Longest document that fits a group of ``group`` ranks (CP padding included)."""
        cap = self.rank_capacity
        return cap if group == 1 else group * (cap - cap % 2)

    def pool_limit(self, n_ranks: int) -> tuple[int, int]:
        """``(limit, group)``: the longest document a pool of ``n_ranks`` ranks holds on one of
        its aligned power-of-two groups, and the size of that group (the largest; a single
        rank where only it holds anything: at ``rank_capacity`` 1 a zigzag shard of two
        chunks per rank does not fit, so groups of 2 or more hold no document)."""
        g = 1 << (int(n_ranks).bit_length() - 1)
        return max((self.doc_limit(g), g), (self.doc_limit(1), 1))

    def _shares(self, lengths: np.ndarray, sizes: np.ndarray, pairs: np.ndarray) -> np.ndarray:
        """float64[n, K]: the busiest zigzag rank's share of each document's attention: of its
        causal pairs, or, for a model with attention terms, of the attention work summed over
        its layer types (a window moves and lightens the busiest rank)."""
        c = self.cost
        if not c.attention:
            return _max_shares(lengths, sizes, pairs)
        rc = c.recompute
        a = 2.0 * (c.forward.a + c.backward.a + (c.forward.a if rc else 0.0))
        weighted = [("full", None, a)] if a > 0 else []
        weighted += [(t.kind, t.window, t.forward + t.backward + (t.forward if rc else 0.0))
                     for t in c.attention]
        return busiest_share(lengths, sizes, weighted)

    def _exchange_bytes(self, lengths: np.ndarray, padded: np.ndarray, g: int) -> np.ndarray:
        """Bytes of K/V one rank receives in one forward pass of a document on ``g`` ranks:
        the other ranks' tokens x K/V bytes per token, or per attention pattern with
        ``kv_layers`` (a window limits the keys a rank needs; linear-attention layers send
        none)."""
        if not self.kv_layers:
            return (g - 1) / g * padded * self.kv_bytes_per_token()
        out = np.zeros(lengths.shape[0])
        for k in self.kv_layers:
            out += k.tokens(padded, g) * (k.values * k.layers / self.pp
                                          * self.hardware.kv_bytes)
        return out

    def _to_seconds(self, x: np.ndarray) -> np.ndarray:
        s = self.cost.seconds(x)
        return np.asarray(s, dtype=np.float64) / self.pp

    def table(self, lengths, n_ranks: int) -> CPCostTable:
        """Every document's per-rank time on every group size of a pool of ``n_ranks``."""
        lengths = as_sizes(lengths)
        sizes = self.sizes(n_ranks)
        n, k = lengths.shape[0], sizes.shape[0]
        time = np.empty((n, k))
        comp = np.empty((n, k))
        expo = np.zeros((n, k))
        tok = np.empty((n, k), dtype=np.int64)
        work = np.empty(n)
        for lo in range(0, n, _BLOCK):
            sl = slice(lo, min(n, lo + _BLOCK))
            c, e, t, w = self._block(lengths[sl], sizes)
            comp[sl], expo[sl], tok[sl], work[sl] = c, e, t, w
        np.add(comp, expo, out=time)
        cf, cb = self.cost.microbatch_constant
        rc = float(self._to_seconds(np.float64(cf + cb)))
        return CPCostTable(sizes, time, comp, expo, tok, work, rc, int(self.rank_capacity))

    def _block(self, lengths: np.ndarray, sizes: np.ndarray):
        c = self.cost
        att_f, att_b, lin, per_doc = c.doc_parts(lengths)  # the cost formula's own split
        att_f, att_b = self._to_seconds(att_f), self._to_seconds(att_b)
        lin, per_doc = self._to_seconds(lin), self._to_seconds(per_doc)
        lf = lengths.astype(np.float64)
        pairs = lf * (lf + 1) / 2
        hw = self.hardware
        kvb = self.kv_bytes_per_token()
        n, k = lengths.shape[0], sizes.shape[0]
        comp = np.empty((n, k))
        expo = np.zeros((n, k))
        tok = np.empty((n, k), dtype=np.int64)
        work = att_f + att_b + lin + per_doc
        shares = self._shares(lengths, sizes, pairs)
        for j, g in enumerate(sizes.tolist()):
            if g == 1:
                comp[:, 0] = work
                tok[:, 0] = lengths
                continue
            padded = -(-lengths // (2 * g)) * (2 * g)
            tok[:, j] = padded // g
            share = shares[:, j]
            a_f, a_b = att_f * share, att_b * share
            comp[:, j] = a_f + a_b + lin * (padded / (g * lf)) + per_doc
            inside = g <= hw.gpus_per_node
            bw = hw.intra_node_bandwidth if inside else hw.inter_node_bandwidth
            lat = hw.intra_node_latency if inside else hw.inter_node_latency
            if self.kv_layers:
                t_f = self._exchange_bytes(lengths, padded, g) / bw \
                    + lat * (g - 1) * self.layers
            else:
                t_f = (g - 1) / g * padded * kvb / bw + lat * (g - 1) * self.layers
            t_b = hw.backward_exchange * t_f + (t_f if c.recompute else 0.0)
            expo[:, j] = _exposed(t_f, a_f, hw.overlap) + _exposed(t_b, a_b, hw.overlap)
        return comp, expo, tok, work

    def exchange_parts(self, lengths, n_ranks: int) -> "ExchangeParts":
        """The exchange of every document on every group size in pieces (same figures as
        :meth:`table`, which charges every document its own exchange)."""
        lengths = as_sizes(lengths)
        sizes = self.sizes(n_ranks)
        c = self.cost
        raw_f, raw_b = _part(c.forward, "a", lengths), _part(c.backward, "a", lengths)
        if c.attention:  # attention terms per layer type (sliding, chunked, full)
            tf, tb = c._term_costs(lengths)
            raw_f, raw_b = raw_f + tf, raw_b + tb
        att_f = self._to_seconds(raw_f)
        att_b = self._to_seconds(raw_b) + (att_f if c.recompute else 0)
        n, k = lengths.shape[0], sizes.shape[0]
        out = [np.zeros((n, k)) for _ in range(3)]
        lat = np.zeros(k)
        hw = self.hardware
        kvb = self.kv_bytes_per_token()
        lf = lengths.astype(np.float64)
        pairs = lf * (lf + 1) / 2
        shares = self._shares(lengths, sizes, pairs)
        for j, g in enumerate(sizes.tolist()):
            if g == 1:
                continue
            padded = -(-lengths // (2 * g)) * (2 * g)
            share = shares[:, j]
            inside = g <= hw.gpus_per_node
            bw = hw.intra_node_bandwidth if inside else hw.inter_node_bandwidth
            lat[j] = (hw.intra_node_latency if inside else hw.inter_node_latency) * (g - 1) \
                * self.layers
            out[0][:, j] = (self._exchange_bytes(lengths, padded, g) / bw if self.kv_layers
                            else (g - 1) / g * padded * kvb / bw)
            out[1][:, j] = att_f * share
            out[2][:, j] = att_b * share
        return ExchangeParts(out[0], out[1], out[2], lat)

    def group_exposed(self, bytes_s: float, attn_f: float, attn_b: float, k: int,
                      latency: np.ndarray) -> float:
        """Exposed seconds of ONE exchange carrying several documents sharded together over a
        group of ``2^k`` ranks (their summed bandwidth seconds and attention, one latency per
        ring step per layer): what a ring / all-gather over a packed (THD) group microbatch
        costs, as Transformer Engine's CP attention and ``tools/train_cp.py`` run it."""
        hw = self.hardware
        t_f = bytes_s + float(latency[k])
        t_b = hw.backward_exchange * t_f + (t_f if self.cost.recompute else 0.0)
        return float(_exposed(np.float64(t_f), np.float64(attn_f), hw.overlap)
                     + _exposed(np.float64(t_b), np.float64(attn_b), hw.overlap))


class ExchangeParts(NamedTuple):
    """The pieces of the exposed exchange of every document on every group size (float64[n, K]
    each, column 0 zero), so that documents sharded together in one group microbatch can share
    one exchange (:meth:`CPCostModel.group_exposed`): ``bytes_s`` the forward exchange's
    bandwidth seconds, ``attn_f``/``attn_b`` the document's attention seconds per rank in the
    forward and backward pass; ``latency`` float64[K] the latency seconds of one forward
    exchange on a group of that size."""

    bytes_s: np.ndarray
    attn_f: np.ndarray
    attn_b: np.ndarray
    latency: np.ndarray


def _exposed(t: np.ndarray, attn: np.ndarray, overlap: float) -> np.ndarray:
    """Exposed seconds of an exchange of ``t`` seconds next to ``attn`` seconds of attention."""
    return (1.0 - overlap) * t + np.maximum(0.0, overlap * t - attn)


__all__ = ["CPCostModel", "CPCostTable", "CPHardware", "ExchangeParts", "KVLayers", "MAX_POOL"]
