"""torch.distributed.pipelining: one optimizer step of this rank's packed microbatches, as a
pipeline schedule (``ScheduleGPipe``, ``Schedule1F1B``, ...) takes it.

A schedule is built for a fixed ``n_microbatches`` and splits each tensor it is given along
dim 0 into that many chunks; the loader yields one packed (THD) microbatch at a time, of varying
length, and a plan's last step may have fewer microbatches. :func:`pipeline_steps` groups the
loader's microbatches by step and stacks them:

* every row is one microbatch padded to ``seq_len`` tokens (token ``pad_token_id``, position
  counting on from the last document, target -100, document id -1), shape ``[M, seq_len]``;
* a step with fewer microbatches than ``n_microbatches`` (the short last step) gets rows that
  are all padding (target -100 everywhere): they run through the pipeline, their loss and
  gradient are zero, so the schedule built for the full count runs every step unchanged;
* the target is ``shift_labels`` (the next token of the same document, -100 at each
  document's last token and on padding): a row's loss needs no shift, no row boundary matters.

The gradient: the schedule calls ``loss_fn(output, target, **loss_kwargs)`` per microbatch and,
with its default ``scale_grads=True``, divides the gradients by ``n_microbatches`` at the end;
a DDP/FSDP wrapper over the DP ranks then averages them. :func:`pipeline_loss` is the summed
token cross entropy of one row times ``step.loss_kwargs["scale"]`` =
``n_microbatches (scale_grads=True) x dp_average / step_loss_tokens``, so the step's gradient is
the global batch's token mean, exactly as the unpacked model's (tested with both schedules and
both ``scale_grads`` on CPU gloo: one stage, and two stages in two processes)::

    schedule = Schedule1F1B(stage, n_microbatches=layout.microbatches, loss_fn=pipeline_loss)
    for step in pipeline_steps(loader, layout.microbatches, seq_len=layout.capacity):
        if first_stage:
            schedule.step(step.input_ids, target=step.target, loss_kwargs=step.loss_kwargs)
        else:
            schedule.step(target=step.target, loss_kwargs=step.loss_kwargs)
        optimizer.step(); optimizer.zero_grad()

Pass ``position_ids`` to the stages that need them (``step.position_ids``, the same shape):
with attention, a row holds several documents, and the model must not attend across them --
e.g. a flash-attention varlen path that derives the boundaries from ``position_ids``, or a
mask from ``step.document_ids``. Only the first stage's positional arguments travel through the
pipeline; keyword arguments of ``schedule.step`` are split into the same rows and given to that
process's stage, so each stage passes the ones its module takes::

    if first_stage:   # module.forward(input_ids, position_ids)
        schedule.step(step.input_ids, position_ids=step.position_ids)
    else:             # module.forward(hidden, document_ids): masks attention per document
        schedule.step(document_ids=step.document_ids, target=step.target,
                      loss_kwargs=step.loss_kwargs) Under CP the rows are this rank's shards (``cp_index`` in the
batches); pad ``seq_len`` to the shard capacity.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

IGNORE = -100


@dataclass(frozen=True)
class PipelineStep:
    """One optimizer step of this rank, stacked (M = ``n_microbatches``, S = ``seq_len``):

    * ``input_ids`` int64[M, S], ``position_ids`` int64[M, S], ``target`` int64[M, S]
      (next token of the same document, -100 where nothing is predicted), ``document_ids``
      int32[M, S] (index of the document in its row, -1 on padding);
    * ``epoch``, ``step``; ``microbatches``: the real rows (the rest are padding);
    * ``step_loss_tokens``: labelled tokens of the whole step over every DP rank;
    * ``loss_kwargs``: ``{"scale": ...}`` for ``schedule.step(loss_kwargs=...)`` (see the
      module docstring)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    target: torch.Tensor
    document_ids: torch.Tensor
    epoch: int
    step: int
    microbatches: int
    step_loss_tokens: int
    loss_kwargs: dict


def pipeline_loss(output: torch.Tensor, target: torch.Tensor, *, scale: float) -> torch.Tensor:
    """The schedule's ``loss_fn``: summed token cross entropy of one microbatch (``output``
    float[..., S, V] logits, ``target`` int64[..., S], -100 ignored) times ``scale``
    (``step.loss_kwargs``). Computed in float32 at least."""
    logits = output.reshape(-1, output.shape[-1])
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    loss = torch.nn.functional.cross_entropy(logits, target.reshape(-1), ignore_index=IGNORE,
                                             reduction="sum")
    return loss * scale


def pipeline_steps(batches: Iterable[dict], n_microbatches: int, seq_len: int, *,
                   scale_grads: bool = True, dp_average: int = 1,
                   pad_token_id: int = 0) -> Iterator[PipelineStep]:
    """Group this rank's collated microbatches (a loader of :class:`PackedCollator` batches)
    into :class:`PipelineStep` s, one per plan step, each ``n_microbatches`` rows of
    ``seq_len`` tokens. ``scale_grads``: as the schedule's (default True: it divides the
    gradients by ``n_microbatches``); ``dp_average``: the ranks a DDP/FSDP wrapper averages the
    gradients over (the DP size; 1 when nothing averages). A microbatch longer than
    ``seq_len``, a step of more than ``n_microbatches`` microbatches, or a step left
    unfinished is a ValueError naming it."""
    if n_microbatches < 1 or seq_len < 1 or dp_average < 1:
        raise ValueError(f"n_microbatches {n_microbatches}, seq_len {seq_len} and dp_average "
                         f"{dp_average} must be >= 1")
    pending: list = []
    for b in batches:
        if pending and (int(b["step"]), int(b["epoch"])) != (int(pending[0]["step"]),
                                                            int(pending[0]["epoch"])):
            raise ValueError(f"step {int(pending[0]['step'])} ended without its last microbatch "
                             f"(last_in_step): {len(pending)} of "
                             f"{int(pending[0]['step_microbatches'])} arrived")
        pending.append(b)
        if bool(b["last_in_step"]):
            yield _stack(pending, n_microbatches, seq_len, scale_grads, dp_average, pad_token_id)
            pending = []
    if pending:
        raise ValueError(f"the loader ended inside step {int(pending[0]['step'])}: "
                         f"{len(pending)} of {int(pending[0]['step_microbatches'])} microbatches")


def _stack(mbs, m, seq_len, scale_grads, dp_average, pad) -> PipelineStep:
    first = mbs[0]
    if len(mbs) > m:
        raise ValueError(f"step {int(first['step'])} has {len(mbs)} microbatches on this rank but "
                         f"the schedule was built for n_microbatches={m} (use the layout's "
                         f"microbatches)")
    ids = torch.full((m, seq_len), pad, dtype=torch.int64)
    tgt = torch.full((m, seq_len), IGNORE, dtype=torch.int64)
    doc = torch.full((m, seq_len), -1, dtype=torch.int32)
    pos = torch.arange(seq_len, dtype=torch.int64).repeat(m, 1)  # padding rows: one run
    for r, b in enumerate(mbs):
        t = int(b["input_ids"].shape[-1])
        if t > seq_len:
            raise ValueError(f"microbatch {int(b['slot'])} of step {int(b['step'])} holds {t} "
                             f"tokens, more than seq_len={seq_len}")
        ids[r, :t] = b["input_ids"].reshape(-1)
        tgt[r, :t] = b["shift_labels"].reshape(-1)
        doc[r, :t] = b["document_ids"].reshape(-1)
        p = b["position_ids"].reshape(-1)
        pos[r, :t] = p
        if t < seq_len:  # padding continues the last document's positions (no new start)
            last = int(p[-1]) + 1 if t else 0
            pos[r, t:] = torch.arange(last, last + seq_len - t)
    n_tokens = int(first["step_loss_tokens"])
    scale = (m if scale_grads else 1) * dp_average / max(n_tokens, 1)
    return PipelineStep(ids, pos, tgt, doc, int(first["epoch"]), int(first["step"]), len(mbs),
                        n_tokens, {"scale": scale})


__all__ = ["PipelineStep", "pipeline_loss", "pipeline_steps"]
