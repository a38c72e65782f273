"""Per-sample metadata as a struct of arrays.

A :class:`SampleTable` holds one int64 token length per sample, and leaves room for multimodal
fields as CSR arrays (``mm_offsets`` int64[n + 1] into per-item arrays such as image token
counts), filled by the multimodal loader. Tables are built from a numpy array, a ``.npy`` file,
or a Hugging Face ``datasets.Dataset`` column read through Arrow without touching rows one by one.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field

import numpy as np

from packing.validate import as_sizes


class _DefaultColumn(str):
    """A column name nobody gave: the default ``"length"``, which falls back to a token column
    when the dataset has none (a name the caller gives must exist)."""

    def __repr__(self) -> str:
        return f"{str.__repr__(self)} (the default)"


#: ``length_column``'s default: ``"length"`` when the dataset has it, else a token column
DEFAULT_LENGTH_COLUMN = _DefaultColumn("length")


def is_default_column(name) -> bool:
    """Whether ``name`` is :data:`DEFAULT_LENGTH_COLUMN` (not a name someone gave)."""
    return isinstance(name, _DefaultColumn)


@dataclass(frozen=True)
class SampleTable:
    """Token length of every sample (int64[n], all >= 1), plus optional CSR multimodal fields."""

    lengths: np.ndarray
    #: optional per-sample modality items as CSR: name -> (offsets int64[n+1], values int64[k])
    extras: dict = field(default_factory=dict)

    def __post_init__(self):
        given = self.lengths
        lengths = as_sizes(given)
        if lengths.shape[0] == 0:
            raise ValueError("the dataset is empty: no samples to plan")
        if isinstance(given, np.ndarray) and np.may_share_memory(lengths, given):
            # never change (or alias writeable memory of) an array the caller still owns: a
            # writeable one is copied, a read-only one (a memory map) shared through our own view
            lengths = lengths.copy() if lengths.flags.writeable else lengths.view(np.ndarray)
        lengths.setflags(write=False)
        object.__setattr__(self, "lengths", lengths)
        # the fingerprint is kept once computed when the table owns its lengths (nobody can
        # change them); a shared read-only array (a memory map) is hashed every time
        object.__setattr__(self, "_fingerprint", None)

    def __len__(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())

    def fingerprint(self) -> str:
        """SHA-256 (hex, 16 chars) of the lengths: identifies the dataset a plan was made for."""
        if self._fingerprint is not None:
            return self._fingerprint
        a = np.ascontiguousarray(self.lengths, dtype="<i8")  # no copy: lengths are int64
        h = hashlib.sha256()
        step = 1 << 22  # hashed in 32 MiB blocks: no copy of the corpus (was 8 B/sample)
        for lo in range(0, a.shape[0], step):
            h.update(a[lo:lo + step].data)
        fp = h.hexdigest()[:16]
        if self.lengths.flags.owndata:
            object.__setattr__(self, "_fingerprint", fp)
        return fp

    # ---- constructors -------------------------------------------------------------------
    @classmethod
    def from_array(cls, lengths) -> "SampleTable":
        return cls(np.asarray(lengths))

    @classmethod
    def from_npy(cls, path: str | os.PathLike) -> "SampleTable":
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
        return cls(as_sizes(arr, source=os.fspath(path)))

    @classmethod
    def from_dataset(cls, ds, length_column: str | None = DEFAULT_LENGTH_COLUMN,
                     tokens_column: str | None = None, num_proc: int | None = None, *,
                     tokenizer=None, text_column: str | None = None) -> "SampleTable":
        """Lengths from a ``datasets.Dataset``: the integer column ``length_column`` read
        zero-copy from Arrow; or, when only token ids exist, computed with a batched
        ``map(num_proc=...)`` over ``tokens_column`` (list lengths from the Arrow offsets); or,
        with ``tokenizer`` (an object, or a name / local path for
        ``transformers.AutoTokenizer``), the token counts of ``text_column`` (default
        ``"text"``) in one ``map(num_proc=...)`` pass (:mod:`balancer.text_lengths`). A
        ``length_column`` named by the caller must exist unless another source (a token column,
        a tokenizer) is named too; only the default ``"length"`` falls back on its own, and
        ``None`` skips the length column."""
        import pyarrow as pa
        import pyarrow.compute as pc

        if length_column and length_column in ds.column_names:
            col = ds.data.table.column(length_column) if ds._indices is None else \
                ds.with_format("arrow")[length_column]
            return cls(_arrow_to_numpy(col))
        if length_column and not is_default_column(length_column) and tokens_column is None \
                and tokenizer is None and text_column is None:
            raise ValueError(f"dataset has no length column {str(length_column)!r} (columns: "
                             f"{ds.column_names}); name one of them, or leave length_column out "
                             f"to read the default 'length' or fall back to a token column")
        if tokenizer is not None or text_column is not None:
            if tokens_column is not None:
                raise ValueError("give tokens_column (token ids to measure) or tokenizer / "
                                 "text_column (raw text to count), not both")
            if tokenizer is None:
                raise ValueError(f"text_column={text_column!r} needs tokenizer= (an object or "
                                 f"a name / local path) to count its tokens")
            from .text_lengths import text_lengths
            return cls(text_lengths(ds, tokenizer, text_column or "text", num_proc=num_proc))
        if tokens_column is None:
            candidates = [c for c in ("input_ids", "tokens", "token_ids") if c in ds.column_names]
            if not candidates:
                raise ValueError(
                    f"dataset has neither a length column {length_column!r} nor a token column "
                    f"(columns: {ds.column_names}); for raw text give tokenizer= and "
                    f"text_column= (or run python -m balancer lengths --dataset PATH "
                    f"--tokenizer NAME --text-column COLUMN once), or keep len(input_ids) as a "
                    f"length column in your tokenization pass"
                )
            tokens_column = candidates[0]
        if tokens_column not in ds.column_names:
            raise ValueError(f"dataset has no column {tokens_column!r} (columns: {ds.column_names})")
        name = "__balancer_length"

        def _lengths(batch):
            arr = batch[tokens_column]
            if isinstance(arr, (pa.ChunkedArray, pa.Array)):
                return {name: pc.list_value_length(arr).to_numpy(zero_copy_only=False)}
            return {name: [len(x) for x in arr]}

        measured = ds.with_format("arrow").map(
            _lengths, batched=True, num_proc=num_proc, remove_columns=ds.column_names,
            desc="measuring sample lengths",
        )
        return cls(_arrow_to_numpy(measured.with_format("arrow")[name]))


def _arrow_to_numpy(col) -> np.ndarray:
    import pyarrow as pa

    if isinstance(col, pa.Table):
        col = col.column(0)
    if isinstance(col, pa.ChunkedArray):
        if col.null_count:
            i = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise ValueError(f"sample {i}: length is missing (null)")
        chunks = [c.to_numpy(zero_copy_only=False) for c in col.chunks]
        return np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
    return col.to_numpy(zero_copy_only=False)
