"""Seeded generator of realistic multimodal mixes, parameterised by ``configs/workloads/
multimodal-*.yaml``.

A workload is a mixture of *sources* (captioned images, interleaved image-text documents,
high-resolution document/OCR pages, video clips, audio clips, plain text), each with its own
text-length, media-count and media-size distributions. The mixture proportions are redrawn every
``block_samples`` samples from a Dirichlet around the configured weights (lower
``concentration`` = proportions vary more), so consecutive batches differ in modality
composition the way streamed multi-source data does. Everything is vectorised numpy from one
seeded generator: the same (config, n, seed) gives the same table.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import yaml
from pydantic import BaseModel, Field

from ..resources import preset_names, preset_path
from .table import MediaRules, MultimodalTable
from ..frozen import FROZEN

_FROZEN = FROZEN  # balancer.frozen: the one model_config


class LogNormal(BaseModel):
    """A lognormal with median ``median`` and log-space deviation ``sigma``, clipped."""

    model_config = _FROZEN
    median: float = Field(gt=0, description="median")
    sigma: float = Field(0.5, ge=0, description="standard deviation of the log")
    min: float = Field(1, gt=0, description="smallest value")
    max: float = Field(1e9, gt=0, description="largest value")

    def draw(self, rng, n: int) -> np.ndarray:
        x = rng.lognormal(np.log(self.median), self.sigma, n) if self.sigma else \
            np.full(n, self.median)
        return np.clip(np.round(x), self.min, self.max).astype(np.int64)


class Count(BaseModel):
    """Items per sample: ``min + Poisson(mean - min)`` clipped to ``max``."""

    model_config = _FROZEN
    min: int = Field(0, ge=0, description="fewest items")
    max: int = Field(0, ge=0, description="most items")
    mean: float = Field(0.0, ge=0, description="mean before clipping")

    def draw(self, rng, n: int) -> np.ndarray:
        lam = max(self.mean - self.min, 0.0)
        c = self.min + (rng.poisson(lam, n) if lam > 0 else np.zeros(n, np.int64))
        return np.clip(c, self.min, self.max).astype(np.int64)


class ImageDist(BaseModel):
    model_config = _FROZEN
    count: Count = Field(default_factory=Count, description="images per sample")
    side: LogNormal = Field(default_factory=lambda: LogNormal(median=512),
                            description="geometric mean of height and width (pixels)")
    aspect_sigma: float = Field(0.3, ge=0, description="log-space spread of height / width")


class VideoDist(BaseModel):
    model_config = _FROZEN
    count: Count = Field(default_factory=Count, description="clips per sample")
    frames: LogNormal = Field(default_factory=lambda: LogNormal(median=16),
                              description="frames per clip (after frame sampling)")
    side: LogNormal = Field(default_factory=lambda: LogNormal(median=448, sigma=0.1),
                            description="frame side (pixels)")


class AudioDist(BaseModel):
    model_config = _FROZEN
    count: Count = Field(default_factory=Count, description="clips per sample")
    seconds: LogNormal = Field(default_factory=lambda: LogNormal(median=10),
                               description="clip duration (s)")
    frames_per_second: int = Field(100, gt=0, description="mel frames per second")


class Source(BaseModel):
    """One data source of the mix."""

    model_config = _FROZEN
    weight: float = Field(gt=0, description="mean share of samples")
    text: LogNormal = Field(description="text tokens per sample")
    images: ImageDist = Field(default_factory=ImageDist, description="images")
    videos: VideoDist = Field(default_factory=VideoDist, description="video clips")
    audio: AudioDist = Field(default_factory=AudioDist, description="audio clips")


class MMWorkload(BaseModel):
    """A multimodal workload (a ``configs/workloads/multimodal-*.yaml`` file)."""

    model_config = _FROZEN
    description: str = Field("", description="what it models")
    samples: int = Field(100_000, gt=0, description="default number of samples")
    seed: int = Field(0, description="default seed")
    block_samples: int = Field(256, gt=0, description="samples between redraws of the mix")
    concentration: float = Field(4.0, gt=0, description="Dirichlet concentration of the mix "
                                                        "around the weights")
    sources: dict[str, Source] = Field(description="the sources by name")

    def generate(self, rules: Optional[MediaRules] = None, n: Optional[int] = None,
                 seed: Optional[int] = None) -> MultimodalTable:
        """A :class:`MultimodalTable` of ``n`` samples (default ``samples``)."""
        n = int(n or self.samples)
        rng = np.random.default_rng(self.seed if seed is None else seed)
        names = list(self.sources)
        src = [self.sources[k] for k in names]
        w = np.array([s.weight for s in src], dtype=np.float64)
        w /= w.sum()
        n_blocks = -(-n // self.block_samples)
        mix = rng.dirichlet(self.concentration * w * len(w), n_blocks)
        cum = np.cumsum(mix, axis=1)
        block = np.arange(n) // self.block_samples
        which = (rng.random(n)[:, None] > cum[block]).sum(1)
        which = np.minimum(which, len(src) - 1)
        text = np.zeros(n, np.int64)
        n_img, n_vid, n_aud = (np.zeros(n, np.int64) for _ in range(3))
        for k, s in enumerate(src):
            idx = np.flatnonzero(which == k)
            text[idx] = s.text.draw(rng, idx.size)
            n_img[idx] = s.images.count.draw(rng, idx.size)
            n_vid[idx] = s.videos.count.draw(rng, idx.size)
            n_aud[idx] = s.audio.count.draw(rng, idx.size)
        img_src = np.repeat(which, n_img)
        vid_src = np.repeat(which, n_vid)
        aud_src = np.repeat(which, n_aud)
        hw = np.zeros((img_src.size, 2), np.int64)
        fhw = np.zeros((vid_src.size, 3), np.int64)
        afr = np.zeros(aud_src.size, np.int64)
        for k, s in enumerate(src):
            i = np.flatnonzero(img_src == k)
            if i.size:
                side = s.images.side.draw(rng, i.size).astype(np.float64)
                asp = np.exp(rng.normal(0.0, s.images.aspect_sigma, i.size))
                hw[i, 0] = np.maximum(1, np.round(side * np.sqrt(asp)))
                hw[i, 1] = np.maximum(1, np.round(side / np.sqrt(asp)))
            i = np.flatnonzero(vid_src == k)
            if i.size:
                fhw[i, 0] = s.videos.frames.draw(rng, i.size)
                side = s.videos.side.draw(rng, i.size)
                fhw[i, 1] = side
                fhw[i, 2] = np.round(side * 16 / 9)
            i = np.flatnonzero(aud_src == k)
            if i.size:
                afr[i] = s.audio.seconds.draw(rng, i.size) * s.audio.frames_per_second
        rules = rules or MediaRules()
        text = np.where((n_img + n_vid + n_aud == 0) & (text == 0), 1, text)

        def csr(counts):
            off = np.zeros(n + 1, np.int64)
            np.cumsum(counts, out=off[1:])
            return off

        return MultimodalTable.build(
            text, rules,
            images=(csr(n_img), rules.vision.image_grids(hw[:, 0], hw[:, 1]) if hw.size else
                    np.zeros((0, 3), np.int64)),
            videos=(csr(n_vid), rules.vision.video_grids(fhw[:, 0], fhw[:, 1], fhw[:, 2])
                    if fhw.size else np.zeros((0, 3), np.int64)),
            audios=(csr(n_aud), rules.audio.grids(afr) if afr.size else
                    np.zeros((0, 3), np.int64)))


def available() -> list[str]:
    return preset_names("workloads", "multimodal-*.yaml")


def load_workload(name_or_path: str) -> MMWorkload:
    """A ``configs/workloads/<name>.yaml`` name or a YAML path."""
    p = preset_path(name_or_path, "workloads")
    if p is None:
        raise ValueError(f"unknown multimodal workload {name_or_path!r}; known: {available()}")
    with open(p) as f:
        doc = yaml.safe_load(f) or {}
    return MMWorkload(**doc)


def generate(name_or_path: str, rules: Optional[MediaRules] = None, n: Optional[int] = None,
             seed: Optional[int] = None) -> MultimodalTable:
    return load_workload(name_or_path).generate(rules, n, seed)


__all__ = ["MMWorkload", "Source", "available", "generate", "load_workload"]
