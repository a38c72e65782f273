"""RL entry point: one call per step that takes this rank's rollout batch and returns this
rank's cost-balanced packed microbatches plus the map back; a replacement for verl's
``_balance_batch`` (Karmarkar-Karp of whole sequences over DP ranks, equal counts) followed by
``rearrange_micro_batches`` (Karmarkar-Karp over a token-limit's worth of microbatches).

Differences, on purpose: ranks may train different numbers of samples (the cost, not the count,
is balanced; every rank still runs the same number of microbatches), no microbatch exceeds the
capacity, the balance is on forward + backward cost (attention included), every sample of the
step is trained in the step (``microbatches="auto"``: the fewest microbatches per rank that place
all of them), and the samples travel with one all-to-all instead of a controller round trip.

Input (``batch``):

* a dict of padded tensors with ``attention_mask`` [B, S] (any padding pattern: verl's
  left-padded prompt + right-padded response is fine): ``input_ids`` and every other [B, S, ...]
  tensor are per-token fields (the masked positions, in order); other tensors with B rows are
  per-sample fields ([B, R] response-level rows such as ``advantages`` travel whole);
  ``position_ids`` is rebuilt per document by the collator and not sent;
* or a list of B one-dimensional token tensors, with ``extras`` mapping a name to a list of B
  per-token tensors or a [B, ...] per-sample tensor.

``extras`` with a dict batch are more entries of that dict (a name it already has is an error).

Output: :class:`RolloutMicrobatches` (``microbatches``: packed THD dicts with the collator's keys
-- ``input_ids`` [T], ``position_ids``, ``cu_seqlens`` int32[N+1], ``max_seqlen``,
``num_loss_tokens``, ``step_loss_tokens``, ... -- plus ``source_rank``/``source_index`` int64[N]
and the payload fields; ``restore(outputs)``: results back in the original order, re-padded to
[B, S, ...] for a padded input).
"""
from __future__ import annotations

from dataclasses import dataclass
import numbers
from typing import Mapping, Optional, Sequence, Union

import torch

from ..config import Layout, PlannerConfig
from ..cost.model import CostModel
from .runtime_balancer import LOCAL_ERRORS, RuntimeBalancer, StepResult, fail_step, restore
from .payload import TOKENS, Columns
from .plan import StepPlan


@dataclass
class RolloutMicrobatches:
    """This rank's balanced microbatches of one rollout step and the way back.

    * ``microbatches``: list of packed dicts (see the module docstring); every rank has
      ``plan.microbatches`` of them;
    * ``index_map``: per microbatch, int64[N, 2] of (source rank, index in that rank's batch);
    * ``plan``/``stats``: the step's plan (equal on every rank) and its counters and timings.
    """

    result: StepResult
    mask: Optional[torch.Tensor]
    batch_size: int

    @property
    def microbatches(self) -> list:
        return self.result.microbatches

    @property
    def plan(self) -> StepPlan:
        return self.result.plan

    @property
    def stats(self) -> dict:
        return self.result.stats

    @property
    def index_map(self) -> list:
        return [torch.stack([torch.as_tensor(b["source_rank"]), torch.as_tensor(b["source_index"])],
                            1) for b in self.microbatches]

    def restore(self, outputs: Sequence[Union[Mapping, torch.Tensor]],
                kinds: Optional[Mapping] = None) -> dict:
        """Results of every microbatch (per microbatch a dict of tensors, or one tensor, which
        is named ``"output"``; ``[T, ...]`` per token or ``[N, ...]`` per document) back on the
        rank each sample came from, in its original order.

        Returns a dict, output name -> result (``r.restore(outs)["output"]`` when each
        microbatch gave one tensor): per-token results as [B, S, ...] (zeros where the mask is
        0) for a padded input, or a list of [L_i, ...] tensors for a list input; per-sample
        results as [B, ...]. Collective: every rank calls it."""
        outs = [o if isinstance(o, Mapping) else {"output": o} for o in outputs]
        res, spec = restore(self.result, outs, kinds)
        out = {}
        for name, rows in res.items():
            if any(r is None for r in rows):  # cannot happen: every sample is trained
                raise AssertionError(f"output {name!r}: a sample was not trained this step")
            f = spec[name]
            if f.kind == "sample":
                out[name] = torch.stack(rows) if rows else torch.empty((0, *f.trailing),
                                                                       dtype=f.dtype)
            elif self.mask is not None:
                full = torch.zeros((*self.mask.shape, *f.trailing), dtype=f.dtype)
                if rows:
                    full[self.mask.bool().cpu()] = torch.cat(rows).to(full.device)
                out[name] = full
            else:
                out[name] = rows
        return out


def _columns(batch, extras, tokens_key, mask_key) -> tuple[Columns, Optional[torch.Tensor], int]:
    if isinstance(batch, Mapping):
        if mask_key not in batch:
            raise ValueError(f"a padded rollout batch needs {mask_key!r} [B, S]")
        if tokens_key not in batch:
            raise ValueError(f"a padded rollout batch needs {tokens_key!r} [B, S]")
        b = dict(batch)
        for k, v in (extras or {}).items():  # more fields, checked like the batch's own
            if k in b:
                raise ValueError(f"extras[{k!r}] collides with the batch's own {k!r}")
            b[k] = v
        if tokens_key != TOKENS:
            b[TOKENS] = b.pop(tokens_key)
        mask = b[mask_key]
        cols = Columns.from_padded(b, mask_key)
        if TOKENS not in cols.token:
            raise ValueError(f"{tokens_key!r} must have the mask's shape [B, S]")
        return cols, mask, int(mask.shape[0])
    seqs = list(batch)
    tok_fields, smp_fields = {}, {}
    for k, v in (extras or {}).items():
        if isinstance(v, torch.Tensor):
            smp_fields[k] = v
        else:
            tok_fields[k] = list(v)
    return Columns.from_sequences(seqs, tok_fields, smp_fields), None, len(seqs)


def _whole(spec) -> int:
    """``spec`` = (name, value, least): the value as an int, or a one-line ValueError naming
    it (a fraction is never rounded: ``capacity=10.5`` planned with 10 before)."""
    name, value, low = spec
    ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if isinstance(value, float) and value.is_integer():
        ok = True  # 16.0 is 16, as Layout takes it
    if not ok:
        raise ValueError(f"balance_rollout: {name} {value!r} is not an integer")
    if int(value) < low:
        raise ValueError(f"balance_rollout: {name} {value!r} must be >= {low}")
    return int(value)


def balance_rollout(batch, cost: CostModel, capacity: int, *, group=None,
                    extras: Optional[Mapping] = None, ids=None, tokens_key: str = "input_ids",
                    mask_key: str = "attention_mask", microbatches="auto",
                    min_microbatches: int = 1, pp: int = 1,
                    config: Optional[PlannerConfig] = None, step: Optional[int] = None,
                    balancer: Optional[RuntimeBalancer] = None) -> RolloutMicrobatches:
    """Balance this rank's rollout ``batch`` (see the module docstring) over the DP ranks of
    ``group``: returns this rank's microbatches, each at most ``capacity`` tokens, and the map
    back. ``microbatches``: ``"auto"`` (the fewest per rank that hold the whole step, at least
    ``min_microbatches``; give ``pp`` or more with pipeline parallelism) or an exact count (an
    error if the step does not fit). Pass ``balancer=`` to reuse one across steps (keeps the
    step counter); otherwise one is built per call. Collective: every DP rank calls it."""
    try:
        capacity, min_microbatches, pp = (_whole(x) for x in (
            ("capacity", capacity, 1), ("min_microbatches", min_microbatches, 1), ("pp", pp, 1)))
        if microbatches != "auto":
            microbatches = _whole(("microbatches", microbatches, 1))
        if step is not None:
            step = _whole(("step", step, 0))
        cols, mask, bsz = _columns(batch, extras, tokens_key, mask_key)
        error = None
    except LOCAL_ERRORS as e:  # every rank raises it (below), none waits in the collective
        error = e
    if balancer is None and error is None:
        from .gather import world_of
        _, world = world_of(group)
        try:
            layout = Layout(dp=world, pp=pp, microbatches=min_microbatches if
                            microbatches == "auto" else microbatches, capacity=capacity)
            balancer = RuntimeBalancer(cost, layout, config, group=group,
                                       microbatches="auto" if microbatches == "auto" else None,
                                       min_microbatches=min_microbatches, carry=False)
        except LOCAL_ERRORS as e:
            error = e
        else:
            if step is not None:
                balancer.step_index = step
    if error is not None:
        if balancer is not None:
            balancer.fail(error)
        # no balancer (its sizes were refused): the same collective, so no rank waits
        fail_step(error, group, 0 if step is None else step)
    result = balancer.step(cols if len(cols) else None, ids)
    return RolloutMicrobatches(result, mask, bsz)
