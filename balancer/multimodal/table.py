"""Multimodal samples: text tokens plus images, video clips and audio clips, as CSR arrays.

A sample's LLM sequence is its text tokens interleaved with the LLM tokens of its media items;
the encoders see more positions than the LLM does (``spatial_merge**2`` patches per vision token,
``positions_per_token`` audio positions per audio token). Every media item carries a grid
``(t, h, w)`` in *encoder positions* (Qwen2-VL's ``image_grid_thw`` convention: patches before the
spatial merge), from which both counts follow:

* encoder positions = ``t * h * w``;
* LLM tokens = ``t * h * w / merge**2`` for images and videos, ``ceil(w / pool)`` for audio.

Dynamic-resolution rule (Qwen2-VL, defaults): an ``H x W`` image gets
``ceil(H / 28) x ceil(W / 28)`` LLM tokens (28 = patch 14 x merge 2), rescaled keeping the aspect
ratio into ``[min_tokens, max_tokens]``; a fixed-resolution model (LLaVA) gives every image the
same grid (``fixed_size``). A video of ``F`` frames of ``H x W`` has ``ceil(F / temporal_patch)``
temporal patches of the per-frame grid; an audio clip of ``F`` mel frames has
``ceil(F / frames_per_position)`` encoder positions.

Media of a sample are numbered images first, then videos, then audio clips, each kind in the
order its markers appear in the text (the k-th image marker is the k-th image): the combined
"media id" of every item is its row in the CSR arrays below.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
from pydantic import BaseModel, Field, model_validator

from ..samples import SampleTable
from ..frozen import FROZEN

_FROZEN = FROZEN  # balancer.frozen: the one model_config

IMAGE, VIDEO, AUDIO = 0, 1, 2
KINDS = ("image", "video", "audio")


class VisionRule(BaseModel):
    """How many encoder patches and LLM tokens an image or video frame becomes."""

    model_config = _FROZEN
    patch_size: int = Field(14, gt=0, description="pixels per patch side (ViT patch)")
    spatial_merge: int = Field(2, gt=0, description="patches merged per side into one LLM token "
                                                    "(2: four patches -> one token)")
    temporal_patch: int = Field(2, gt=0, description="video frames per temporal patch")
    min_tokens: int = Field(4, gt=0, description="fewest LLM tokens per image / video frame")
    max_tokens: int = Field(16384, gt=0, description="most LLM tokens per image / video frame")
    fixed_size: Optional[int] = Field(
        None, gt=0, description="resize every image to this square side (LLaVA); None = dynamic "
                                "resolution")

    @model_validator(mode="after")
    def _check(self):
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens} exceeds max_tokens {self.max_tokens}")
        return self

    @property
    def factor(self) -> int:
        """Pixels per LLM token side (28 by default)."""
        return self.patch_size * self.spatial_merge

    def token_grid(self, h, w) -> tuple[np.ndarray, np.ndarray]:
        """LLM-token grid ``(gh, gw)`` (int64[k] each) of images ``h x w`` pixels."""
        h = _positive(h, "image height")
        w = _positive(w, "image width")
        if self.fixed_size is not None:
            g = -(-self.fixed_size // self.factor)
            return np.full(h.shape, g, np.int64), np.full(w.shape, g, np.int64)
        gh, gw = -(-h // self.factor), -(-w // self.factor)
        return self.clamp_grid(gh, gw)

    def clamp_grid(self, gh: np.ndarray, gw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rescale token grids, keeping the aspect ratio, so ``gh * gw`` is within
        ``[min_tokens, max_tokens]``."""
        gh, gw = gh.astype(np.int64).copy(), gw.astype(np.int64).copy()
        tok = (gh * gw).astype(np.float64)
        big = tok > self.max_tokens
        if big.any():
            s = np.sqrt(self.max_tokens / tok[big])
            gw[big] = np.maximum(1, np.floor(gw[big] * s)).astype(np.int64)
            gh[big] = np.maximum(1, np.floor(gh[big] * s)).astype(np.int64)
            # extreme aspect ratios: the floor of 1 on one side can leave the product too big
            lo_side = np.minimum(gh[big], gw[big])  # <= sqrt(max_tokens) after scaling
            cap = self.max_tokens // lo_side
            gh[big] = np.where(gh[big] >= gw[big], np.minimum(gh[big], cap), gh[big])
            gw[big] = np.where(gw[big] > gh[big], np.minimum(gw[big], cap), gw[big])
        small = (gh * gw) < self.min_tokens
        if small.any():
            s = np.sqrt(self.min_tokens / (gh[small] * gw[small]))
            gh[small] = np.ceil(gh[small] * s).astype(np.int64)
            gw[small] = np.ceil(gw[small] * s).astype(np.int64)
            # rounding up both sides can overshoot a narrow range: fit the longer side to the
            # shorter one, or make the shorter side 1 when no integer fits
            a, b = np.minimum(gh[small], gw[small]), np.maximum(gh[small], gw[small])
            lo_b, hi_b = -(-self.min_tokens // a), self.max_tokens // a
            empty = lo_b > hi_b
            a = np.where(empty, 1, a)
            b = np.where(empty, self.min_tokens, np.clip(b, lo_b, hi_b))
            tall = gh[small] >= gw[small]
            gh[small], gw[small] = np.where(tall, b, a), np.where(tall, a, b)
        return gh, gw

    def image_grids(self, h, w) -> np.ndarray:
        """``(t, h, w)`` patch grids (int64[k, 3]) of images ``h x w`` pixels."""
        gh, gw = self.token_grid(h, w)
        m = self.spatial_merge
        return np.stack([np.ones_like(gh), gh * m, gw * m], axis=1)

    def images_from_tokens(self, tokens) -> np.ndarray:
        """Patch grids of images known only by their LLM token count: a ``1 x tokens`` strip."""
        tok = _positive(tokens, "image token count")
        gh, gw = self.clamp_grid(np.ones_like(tok), tok)
        m = self.spatial_merge
        return np.stack([np.ones_like(gh), gh * m, gw * m], axis=1)

    def video_grids(self, frames, h, w) -> np.ndarray:
        """Patch grids of video clips of ``frames`` frames of ``h x w`` pixels."""
        f = _positive(frames, "video frame count")
        g = self.image_grids(h, w)
        g[:, 0] = -(-f // self.temporal_patch)
        return g


class AudioRule(BaseModel):
    """How many encoder positions and LLM tokens an audio clip becomes (Whisper-style encoder:
    100 mel frames per second, a stride-2 convolution, then pooling by 2: 25 tokens per second)."""

    model_config = _FROZEN
    frames_per_position: int = Field(2, gt=0, description="mel frames per encoder position")
    positions_per_token: int = Field(2, gt=0, description="encoder positions pooled per LLM token")

    def grids(self, frames) -> np.ndarray:
        f = _positive(frames, "audio frame count")
        pos = -(-f // self.frames_per_position)
        return np.stack([np.ones_like(pos), np.ones_like(pos), pos], axis=1)


class MediaRules(BaseModel):
    """The rules of every modality (the ``multimodal:`` section of a preset)."""

    model_config = _FROZEN
    vision: VisionRule = Field(default_factory=VisionRule, description="images and video")
    audio: AudioRule = Field(default_factory=AudioRule, description="audio clips")

    def llm_tokens(self, kind: np.ndarray, grid: np.ndarray) -> np.ndarray:
        """LLM tokens of media items (int64[k]) from their kinds and patch grids."""
        pos = grid[:, 0] * grid[:, 1] * grid[:, 2]
        m2 = self.vision.spatial_merge ** 2
        audio = -(-grid[:, 2] // self.audio.positions_per_token)
        return np.where(kind == AUDIO, audio, pos // m2).astype(np.int64)


def _positive(x, what: str) -> np.ndarray:
    a = np.atleast_1d(np.asarray(x))
    if a.dtype.kind not in "iu" and a.size:
        if not np.all(np.isfinite(a)) or not np.all(a == np.round(a)):
            i = int(np.flatnonzero(~np.isfinite(a) | (a != np.round(a)))[0])
            raise ValueError(f"item {i}: {what} {a[i]!r} is not an integer")
    a = a.astype(np.int64)
    if a.size and a.min() <= 0:
        i = int(np.argmin(a))
        raise ValueError(f"item {i}: {what} {int(a[i])} is not positive")
    return a


# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MultimodalTable:
    """Per-sample text tokens and media items (struct of arrays, CSR over samples).

    * ``text`` int64[n]: text tokens of every sample (markers excluded);
    * ``media_offsets`` int64[n + 1]: media of sample ``i`` are rows
      ``media_offsets[i]:media_offsets[i + 1]`` (images, then videos, then audio);
    * ``media_kind`` int8[K] (0 image, 1 video, 2 audio); ``media_grid`` int64[K, 3] ``(t, h, w)``
      in encoder positions; ``media_tokens`` int64[K]: LLM tokens of every item.
    """

    text: np.ndarray
    media_offsets: np.ndarray
    media_kind: np.ndarray
    media_grid: np.ndarray
    media_tokens: np.ndarray
    rules: MediaRules

    def __post_init__(self):
        n = self.text.shape[0]
        if n == 0:
            raise ValueError("the dataset is empty: no samples to plan")
        if self.media_offsets.shape != (n + 1,) or self.media_offsets[0] != 0:
            raise ValueError(f"media_offsets must be int64[{n + 1}] starting at 0")
        if (np.diff(self.media_offsets) < 0).any():
            raise ValueError("media_offsets must be non-decreasing")
        k = int(self.media_offsets[-1])
        for name in ("media_kind", "media_grid", "media_tokens"):
            if getattr(self, name).shape[0] != k:
                raise ValueError(f"{name} has {getattr(self, name).shape[0]} rows, expected {k}")
        if (self.text < 0).any():
            i = int(np.flatnonzero(self.text < 0)[0])
            raise ValueError(f"sample {i}: text length {int(self.text[i])} is negative")
        empty = np.flatnonzero(self.lengths <= 0)
        if empty.size:
            raise ValueError(f"sample {int(empty[0])}: no text and no media (length 0)")
        for a in (self.text, self.media_offsets, self.media_kind, self.media_grid,
                  self.media_tokens):
            a.setflags(write=False)

    def __len__(self) -> int:
        return int(self.text.shape[0])

    @property
    def n_media(self) -> int:
        return int(self.media_offsets[-1])

    @property
    def media_sample(self) -> np.ndarray:
        """Sample of every media item (int64[K])."""
        return np.repeat(np.arange(len(self), dtype=np.int64), np.diff(self.media_offsets))

    @property
    def media_positions(self) -> np.ndarray:
        """Encoder positions of every media item (int64[K]): ``t * h * w``."""
        g = self.media_grid
        return g[:, 0] * g[:, 1] * g[:, 2]

    def media_tokens_per_sample(self, kind: Optional[int] = None) -> np.ndarray:
        """LLM tokens of media per sample (int64[n]), of one kind or all."""
        w = self.media_tokens if kind is None else np.where(self.media_kind == kind,
                                                              self.media_tokens, 0)
        return np.bincount(self.media_sample, weights=w, minlength=len(self)).astype(np.int64)

    @property
    def lengths(self) -> np.ndarray:
        """LLM sequence length of every sample: text plus media tokens (int64[n])."""
        return self.text + self.media_tokens_per_sample()

    def media_of(self, sample: int) -> slice:
        return slice(int(self.media_offsets[sample]), int(self.media_offsets[sample + 1]))

    def to_sample_table(self) -> SampleTable:
        """The LLM view for the planner: lengths plus CSR extras (media tokens per item)."""
        return SampleTable(self.lengths, extras={
            "media_tokens": (self.media_offsets, self.media_tokens),
            "media_positions": (self.media_offsets, self.media_positions)})

    def with_grids(self, grid: np.ndarray) -> "MultimodalTable":
        """The same samples with new media grids (token counts follow)."""
        grid = np.ascontiguousarray(grid, np.int64)
        return MultimodalTable(self.text, self.media_offsets, self.media_kind, grid,
                               self.rules.llm_tokens(self.media_kind, grid), self.rules)

    # ---- constructors -----------------------------------------------------------------------
    @classmethod
    def build(cls, text, rules: Optional[MediaRules] = None, *, images=None, videos=None,
              audios=None) -> "MultimodalTable":
        """From per-kind CSR pairs ``(offsets int64[n + 1], grids int64[k, 3])``; a kind that
        is ``None`` has no items. Grids come from :class:`VisionRule` / :class:`AudioRule`."""
        rules = rules or MediaRules()
        raw = np.asarray(text)
        if raw.dtype.kind == "f":  # a fraction or NaN was truncated / wrapped before
            with np.errstate(invalid="ignore"):
                bad = np.flatnonzero(~np.isfinite(raw) | (raw != np.floor(raw)))
            if bad.size:
                i = int(bad[0])
                raise ValueError(f"sample {i}: text length {raw[i].item()!r} is not an integer")
        text = np.ascontiguousarray(raw, dtype=np.int64)
        n = text.shape[0]
        parts = []
        for kind, csr in ((IMAGE, images), (VIDEO, videos), (AUDIO, audios)):
            if csr is None:
                parts.append((np.zeros(n + 1, np.int64), np.zeros((0, 3), np.int64)))
                continue
            off, grid = np.asarray(csr[0], np.int64), np.asarray(csr[1], np.int64).reshape(-1, 3)
            if off.shape != (n + 1,) or off[0] != 0 or off[-1] != grid.shape[0] \
                    or (np.diff(off) < 0).any():
                raise ValueError(f"{KINDS[kind]} offsets must be int64[{n + 1}], non-decreasing "
                                 f"from 0 to the {grid.shape[0]} items")
            parts.append((off, grid))
        counts = np.stack([np.diff(p[0]) for p in parts], axis=1)  # [n, 3]
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(counts.sum(1), out=offsets[1:])
        k = int(offsets[-1])
        kind = np.empty(k, np.int8)
        grid = np.empty((k, 3), np.int64)
        before = np.zeros(n, np.int64)  # items of earlier kinds in the sample
        for kd, (off, g) in enumerate(parts):
            c = counts[:, kd]
            within = np.arange(g.shape[0]) - np.repeat(off[:-1], c)
            rows = np.repeat(offsets[:-1] + before, c) + within
            kind[rows] = kd
            grid[rows] = g
            before += c
        if k and grid.min() <= 0:
            raise ValueError(f"media item {int(np.argmin(grid.min(1)))}: grid has a dimension <= 0")
        return cls(text, offsets, kind, grid, rules.llm_tokens(kind, grid), rules)

    @classmethod
    def from_dataset(cls, ds, rules: Optional[MediaRules] = None, *,
                     text_column: str = "text_length", image_size_column: Optional[str] =
                     "image_sizes", image_tokens_column: Optional[str] = None,
                     video_column: Optional[str] = "video_shapes",
                     audio_column: Optional[str] = "audio_frames") -> "MultimodalTable":
        """From a ``datasets.Dataset`` read column-wise through Arrow (no per-row Python):

        * ``text_column``: int text tokens per sample;
        * ``image_size_column``: list of ``[height, width]`` pixels per sample, or
          ``image_tokens_column``: list of LLM token counts per image;
        * ``video_column``: list of ``[frames, height, width]`` per sample;
        * ``audio_column``: list of mel-frame counts per sample.
        A column left at its default name that is absent means no items of that kind (None:
        never read); a column named by the caller that is absent, or a near miss of a default
        name (``image_size``), is an error naming it and the dataset's columns."""
        rules = rules or MediaRules()
        cols = set(ds.column_names)
        if text_column not in cols:
            raise ValueError(f"dataset has no text length column {text_column!r} "
                             f"(columns: {ds.column_names})")
        image_size_column, image_tokens_column, video_column, audio_column = (
            _media_column(ds.column_names, name, what, default) for name, what, default in (
                (image_size_column, "image size", "image_sizes"),
                (image_tokens_column, "image tokens", None),
                (video_column, "video", "video_shapes"),
                (audio_column, "audio", "audio_frames")))
        table = ds.with_format("arrow")[:] if ds._indices is not None else ds.data.table
        text = _flat_ints(table.column(text_column), text_column)
        images = videos = audios = None
        if image_tokens_column and image_tokens_column in cols:
            off, vals = _list_column(table.column(image_tokens_column), image_tokens_column, 1)
            images = (off, rules.vision.images_from_tokens(vals) if vals.size else
                      np.zeros((0, 3), np.int64))
        elif image_size_column and image_size_column in cols:
            off, vals = _list_column(table.column(image_size_column), image_size_column, 2)
            images = (off, rules.vision.image_grids(vals[:, 0], vals[:, 1]) if vals.size else
                      np.zeros((0, 3), np.int64))
        if video_column and video_column in cols:
            off, vals = _list_column(table.column(video_column), video_column, 3)
            videos = (off, rules.vision.video_grids(vals[:, 0], vals[:, 1], vals[:, 2])
                      if vals.size else np.zeros((0, 3), np.int64))
        if audio_column and audio_column in cols:
            off, vals = _list_column(table.column(audio_column), audio_column, 1)
            audios = (off, rules.audio.grids(vals) if vals.size else np.zeros((0, 3), np.int64))
        return cls.build(text, rules, images=images, videos=videos, audios=audios)


_KEYWORDS = {"image size": "image_size_column", "image tokens": "image_tokens_column",
             "video": "video_column", "audio": "audio_column"}


def _media_column(columns: list, name: Optional[str], what: str,
                  default: Optional[str]) -> Optional[str]:
    """The media column to read (None: no items of that kind). A name the caller gave that the
    dataset lacks is an error naming it and the columns; the default name may be absent (no
    such media) unless a column is a near miss of it (``image_size`` for ``image_sizes``),
    which is an error too: reading no media silently is the failure this prevents."""
    import difflib
    if not name:
        return None
    if name in columns:
        return name
    key = _KEYWORDS[what]
    if name != default:
        raise ValueError(f"dataset has no {what} column {name!r} (columns: {sorted(columns)}); "
                         f"name one of them with {key}=, or {key}=None for none")
    near = difflib.get_close_matches(name, columns, n=1, cutoff=0.85)
    if near:
        raise ValueError(f"dataset has no {what} column {name!r} but has {near[0]!r} (columns: "
                         f"{sorted(columns)}); pass {key}={near[0]!r} to read it, or "
                         f"{key}=None for no {what} media")
    return None


def _flat_ints(col, name: str) -> np.ndarray:
    import pyarrow as pa
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if col.null_count:
        i = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValueError(f"sample {i}: column {name!r} is missing (null)")
    return np.asarray(col.to_numpy(zero_copy_only=False), dtype=np.int64)


def _list_column(col, name: str, width: int) -> tuple[np.ndarray, np.ndarray]:
    """A list column as CSR: ``(offsets int64[n + 1], values int64[k]`` or ``[k, width])``;
    rows of ``width > 1`` are nested fixed-size lists such as ``[height, width]``."""
    import pyarrow as pa
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if col.null_count:
        i = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValueError(f"sample {i}: column {name!r} is missing (null); use an empty list")
    off = np.asarray(col.offsets.to_numpy(), np.int64)
    off = off - off[0]
    inner = col.flatten()
    if width == 1:
        return off, _flat_ints(inner, name)
    sizes = np.diff(np.asarray(inner.offsets.to_numpy(), np.int64)) if len(inner) else \
        np.zeros(0, np.int64)
    bad = np.flatnonzero(sizes != width)
    if bad.size:
        s = int(np.searchsorted(off, bad[0], side="right") - 1)
        raise ValueError(f"sample {s}: column {name!r} holds an entry of {int(sizes[bad[0]])} "
                         f"numbers, expected {width}")
    vals = _flat_ints(inner.flatten(), name)
    return off, vals.reshape(-1, width)


__all__ = ["AUDIO", "AudioRule", "IMAGE", "KINDS", "MediaRules", "MultimodalTable", "VIDEO",
           "VisionRule"]
