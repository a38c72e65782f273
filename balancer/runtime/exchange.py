"""Moving samples between ranks: one ``all_to_all_single`` of bytes.

Every rank knows the step's plan, so every rank knows how many samples of which lengths go from
each rank to each other one; with the agreed :data:`~balancer.runtime.payload.Schema` it also
knows every message's size in bytes, so no sizes are sent. A message from rank s to rank d is,
field by field in schema order, the field's rows of the samples s sends to d (in d's entry order)
as raw bytes, each field padded to 8 bytes so that it decodes as a view of the receive buffer.

Backends: gloo (CPU tensors) and NCCL (CUDA tensors) both implement ``all_to_all_single`` with
uneven splits in torch >= 2.0 (checked on gloo with torch 2.13: uint8 buffers, uneven and empty
splits). The list form ``all_to_all`` works on gloo too; the single-buffer form is used because it
is one call whatever the number of fields. A sample that stays on its rank is copied locally, not
sent. When no sample changes rank the collective is skipped on every rank (they all know it).
"""
from __future__ import annotations

import time
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from .payload import Columns, Schema
from ..world import World

ALIGN = 8


def _pad(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def field_rows(schema: Schema, lengths: np.ndarray) -> list:
    """Rows of every field for samples of these lengths (tokens or samples)."""
    tokens, n = int(lengths.sum()), int(lengths.shape[0])
    return [tokens if f.kind == "token" else n for f in schema]


def message_bytes(schema: Schema, lengths: np.ndarray) -> int:
    """Bytes of one message carrying samples of ``lengths`` (int64[n])."""
    return sum(_pad(r * f.row_bytes) for f, r in zip(schema, field_rows(schema, lengths)))


def check_schema(schema: Schema) -> None:
    for f in schema:
        if f.row_bytes and torch.empty((), dtype=f.dtype).element_size() > ALIGN:
            raise ValueError(f"field {f.name!r}: dtype {f.dtype} is wider than {ALIGN} bytes")


def encode(cols: Columns, schema: Schema, device=None) -> torch.Tensor:
    """The message for ``cols``: uint8[message_bytes]."""
    chunks = []
    for f in schema:
        t = (cols.token if f.kind == "token" else cols.sample)[f.name]
        if t.dtype != f.dtype or tuple(t.shape[1:]) != tuple(f.trailing):
            raise ValueError(f"field {f.name!r}: {t.dtype} {tuple(t.shape[1:])} rows, the schema "
                             f"says {f.dtype} {tuple(f.trailing)}")
        b = t.contiguous().view(torch.uint8).reshape(-1) if t.numel() else \
            torch.zeros(0, dtype=torch.uint8, device=t.device)
        chunks.append(b)
        pad = _pad(b.numel()) - b.numel()
        if pad:
            chunks.append(torch.zeros(pad, dtype=torch.uint8, device=b.device))
    if not chunks:
        return torch.zeros(0, dtype=torch.uint8, device=device)
    return torch.cat(chunks)


def decode(buf: torch.Tensor, lengths: np.ndarray, schema: Schema) -> Columns:
    """Inverse of :func:`encode`; the fields are views of ``buf`` (which must start 8-byte
    aligned)."""
    tok, smp, o = {}, {}, 0
    for f, rows in zip(schema, field_rows(schema, lengths)):
        nb = rows * f.row_bytes
        if nb:
            t = buf[o:o + nb].view(f.dtype).reshape(rows, *f.trailing)
        else:
            t = torch.empty((rows, *f.trailing), dtype=f.dtype, device=buf.device)
        (tok if f.kind == "token" else smp)[f.name] = t
        o += _pad(nb)
    if o != buf.numel():
        raise ValueError(f"message of {buf.numel()} bytes, the schema and lengths give {o}")
    return Columns(lengths, tok, smp)


def all_to_all(parts: Sequence[Columns], recv_lengths: Sequence[np.ndarray], schema: Schema,
               moved: bool = True, group=None, device=None) -> tuple[list, dict]:
    """Send ``parts[d]`` to rank d and receive from every rank s the samples of
    ``recv_lengths[s]``. ``moved``: whether any sample changes rank at all (known to every
    rank from the plan; when False the collective is skipped everywhere). Returns (received
    Columns per source rank, stats: bytes this rank sent and received, seconds)."""
    world = len(parts)
    rank = World.current(group).rank if world > 1 else 0
    check_schema(schema)
    if device is None:  # where this rank's payload lives (CPU for gloo, CUDA for NCCL)
        mine = list(parts[rank].token.values()) + list(parts[rank].sample.values())
        device = mine[0].device if mine else None
    t0 = time.perf_counter()
    send_sizes = [0 if d == rank else message_bytes(schema, np.asarray(p.lengths))
                  for d, p in enumerate(parts)]
    recv_sizes = [0 if s == rank else message_bytes(schema, np.asarray(l))
                  for s, l in enumerate(recv_lengths)]
    out = [None] * world
    out[rank] = parts[rank]
    if moved:
        send = torch.cat([encode(parts[d], schema, device) for d in range(world) if d != rank] or
                         [torch.zeros(0, dtype=torch.uint8, device=device)])
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=send.device)
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
        o = 0
        for s in range(world):
            if s != rank:
                out[s] = decode(recv[o:o + recv_sizes[s]], np.asarray(recv_lengths[s]), schema)
                o += recv_sizes[s]
    else:
        for s in range(world):
            if s != rank:
                out[s] = decode(torch.zeros(0, dtype=torch.uint8, device=device),
                                np.asarray(recv_lengths[s]), schema)
    return out, {"bytes_sent": sum(send_sizes), "bytes_received": sum(recv_sizes),
                 "seconds": time.perf_counter() - t0, "collective": bool(moved)}
