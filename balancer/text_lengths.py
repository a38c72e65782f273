"""Sample lengths from raw text: count tokens with the training tokenizer in one parallel pass
(``datasets.map(num_proc=...)`` with its progress bar) and keep the count as a length column.

The planner needs one integer per sample: the number of tokens it trains on. A dataset that
is still text gets it from the tokenizer. The cheapest route is the tokenization pass users
already run: add ``"length": len(input_ids)`` to its output and every later tool reads that
column zero-copy. Where no such pass exists, :func:`token_lengths` runs one that counts only
(no token ids kept), and ``python -m balancer lengths`` does the same from the command line,
writing a ``.npy`` for ``precompute --lengths`` and / or the dataset with its length column.

A tokenizer here is a Hugging Face tokenizer (an object, or a name / local path that
``transformers.AutoTokenizer.from_pretrained`` loads), a ``tokenizers.Tokenizer``, or any
callable mapping a list of strings to a list of token-id sequences. Nothing is truncated: a
text longer than the model's maximum gets its full count, and the planner decides
(``over_length``).
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

#: what :func:`token_lengths` adds when no other name is given
LENGTH_COLUMN = "length"


def load_tokenizer(spec: Any):
    """``spec`` as a tokenizer: a string is a name or local directory for
    ``transformers.AutoTokenizer.from_pretrained``; anything else is returned as it is."""
    if not isinstance(spec, str):
        return spec
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(f"tokenizer {spec!r}: loading a tokenizer by name needs transformers "
                         f"(pip install transformers), or pass a tokenizer object") from None
    try:
        return AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError) as e:
        msg = " ".join(str(e).split())
        raise ValueError(f"tokenizer {spec!r} could not be loaded: {msg}") from None


class _Counter:
    """Picklable ``batch -> {column: token counts}`` for ``datasets.map`` (sent to num_proc
    processes)."""

    def __init__(self, tokenizer, text_column: str, length_column: str,
                 add_special_tokens: bool):
        self.tokenizer, self.text_column = tokenizer, text_column
        self.length_column, self.add_special_tokens = length_column, add_special_tokens

    def __call__(self, batch: dict, indices: Optional[list] = None) -> dict:
        return {self.length_column: count_tokens(self.tokenizer, batch[self.text_column],
                                                 add_special_tokens=self.add_special_tokens,
                                                 rows=indices, column=self.text_column)}


def count_tokens(tokenizer, texts: list, *, add_special_tokens: bool = True,
                 rows: Optional[list] = None, column: str = "text") -> list[int]:
    """Token counts of ``texts`` (a list of strings) under ``tokenizer``; a text that is not a
    string (None, a number) is an error naming its sample (``rows``: the dataset row of each
    text; default its position in ``texts``)."""
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            row = i if rows is None else int(rows[i])
            raise ValueError(f"sample {row}: text column {column!r} holds {type(t).__name__} "
                             f"{t!r:.40}, not a string")
    texts = list(texts)
    if _is_tokenizers(tokenizer):  # a tokenizers.Tokenizer
        enc = tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [len(e.ids) for e in enc]
    if hasattr(tokenizer, "model_max_length"):  # a transformers tokenizer: never truncate
        out = tokenizer(texts, add_special_tokens=add_special_tokens, truncation=False,
                        return_attention_mask=False, return_token_type_ids=False,
                        verbose=False)
        return [len(x) for x in out["input_ids"]]
    return [len(x) for x in tokenizer(texts)]


def _is_tokenizers(tok) -> bool:
    return type(tok).__module__.split(".")[0] == "tokenizers"


def token_lengths(ds, tokenizer, text_column: str = "text", *,
                  length_column: str = LENGTH_COLUMN, num_proc: Optional[int] = None,
                  batch_size: int = 1000, add_special_tokens: bool = True,
                  progress: bool = True):
    """``ds`` (a ``datasets.Dataset``) with a new int64 column ``length_column``: the number of
    tokens ``tokenizer`` makes of every row's ``text_column``, counted by ``ds.map`` in
    batches of ``batch_size`` over ``num_proc`` processes (its progress bar unless
    ``progress=False``). The dataset's other columns are kept; no token ids are stored."""
    import datasets
    if text_column not in ds.column_names:
        raise ValueError(f"dataset has no text column {text_column!r} (columns: "
                         f"{ds.column_names}); give the column holding the raw text")
    if length_column in ds.column_names:
        raise ValueError(f"dataset already has a column {length_column!r}; read it with "
                         f"SampleTable.from_dataset(ds, {length_column!r}) or name another "
                         f"length column")
    counter = _Counter(load_tokenizer(tokenizer), text_column, length_column,
                       add_special_tokens)
    features = ds.features.copy()
    features[length_column] = datasets.Value("int64")
    was = datasets.is_progress_bar_enabled()
    if not progress:
        datasets.disable_progress_bar()
    try:
        return ds.map(counter, batched=True, with_indices=True, batch_size=batch_size,
                      num_proc=num_proc,
                      features=features, desc=f"counting tokens of {text_column!r}")
    finally:
        if was and not progress:
            datasets.enable_progress_bar()


def text_lengths(ds, tokenizer, text_column: str = "text", **kw) -> np.ndarray:
    """The token counts of :func:`token_lengths` as an int64 array (one per row)."""
    col = kw.pop("length_column", LENGTH_COLUMN)
    measured = token_lengths(ds, tokenizer, text_column, length_column=col, **kw)
    arrow = measured.with_format("arrow")[col]  # int64, no nulls: the counter wrote every row
    chunks = [c.to_numpy(zero_copy_only=False) for c in getattr(arrow, "chunks", [arrow])]
    return np.concatenate(chunks).astype(np.int64, copy=False) if chunks else \
        np.zeros(0, np.int64)

