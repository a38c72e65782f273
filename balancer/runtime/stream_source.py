"""What :class:`~balancer.runtime.stream.StreamingPackedDataset` needs to know about its source:
whether it can checkpoint itself (``state_dict``/``load_state_dict``), how to move it to an
epoch (its own ``set_epoch``, or that of the dataset a DataLoader source reads), and whether it
is a Hugging Face stream shuffled through a buffer -- whose ``state_dict()`` does not hold the
buffer, so the wrapper resumes it by re-reading instead (a digest of the shuffle's seed state
identifies the order)."""
from __future__ import annotations

import hashlib
from typing import Optional


def stateful(x) -> bool:
    return callable(getattr(x, "state_dict", None)) and callable(getattr(x, "load_state_dict", None))


def set_source_epoch(source, epoch: int) -> None:
    """``set_epoch`` of the source, or of the dataset a DataLoader source reads (a Hugging Face
    stream reshuffles per epoch)."""
    for x in (source, getattr(source, "dataset", None)):
        if callable(getattr(x, "set_epoch", None)):
            x.set_epoch(epoch)
            return


def shuffle_fingerprint(source) -> Optional[str]:
    """A digest of the seed state of the buffer shuffle of a Hugging Face ``IterableDataset``
    source (or of the dataset a DataLoader source reads), None when it has none. The buffer is
    not in the dataset's ``state_dict()`` (resuming from it loses and repeats rows); found by
    walking the examples iterables for datasets' ``BufferShuffledExamplesIterable``."""
    for ds in (source, getattr(source, "dataset", None)):
        ex = getattr(ds, "_ex_iterable", None)
        seen = 0
        while ex is not None and seen < 100:
            seen += 1
            if type(ex).__name__ == "BufferShuffledExamplesIterable":
                gen = getattr(ex, "generator", None)
                state = repr(getattr(getattr(gen, "bit_generator", None), "state", None))
                return hashlib.sha256(state.encode()).hexdigest()[:16]
            inner = getattr(ex, "ex_iterable", None)
            if inner is None:
                many = getattr(ex, "ex_iterables", None)
                inner = many[0] if many else None  # interleaved: the first source's chain
            ex = inner
    return None
