"""Cost models: forward and backward cost of documents and packed microbatches.

A pass over a packed microbatch with documents of lengths ``L_d`` costs
``sum_d (a * L_d**2 + b * L_d) + c``: ``a`` carries causal attention (quadratic in each
document, never across documents), ``b`` everything linear in tokens (GEMMs, norms, the LM head),
``c`` a per-microbatch constant (kernel launches, pipeline send/recv). Forward and backward have
their own coefficients because their ratio differs between the linear part (~2x) and attention
(~2.5x); full activation recompute adds one more forward to the backward.

Models come from a :class:`ModelSpec` (analytic FLOPs), from fitted coefficients, or by name:
the built-in ``quadratic-64k`` (forward ``L + L^2/65536``, backward twice that) or a YAML preset
in ``configs/models/``.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Optional

import math

import numpy as np
from pydantic import BaseModel, Field, ValidationError, model_serializer, model_validator

from packing.validate import MAX_LENGTH, as_sizes

from ..config import load_yaml
from .. import resources
from .attention import AttentionTerm
from .hf_config import cost_fields, read_config
from ..zigzag import padded_lengths, zigzag_attention
from ..frozen import FROZEN_FINITE, NoBoolNumbers

#: every float of a cost model must be finite (no inf / NaN: they would reach the planner's sums
#: and the manifest as ``Infinity``)
_FROZEN = FROZEN_FINITE  # balancer.frozen: the one model_config
#: bound of every integer size of an analytic model (hidden, layers, heads, ffn, vocab, ...)
MAX_DIM = 2 ** 24


def read_yaml(path, what: str = "file") -> dict:
    """:func:`balancer.config.load_yaml` (the one YAML reader; kept under this name for the
    cost and multimodal presets)."""
    return load_yaml(path, what)


def one_line(e: ValidationError, names: Optional[dict] = None) -> str:
    """A pydantic ValidationError as one line: ``field: message (got value)`` per error, with
    field names optionally mapped (e.g. to CLI flags)."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        loc = (names or {}).get(loc, loc)
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        got = f" (got {err['input']!r})" if "input" in err and not isinstance(
            err["input"], dict) else ""
        parts.append(f"{loc}: {msg}{got}" if loc else f"{msg}")
    return "; ".join(parts)


class PassCost(NoBoolNumbers):
    """Coefficients of one pass: ``a * L^2 + b * L + d`` per document plus ``c`` per
    microbatch."""

    model_config = _FROZEN
    a: float = Field(0.0, ge=0, description="quadratic (attention) cost per squared token")
    b: float = Field(0.0, ge=0, description="linear cost per token")
    c: float = Field(0.0, ge=0, description="fixed cost per microbatch")
    d: float = Field(0.0, ge=0, description="fixed cost per document (e.g. one attention call "
                                            "per document in per-document attention kernels)")

    def doc(self, lengths: np.ndarray) -> np.ndarray:
        """float64[n] cost of every document (int64[n] lengths): ``a * L^2 + b * L + d``,
        compiled (packing.doc_cost); an overflow gives inf, reported by
        CostModel.doc_costs."""
        from packing.doc_cost import pass_costs  # numba on first use, not at import
        return pass_costs(lengths, self.a, self.b, self.d)


def _part(pc: PassCost, keep: str, lengths: np.ndarray) -> np.ndarray:
    """One part of a pass's per-document cost (``"a"``: attention, ``"b"``: linear, ``"d"``:
    per-document constant), evaluated by :meth:`PassCost.doc` itself."""
    zero = {k: 0.0 for k in ("a", "b", "d") if k != keep}
    return pc.model_copy(update=zero).doc(lengths)


class ModelSpec(BaseModel):
    """A decoder-only transformer, enough to count its FLOPs and activation memory."""

    model_config = _FROZEN
    hidden: int = Field(gt=0, le=MAX_DIM, description="model width d_model")
    layers: int = Field(gt=0, le=MAX_DIM, description="number of transformer blocks")
    heads: int = Field(gt=0, le=MAX_DIM, description="attention (query) heads")
    kv_heads: Optional[int] = Field(None, gt=0, le=MAX_DIM,
                                    description="key/value heads (GQA); default heads")
    ffn: int = Field(gt=0, le=MAX_DIM, description="MLP inner width")
    vocab: int = Field(gt=0, le=2 ** 32, description="vocabulary size (LM head)")
    head_dim: Optional[int] = Field(None, gt=0, le=MAX_DIM,
                                    description="per-head width; default hidden/heads")
    gated_mlp: bool = Field(True, description="SwiGLU-style MLP with 3 matrices instead of 2")

    @model_validator(mode="after")
    def _check(self):
        kv = self.kv_heads or self.heads
        if self.heads % kv:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {kv}")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        return self

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def matmul_params(self) -> int:
        """Parameters that multiply every token: attention and MLP weights of all layers plus
        the LM head (embedding lookups cost no FLOPs)."""
        h, hd = self.hidden, self.hd
        kv = self.kv_heads or self.heads
        attn = h * self.heads * hd * 2 + h * kv * hd * 2  # q, o ; k, v
        mlp = (3 if self.gated_mlp else 2) * h * self.ffn
        return self.layers * (attn + mlp) + h * self.vocab

    def linear_flops_per_token(self) -> float:
        """Forward FLOPs per token of all matrix multiplies: 2 per parameter."""
        return 2.0 * self.matmul_params()

    def attention_flops_coeff(self) -> float:
        """Forward causal attention FLOPs per squared document length: QK^T and PV are
        ``4 * L^2 * heads * head_dim`` per layer, halved by the causal mask."""
        return self.layers * 4.0 * self.heads * self.hd / 2.0

    def activation_bytes_per_token(self, recompute: bool, bytes_per_value: int = 2) -> float:
        """Activation memory per token with flash attention (Korthikanti et al. 2022, the
        ``34 s b h`` term without the ``5 a s^2 b`` one), or only the layer inputs with full
        recompute."""
        per_layer = (2.0 if recompute else 34.0) * self.hidden * bytes_per_value / 2.0
        return self.layers * per_layer


class MemoryModel(BaseModel):
    """Memory of one GPU holding the whole model: ``fixed_bytes + bytes_per_token * tokens`` must
    fit ``device_bytes``; with pp stages each GPU holds 1/pp of both, with cp ranks 1/cp of the
    tokens."""

    model_config = _FROZEN
    bytes_per_token: float = Field(gt=0, description="activation bytes per token on one GPU")
    fixed_bytes: float = Field(0.0, ge=0, description="weights, gradients, optimizer state")
    device_bytes: float = Field(80e9, gt=0, description="usable device memory")

    def capacity(self, cp: int = 1, pp: int = 1) -> int:
        """Largest microbatch in tokens (whole CP group) that fits on every GPU."""
        free = self.device_bytes - self.fixed_bytes / pp
        if free <= 0:
            raise ValueError(f"fixed memory {self.fixed_bytes / pp:.3g} B per stage exceeds the "
                             f"device {self.device_bytes:.3g} B")
        # a memory bound above the largest supported capacity is no bound: clip it there
        return min(int(free // (self.bytes_per_token / pp)) * int(cp), MAX_LENGTH)


class CostModel(BaseModel):
    """Forward/backward cost of documents and microbatches, and the memory that bounds them."""

    model_config = _FROZEN
    name: str = Field("custom", description="preset name or a label for reports")
    unit: Literal["flops", "seconds", "tokens"] = Field("flops", description="unit of costs")
    forward: PassCost = Field(description="forward pass coefficients")
    backward: PassCost = Field(description="backward pass coefficients (without recompute)")
    recompute: bool = Field(False, description="full activation recompute: backward += forward")
    memory: Optional[MemoryModel] = Field(None, description="memory model giving the capacity")
    flops_per_second: Optional[float] = Field(
        None, gt=0, description="achieved FLOP/s, to turn FLOP costs into seconds")
    attention: tuple[AttentionTerm, ...] = Field(
        (), description="attention per layer type, per query-key pair (full causal, sliding "
                        "window, chunked local), added to the `a L^2` term: what a model with "
                        "mixed attention layers costs (balancer.cost.attention)")

    @model_validator(mode="after")
    def _not_all_zero(self):
        # every document would cost 0: imbalance is 0/0 (NaN) and every strategy looks equal
        coef = [getattr(p, k) for p in (self.forward, self.backward) for k in "abcd"]
        coef += [x for t in self.attention for x in (t.forward, t.backward)]
        if not any(coef):
            raise ValueError("every coefficient of the cost model is 0 (forward and backward "
                             "a, b, c, d and the attention terms): every microbatch would cost "
                             "0; give at least one positive coefficient")
        return self

    @model_serializer(mode="wrap")
    def _omit_no_terms(self, handler):
        # a model without attention terms serializes as before they existed (manifests, plan
        # hashes and stored CP plans of the existing presets stay byte-identical)
        out = handler(self)
        if not self.attention and isinstance(out, dict):
            out.pop("attention", None)
        return out

    def _term_costs(self, lengths: np.ndarray):
        """Forward and backward (no recompute) of the attention terms, float64[n] each."""
        fwd = np.zeros(lengths.shape[0])
        bwd = np.zeros(lengths.shape[0])
        for t in self.attention:
            p = t.pairs(lengths)
            fwd += t.forward * p
            bwd += t.backward * p
        return fwd, bwd

    # ---- evaluation -----------------------------------------------------------------------
    def doc_costs(self, lengths) -> tuple[np.ndarray, np.ndarray]:
        """Per-document ``(forward, backward)`` costs (float64[n]), without the per-microbatch
        constant; backward includes the recompute forward when enabled."""
        lengths = as_sizes(lengths)
        fwd = self.forward.doc(lengths)
        bwd = self.backward.doc(lengths)
        if self.attention:
            tf, tb = self._term_costs(lengths)
            fwd, bwd = fwd + tf, bwd + tb
        if self.recompute:
            bwd = bwd + fwd
        if fwd.size and not math.isfinite(float(fwd.sum()) + float(bwd.sum())):
            self._overflow(lengths, fwd, bwd)
        return fwd, bwd

    def _overflow(self, lengths, fwd, bwd):
        bad = np.flatnonzero(~np.isfinite(fwd + bwd))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"cost model {self.name!r}: sample {i} (length {int(lengths[i])}) "
                             f"costs {float(fwd[i] + bwd[i])!r}: the coefficients are too large "
                             f"for float64 (rescale them, e.g. to seconds)")
        raise ValueError(f"cost model {self.name!r}: the total cost of {lengths.shape[0]} "
                         f"documents overflows float64 (rescale the coefficients)")

    def doc_total(self, lengths) -> np.ndarray:
        """Forward plus backward cost per document: what the planner balances."""
        f, b = self.doc_costs(lengths)
        f += b
        return f

    @property
    def microbatch_constant(self) -> tuple[float, float]:
        c_b = self.backward.c + (self.forward.c if self.recompute else 0.0)
        return self.forward.c, c_b

    def microbatch_cost(self, lengths) -> tuple[float, float]:
        """``(forward, backward)`` of one packed microbatch with these document lengths."""
        f, b = self.doc_costs(lengths)
        cf, cb = self.microbatch_constant
        return float(f.sum() + cf), float(b.sum() + cb)

    def doc_parts(self, lengths) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per-document cost by part, float64[n] each: ``(attention forward, attention
        backward, linear forward + backward, per-document constant forward + backward)``, the
        recompute forward included; they sum to :meth:`doc_total` (the CP cost model scales
        attention and linear work differently per CP degree)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        f, b = self.forward, self.backward
        att_f = _part(f, "a", lengths)
        att_b = _part(b, "a", lengths)
        if self.attention:
            tf, tb = self._term_costs(lengths)
            att_f, att_b = att_f + tf, att_b + tb
        att_b = att_b + (att_f if self.recompute else 0.0)
        lin = _part(f, "b", lengths) + _part(b, "b", lengths)
        per_doc = _part(f, "d", lengths) + _part(b, "d", lengths)
        if self.recompute:
            lin = lin + _part(f, "b", lengths)
            per_doc = per_doc + _part(f, "d", lengths)
        return att_f, att_b, lin, per_doc

    def shard_costs(self, lengths, cp: int) -> tuple[np.ndarray, np.ndarray]:
        """``(whole float64[n], sharded float64[n, cp])``: forward plus backward of every
        document placed whole on one CP rank, and of each rank's zigzag shard of it (causal
        query-key pairs of the shard x the quadratic coefficient, plus the linear cost of its
        padded tokens / cp). The per-document and per-microbatch constants are left out: they
        do not depend on the placement (see :class:`~balancer.cost.protocol.CostFormula`)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        f, bw = self.forward, self.backward
        # a L^2 = 2 a x (query-key pairs L (L + 1) / 2) up to the linear term, per pass
        a_pairs = 2.0 * (f.a + bw.a + (f.a if self.recompute else 0.0))
        b = f.b + bw.b + (f.b if self.recompute else 0.0)
        lf = lengths.astype(np.float64)
        padded = padded_lengths(lengths, cp).astype(np.float64)
        whole = a_pairs * lf * (lf + 1) / 2 + b * lf
        sharded = a_pairs * zigzag_attention(lengths, cp) + (b * padded / cp)[:, None]
        for t in self.attention:  # each layer type's own pairs: a window moves the busiest rank
            k = t.forward + t.backward + (t.forward if self.recompute else 0.0)
            whole = whole + k * t.pairs(lengths)
            sharded = sharded + k * t.shard_pairs(lengths, cp)
        return whole, sharded

    @staticmethod
    def calibration_features(doc_lengths, offsets) -> np.ndarray:
        """float64[M, 4]: ``(sum L^2, sum L, 1, number of documents)`` of every microbatch,
        the columns of :class:`PassCost`'s ``a, b, c, d``."""
        lf = np.asarray(doc_lengths, dtype=np.float64)
        offsets = np.asarray(offsets, dtype=np.int64)
        if offsets.ndim != 1 or offsets.shape[0] < 2 or offsets[0] != 0 \
                or offsets[-1] != lf.shape[0] or (np.diff(offsets) < 1).any():
            raise ValueError(f"offsets must rise strictly from 0 to {lf.shape[0]} (one or more "
                             f"documents per microbatch), got {offsets[:8].tolist()}...")
        starts = offsets[:-1]
        x = np.empty((starts.shape[0], 4))
        x[:, 0] = np.add.reduceat(lf * lf, starts)
        x[:, 1] = np.add.reduceat(lf, starts)
        x[:, 2] = 1.0
        x[:, 3] = np.diff(offsets)
        return x

    def capacity(self, cp: int = 1, pp: int = 1) -> int:
        if self.memory is None:
            raise ValueError(f"cost model {self.name!r} has no memory model; give --capacity")
        return self.memory.capacity(cp, pp)

    def seconds(self, cost):
        """Costs in seconds when the model knows its throughput, otherwise unchanged."""
        if self.unit == "flops" and self.flops_per_second:
            return np.asarray(cost) / self.flops_per_second
        return cost

    # ---- constructors -----------------------------------------------------------------------
    @classmethod
    def from_model(cls, spec: ModelSpec, *, name: str = "analytic", recompute: bool = False,
                   attn_backward_ratio: float = 2.5, linear_backward_ratio: float = 2.0,
                   device_bytes: float = 80e9, fixed_bytes: Optional[float] = None,
                   flops_per_second: Optional[float] = None) -> "CostModel":
        """Analytic FLOPs and memory of one full model (a pipeline stage costs 1/pp of it)."""
        for k, v in (("attn_backward_ratio", attn_backward_ratio),
                     ("linear_backward_ratio", linear_backward_ratio)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{k} {v!r} must be a finite non-negative number")
        lin = spec.linear_flops_per_token()
        att = spec.attention_flops_coeff()
        if fixed_bytes is None:  # bf16 weights + grads; optimizer state sharded (ZeRO)
            fixed_bytes = 4.0 * (spec.matmul_params() + spec.hidden * spec.vocab)
        mem = MemoryModel(bytes_per_token=spec.activation_bytes_per_token(recompute),
                          fixed_bytes=fixed_bytes, device_bytes=device_bytes)
        return cls(name=name, unit="flops",
                   forward=PassCost(a=att, b=lin),
                   backward=PassCost(a=att * attn_backward_ratio, b=lin * linear_backward_ratio),
                   recompute=recompute, memory=mem, flops_per_second=flops_per_second)

    @classmethod
    def quadratic(cls, scale: int = 65536, backward_ratio: float = 2.0) -> "CostModel":
        """Forward ``L + L^2/scale`` per document, backward ``backward_ratio`` times that.
        ``scale`` a whole number of tokens >= 1, ``backward_ratio`` finite and >= 0 (else one
        ValueError naming the value)."""
        ok = not isinstance(scale, bool) and isinstance(scale, (int, float, np.integer,
                                                                np.floating))
        if not (ok and math.isfinite(scale) and scale >= 1 and float(scale).is_integer()):
            raise ValueError(f"CostModel.quadratic: scale {scale!r} is not a number of tokens "
                             f">= 1 (the length at which attention costs as much as the rest)")
        if isinstance(backward_ratio, bool) or not isinstance(
                backward_ratio, (int, float, np.integer, np.floating)) or \
                not math.isfinite(backward_ratio) or backward_ratio < 0:
            raise ValueError(f"CostModel.quadratic: backward_ratio {backward_ratio!r} is not a "
                             f"finite number >= 0")
        scale = int(scale)
        return cls(name=f"quadratic-{scale // 1024}k", unit="tokens",
                   forward=PassCost(a=1.0 / scale, b=1.0),
                   backward=PassCost(a=backward_ratio / scale, b=backward_ratio))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "CostModel":
        """A preset file: either fitted coefficients (``forward``/``backward`` with a, b, c) or
        ``model:`` (a :class:`ModelSpec`) plus options of :meth:`from_model`."""
        doc = read_yaml(path, "cost preset")
        doc.setdefault("name", Path(path).stem)
        try:
            if "hf_config" in doc:
                return _from_hf_preset(doc, Path(path))
            if "model" in doc:
                opts = dict(doc)
                model = opts.pop("model")
                if not isinstance(model, dict):
                    raise ValueError(f"model: expected a mapping, got {type(model).__name__}")
                spec = ModelSpec(**model)
                allowed = _MODEL_OPTIONS
                unknown = set(opts) - allowed
                if unknown:
                    raise ValueError(f"unknown keys {sorted(unknown)} (allowed: {sorted(allowed)})")
                opts.pop("description", None)
                opts.pop("source", None)
                return cls.from_model(spec, **opts)
            doc.pop("description", None)
            return cls(**doc)
        except ValidationError as e:
            raise ValueError(f"{path}: {one_line(e)}") from None
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from None


#: options of a preset built from a model (``model:`` or ``hf_config:``)
_MODEL_OPTIONS = {"name", "recompute", "attn_backward_ratio", "linear_backward_ratio",
                  "device_bytes", "fixed_bytes", "flops_per_second", "description", "source"}


def _from_hf_preset(doc: dict, path: Path) -> CostModel:
    """A preset whose model is a Hugging Face config: ``hf_config:`` a mapping (the
    config.json's contents) or a JSON file path (relative to the preset), plus the options of
    :func:`cost_model_from_config`; ``source:`` notes where the
    config came from."""
    opts = dict(doc)
    cfg = opts.pop("hf_config")
    if isinstance(cfg, str):
        cfg = read_config(path.parent / cfg if not Path(cfg).is_absolute() else cfg)
    if not isinstance(cfg, dict):
        raise ValueError(f"hf_config: expected a mapping or a JSON file, got "
                         f"{type(cfg).__name__}")
    unknown = set(opts) - _MODEL_OPTIONS
    if unknown:
        raise ValueError(f"unknown keys {sorted(unknown)} (allowed: "
                         f"{sorted(_MODEL_OPTIONS | {'hf_config'})})")
    opts.pop("description", None)
    opts.pop("source", None)
    return cost_model_from_config(cfg, where="hf_config", **opts)


def cost_model_from_config(cfg: dict, **options) -> CostModel:
    """The :class:`CostModel` of a Hugging Face config dict (``config.json``'s contents):
    :func:`balancer.cost.hf_config.cost_fields` with these options (name, where, recompute,
    attn_backward_ratio, linear_backward_ratio, device_bytes, fixed_bytes, flops_per_second,
    bytes_per_value)."""
    try:
        return CostModel(**cost_fields(cfg, **options))
    except ValidationError as e:
        raise ValueError(f"{options.get('where', 'config')}: {one_line(e)}") from None


def config_dir() -> Path:
    """Where new presets are written: ``$BALANCER_CONFIG_DIR``, the checkout's ``configs/`` or
    ``./configs`` (lookup also searches the presets shipped in the package)."""
    return resources.user_config_dir()


BUILTIN = {"quadratic-64k": lambda: CostModel.quadratic(65536)}
#: FLOP/s of a cost model loaded from a Hugging Face config.json (the presets' assumption)
JSON_FLOPS_PER_SECOND = 4.0e14


def available_presets() -> list[str]:
    return sorted(set(BUILTIN) | set(resources.preset_names("models")))


def preset_path(name_or_path: str, subdir: str) -> Optional[Path]:
    """A YAML file given by path, or the preset ``<subdir>/<name>.yaml`` (see
    :mod:`balancer.resources` for the lookup order); None if neither exists."""
    return resources.preset_path(name_or_path, subdir)


def hf_config_name(path, cfg) -> str:
    """The name of the cost model of the Hugging Face config file ``path``: its model type and
    where it is, ``"qwen3_moe (path/to/Qwen3-30B-A3B)"``: the folder of a ``config.json`` as
    given (the current folder's name for ``config.json`` alone), the repository of a hub cache
    snapshot (``.../models--Qwen--Qwen3-8B/snapshots/<hash>/config.json``: ``Qwen/Qwen3-8B``),
    the path without ``.json`` for another file name."""
    p = Path(os.path.normpath(str(path)))
    if p.name == "config.json":
        d = p.parent
        if d.parent.name == "snapshots" and d.parent.parent.name.startswith("models--"):
            where = d.parent.parent.name[len("models--"):].replace("--", "/")
        else:
            where = str(d) if str(d) != "." else (Path.cwd().name or str(Path.cwd()))
    else:
        where = str(p.with_suffix(""))
    mt = cfg.get("model_type") if isinstance(cfg, dict) else None
    return f"{mt if isinstance(mt, str) and mt else 'hf-config'} ({where})"


def load_cost_model(name_or_path: str) -> CostModel:
    """A built-in name, a preset name from ``configs/models``, a path to a YAML file, or a
    path to a Hugging Face ``config.json`` (:mod:`balancer.cost.hf_config`; named after the
    file, or its folder when the file is ``config.json``)."""
    if name_or_path in BUILTIN:
        return BUILTIN[name_or_path]()
    p = Path(str(name_or_path))
    if p.suffix == ".json":
        if not p.is_file():
            raise ValueError(f"model config {str(p)!r}: no such file")
        cfg = read_config(p)
        # a config.json says nothing of the hardware: the shipped presets' 400 TFLOP/s per GPU
        # (~40% MFU on an H100-class GPU) turns FLOPs into the seconds reports and CP need
        return cost_model_from_config(cfg, name=hf_config_name(p, cfg), where=str(p),
                                      flops_per_second=JSON_FLOPS_PER_SECOND)
    path = preset_path(name_or_path, "models")
    if path is None:
        raise ValueError(f"unknown cost model {name_or_path!r}: not a YAML file, not a "
                         f"Hugging Face config .json and not one of {available_presets()}")
    return CostModel.from_yaml(path)


def analytic_training_flops(spec: ModelSpec, lengths) -> float:
    """``6 N T + attention`` (attention forward plus 2.5x backward): the standard count."""
    lengths = np.asarray(lengths, dtype=np.float64)
    att = spec.attention_flops_coeff() * float((lengths ** 2).sum())
    return 6.0 * spec.matmul_params() * float(lengths.sum()) + 3.5 * att


__all__ = ["CostModel", "MemoryModel", "ModelSpec", "PassCost", "analytic_training_flops",
           "available_presets", "config_dir", "cost_model_from_config", "load_cost_model",
           "preset_path"]
