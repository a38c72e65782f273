"""Per-phase cost model of a multimodal LLM: encoders (vision, audio), projectors, and the LLM.

Phases of one training step, each with forward and backward FLOPs:

* **encoder** (per media item, attention never crosses items): ``2 * params`` FLOPs per position
  for the linear layers plus ``4 * heads * head_dim * sum_blocks(B^2)`` per layer for
  bidirectional attention, where the blocks are the whole item (full attention) or
  non-overlapping windows of ``window`` positions (windowed layers; Qwen2.5-VL, Whisper's 30 s);
* **projector** (per LLM token of the item): the merger MLP from ``merge**2`` patch features to
  the LLM width;
* **llm**: the :class:`~balancer.cost.CostModel` of the interleaved sequence (text plus media
  tokens), exactly what the text-only planner uses.

Backward is ``linear_backward_ratio`` (2) x the linear part plus ``attn_backward_ratio`` (2.5) x
attention, or 0 for a frozen encoder (its projector still trains). Memory per phase gives the
capacities: the LLM's token capacity (``CostModel.capacity``) and the encoder's positions per
encoder microbatch (:meth:`MMCostModel.encoder_capacity`).

Presets are YAML files in ``configs/multimodal/`` (kept apart from ``configs/models/`` so the
text-only loader never reads them)::

    llm: {model: {...}, recompute: false, device_bytes: ..., flops_per_second: ...}
    # or llm: {hf_config: {...config.json...} | file.json, recompute: ..., ...}
    multimodal:
      rules: {vision: {patch_size: 14, spatial_merge: 2, ...}, audio: {...}}
      vision: {encoder: {hidden, layers, heads, ffn, in_dim, ...}, projector: {...}}
      audio: {...}            # optional
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import numpy as np
from pydantic import BaseModel, Field, ValidationError

from ..cost.hf_config import read_config
from ..cost.model import (MAX_DIM, CostModel, ModelSpec, cost_model_from_config, one_line,
                          preset_path, read_yaml)
from ..resources import preset_names
from .table import AUDIO, MediaRules, MultimodalTable
from ..frozen import FROZEN_FINITE

#: floats finite (no inf / NaN), sizes bounded (MAX_DIM): see balancer.cost
_FROZEN = FROZEN_FINITE  # balancer.frozen: the one model_config


class EncoderSpec(BaseModel):
    """A bidirectional transformer encoder over one media item's positions."""

    model_config = _FROZEN
    hidden: int = Field(gt=0, le=MAX_DIM, description="encoder width")
    layers: int = Field(gt=0, le=MAX_DIM, description="encoder blocks")
    heads: int = Field(gt=0, le=MAX_DIM, description="attention heads")
    ffn: int = Field(gt=0, le=MAX_DIM, description="MLP inner width")
    gated_mlp: bool = Field(False, description="SwiGLU MLP (3 matrices) instead of 2")
    in_dim: int = Field(gt=0, le=MAX_DIM, description="input features per position (patch "
                                                      "pixels x channels, or mel bins x conv "
                                                      "width)")
    window: Optional[int] = Field(None, gt=0, le=2 ** 40, description="positions per attention "
                                  "window; None = full attention in every layer")
    full_attention_layers: int = Field(0, ge=0, le=MAX_DIM, description="layers with full "
                                                                        "attention when windowed")
    trainable: bool = Field(True, description="the encoder is trained (else backward is 0)")
    recompute: bool = Field(False, description="full activation recompute in the encoder")

    def linear_flops_per_position(self) -> float:
        h = self.hidden
        per_layer = 4 * h * h + (3 if self.gated_mlp else 2) * h * self.ffn
        return 2.0 * (self.layers * per_layer + self.in_dim * h)

    def attention_flops(self, positions: np.ndarray) -> np.ndarray:
        """Forward attention FLOPs of items of these position counts (float64[k])."""
        p = positions.astype(np.float64)
        full = p * p
        if self.window is None:
            return 4.0 * self.hidden * self.layers * full
        w = float(self.window)
        nfull = np.floor(p / w)
        rem = p - nfull * w
        win = nfull * w * w + rem * rem
        n_full = min(self.full_attention_layers, self.layers)
        return 4.0 * self.hidden * (n_full * full + (self.layers - n_full) * win)

    def activation_bytes_per_position(self, bytes_per_value: int = 2) -> float:
        return self.layers * (2.0 if self.recompute else 34.0) * self.hidden * bytes_per_value / 2

    def params(self) -> int:
        h = self.hidden
        return self.layers * (4 * h * h + (3 if self.gated_mlp else 2) * h * self.ffn) + \
            self.in_dim * h


class ProjectorSpec(BaseModel):
    """The MLP from merged encoder features to the LLM width, once per LLM token."""

    model_config = _FROZEN
    in_dim: int = Field(gt=0, le=MAX_DIM, description="input width (merge^2 x encoder hidden)")
    hidden: int = Field(gt=0, le=MAX_DIM, description="inner width")
    out_dim: int = Field(gt=0, le=MAX_DIM, description="LLM hidden size")

    def flops_per_token(self) -> float:
        return 2.0 * (self.in_dim * self.hidden + self.hidden * self.out_dim)


class ModalityCost(BaseModel):
    """Encoder plus projector of one modality."""

    model_config = _FROZEN
    encoder: EncoderSpec = Field(description="the encoder")
    projector: ProjectorSpec = Field(description="the projector to the LLM")


class MMCostModel(BaseModel):
    """Per-phase costs of a multimodal LLM (FLOPs); see the module docstring."""

    model_config = _FROZEN
    name: str = Field("custom-mm", description="preset name")
    llm: CostModel = Field(description="cost model of the LLM over the interleaved sequence")
    rules: MediaRules = Field(default_factory=MediaRules, description="media -> token rules")
    vision: Optional[ModalityCost] = Field(None, description="images and video")
    audio: Optional[ModalityCost] = Field(None, description="audio clips")
    attn_backward_ratio: float = Field(2.5, gt=0, description="attention backward / forward")
    linear_backward_ratio: float = Field(2.0, gt=0, description="linear backward / forward")
    encoder_device_bytes: float = Field(80e9, gt=0, description="usable memory of the GPU that "
                                                                "runs the encoders")

    def _modality(self, kind: int) -> ModalityCost:
        m = self.audio if kind == AUDIO else self.vision
        if m is None:
            raise ValueError(f"cost model {self.name!r} has no "
                             f"{'audio' if kind == AUDIO else 'vision'} encoder but the data "
                             f"holds {'audio clips' if kind == AUDIO else 'images/videos'}")
        return m

    # ---- encoder phase ------------------------------------------------------------------------
    def media_costs(self, kind: np.ndarray, positions: np.ndarray,
                    tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(forward, backward)`` of the encoder plus projector for each media item
        (float64[k] each) given its kind, encoder positions and LLM tokens."""
        k = kind.shape[0]
        fwd, bwd = np.zeros(k), np.zeros(k)
        for kd in np.unique(kind):
            sel = kind == kd
            mod = self._modality(int(kd))
            e = mod.encoder
            lin = e.linear_flops_per_position() * positions[sel].astype(np.float64)
            att = e.attention_flops(positions[sel])
            proj = mod.projector.flops_per_token() * tokens[sel].astype(np.float64)
            fwd[sel] = lin + att + proj
            eb = (self.linear_backward_ratio * lin + self.attn_backward_ratio * att
                  + (lin + att) * e.recompute) if e.trainable else 0.0
            bwd[sel] = eb + self.linear_backward_ratio * proj
        return fwd, bwd

    def table_media_costs(self, table: MultimodalTable) -> tuple[np.ndarray, np.ndarray]:
        return self.media_costs(table.media_kind, table.media_positions, table.media_tokens)

    def encoder_capacity(self, pp: int = 1) -> int:
        """Encoder positions one encoder microbatch may hold: the encoder and a 1/pp share of
        the LLM weights (bf16 weights and grads) must fit beside the activations."""
        enc = [m.encoder for m in (self.vision, self.audio) if m is not None]
        if not enc:
            raise ValueError(f"cost model {self.name!r} has no encoder")
        fixed = sum(4.0 * e.params() for e in enc)
        if self.llm.memory is not None:
            fixed += self.llm.memory.fixed_bytes / pp
        free = self.encoder_device_bytes - fixed
        if free <= 0:
            raise ValueError(f"encoder weights {fixed:.3g} B exceed the device")
        return int(free // max(e.activation_bytes_per_position() for e in enc))

    # ---- llm phase ----------------------------------------------------------------------------
    def capacity(self, cp: int = 1, pp: int = 1) -> int:
        """LLM tokens per microbatch (whole CP group)."""
        return self.llm.capacity(cp, pp)

    # ---- presets ------------------------------------------------------------------------------
    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "MMCostModel":
        doc = read_yaml(path, "multimodal preset")
        try:
            return cls._from_doc(doc, path)
        except ValidationError as e:
            raise ValueError(f"{path}: {one_line(e)}") from None
        except (ValueError, TypeError) as e:
            msg = str(e)
            raise ValueError(msg if msg.startswith(f"{path}:") else f"{path}: {msg}") from None

    @classmethod
    def _from_doc(cls, doc: dict, path) -> "MMCostModel":
        doc.pop("description", None)
        name = doc.pop("name", Path(path).stem)
        unknown = set(doc) - {"llm", "multimodal"}
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)} (allowed: llm, multimodal)")
        if not isinstance(doc.get("llm") or {}, dict):
            raise ValueError(f"llm: expected a mapping, got {type(doc['llm']).__name__}")
        llm = dict(doc.get("llm") or {})
        if "hf_config" in llm:  # the LLM from a Hugging Face config (mapping or JSON file)
            cfg = llm.pop("hf_config")
            if isinstance(cfg, str):
                cfg = read_config(Path(path).parent / cfg)
            llm.pop("description", None)
            llm.pop("source", None)
            llm_cost = cost_model_from_config(cfg, name=f"{name}-llm", where="llm.hf_config",
                                              **llm)
        elif "model" in llm:
            spec = ModelSpec(**llm.pop("model"))
            llm.pop("description", None)
            llm_cost = CostModel.from_model(spec, name=f"{name}-llm", **llm)
        else:
            llm_cost = CostModel(**{"name": f"{name}-llm", **llm})
        mm = dict(doc.get("multimodal") or {})
        if llm_cost.unit != "flops":
            raise ValueError(f"{path}: the LLM cost must be in flops to add encoder FLOPs")
        return cls(name=name, llm=llm_cost, **mm)


def available_presets() -> list[str]:
    return preset_names("multimodal")


def load_mm_cost_model(name_or_path: str) -> MMCostModel:
    """A preset name from ``configs/multimodal`` or a path to a YAML file."""
    path = preset_path(name_or_path, "multimodal")
    if path is None:
        raise ValueError(f"unknown multimodal cost model {name_or_path!r}: not a YAML file and "
                         f"not one of {available_presets()}")
    return MMCostModel.from_yaml(path)


__all__ = ["EncoderSpec", "MMCostModel", "ModalityCost", "ProjectorSpec", "available_presets",
           "load_mm_cost_model"]
