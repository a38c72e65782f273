"""Frozen, validated configuration: the parallel layout and the planner's policy knobs.
Unknown keys are errors, so a typo in a YAML file never silently falls back to a default."""
from __future__ import annotations

from typing import Literal, Optional

import yaml
from pydantic import BaseModel, Field, model_serializer, model_validator

from packing.validate import MAX_LENGTH, MAX_STEP_TOKENS

from .zigzag import cp_pad_unit
from .frozen import FROZEN

_FROZEN = FROZEN  # balancer.frozen: the one model_config
#: bound of the counts (ranks, microbatches, steps of delay): values feed int64 arithmetic
MAX_COUNT = 2 ** 20


class Layout(BaseModel):
    """How one training step is spread over GPUs."""

    model_config = _FROZEN
    dp: int = Field(1, ge=1, le=MAX_COUNT,
                    description="data-parallel replicas (each runs its own microbatches)")
    pp: int = Field(1, ge=1, le=MAX_COUNT,
                    description="pipeline stages; every microbatch visits all of them")
    cp: int = Field(1, ge=1, le=MAX_COUNT,
                    description="context-parallel ranks sharing one microbatch")
    microbatches: int = Field(1, ge=1, le=MAX_COUNT,
                              description="microbatches per DP rank per step")
    capacity: int = Field(gt=0, le=MAX_LENGTH, description="tokens per microbatch (whole CP "
                                                           "group, CP padding included)")
    sync: Literal["step", "microbatch"] = Field(
        "step", description="when the DP ranks wait for each other, which sets what `balanced` "
                            "equalises under balance='auto' (pp == 1, dp > 1): 'step' = once per "
                            "step (DDP with no_sync() gradient accumulation, the gradient "
                            "all-reduce after the last microbatch): only per-rank sums matter; "
                            "'microbatch' = after every microbatch (FSDP, ZeRO-3, DeepSpeed, "
                            "DDP without no_sync, HF Trainer/accelerate with FSDP): every "
                            "microbatch balanced, the ranks run in lockstep. With pp > 1 or "
                            "dp == 1 every microbatch is balanced either way")
    cp_mode: Literal["fixed", "hybrid"] = Field(
        "fixed", description="'fixed': every microbatch runs on a CP group of `cp` ranks (what "
                             "plan_epoch and PackedBatchSampler plan); 'hybrid': the dp x cp "
                             "ranks of a stage form one pool and every document gets its own CP "
                             "degree on aligned power-of-two groups, per microbatch round "
                             "(balancer.planning.hybrid, balancer.loader.hybrid); needs rank_capacity")
    rank_capacity: Optional[int] = Field(
        None, gt=0, le=MAX_LENGTH,
        description="tokens one rank holds in one microbatch round (its memory limit, CP "
                    "padding included); when given, capacity must be cp x rank_capacity (the "
                    "step budget dp x microbatches x capacity is then the pool's dp x cp x "
                    "microbatches x rank_capacity in either mode); required by cp_mode "
                    "'hybrid'")

    @model_validator(mode="after")
    def _step_fits(self):
        step = self.dp * self.microbatches * self.capacity
        if step > MAX_STEP_TOKENS:
            raise ValueError(f"dp x microbatches x capacity = {self.dp} x {self.microbatches} x "
                             f"{self.capacity} = {step} tokens per step exceeds the limit "
                             f"2**52 ({MAX_STEP_TOKENS})")
        if self.cp_mode == "hybrid" and self.rank_capacity is None:
            raise ValueError("cp_mode 'hybrid' needs rank_capacity (the tokens one rank holds in "
                             "one microbatch round)")
        if self.rank_capacity is not None and self.capacity != self.cp * self.rank_capacity:
            raise ValueError(f"capacity {self.capacity} must be cp x rank_capacity = {self.cp} x "
                             f"{self.rank_capacity} = {self.cp * self.rank_capacity} (a "
                             f"microbatch of a CP group holds rank_capacity tokens per rank)")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        # ``sync`` is left out at its default so that a layout dumps (and hashes) exactly as it
        # did before the field existed: stored plans, their manifests, plan fingerprints and
        # sampler checkpoints written then still match a default layout now
        out = handler(self)
        if isinstance(out, dict) and out.get("sync") == "step":
            del out["sync"]
        # the same for the CP mode (issue #15): a fixed layout without rank_capacity dumps as
        # before these fields existed
        if isinstance(out, dict) and out.get("cp_mode") == "fixed":
            del out["cp_mode"]
        if isinstance(out, dict) and "rank_capacity" in out and out["rank_capacity"] is None:
            del out["rank_capacity"]
        return out

    @property
    def microbatches_per_step(self) -> int:
        return self.dp * self.microbatches


class PlannerConfig(BaseModel):
    """Policy of the step planner."""

    model_config = _FROZEN
    strategy: str = Field("balanced", description="packing strategy name (see strategies)")
    seed: int = Field(0, ge=0, le=2 ** 63 - 1, description="seed of the per-epoch shuffle")
    shuffle: bool = Field(True, description="shuffle samples each epoch (seed, epoch)")
    global_batch_tokens: Optional[int] = Field(
        None, gt=0, le=MAX_STEP_TOKENS,
        description="tokens taken per step; default dp x microbatches x capacity; at least "
                    "dp x microbatches (x 2 cp under CP): a step whose budget holds fewer "
                    "samples than microbatches takes one sample per microbatch")
    global_batch_samples: Optional[int] = Field(
        None, gt=0, le=MAX_LENGTH, description="samples taken per step instead of a token "
                                               "budget; at least dp x microbatches")
    max_delay: int = Field(4, ge=1, le=MAX_COUNT,
                           description="most steps a sample may wait after it is read")
    max_advance: Optional[int] = Field(
        None, ge=0, le=MAX_COUNT, description="most steps `balanced` may read a heavy sample before its turn "
                                "to meet partners of similar cost (default: 3 x max_delay; 0 = "
                                "only delay, as WLB-LLM)")
    over_length: Literal["error", "chunk"] = Field(
        "error", description="samples longer than the capacity: raise, or cut into "
                             "capacity-sized pieces (counted)")
    tail: Literal["partial", "carry", "drop"] = Field(
        "partial", description="samples left at the end of an epoch: a smaller final step, "
                               "carried into the next epoch, or dropped (counted)")
    balance: Literal["auto", "microbatch", "rank"] = Field(
        "auto", description="what `balanced` equalises: every microbatch (needed with pp > 1 "
                            "and when the ranks synchronise per microbatch), or only per-rank "
                            "sums; auto picks microbatch when pp > 1, dp == 1 or the layout's "
                            "sync is 'microbatch', else per-rank sums; 'rank' with "
                            "sync='microbatch' is refused")
    lookahead: bool = Field(True, description="let the outlier scheduler see arriving samples")
    lump_tolerance: float = Field(0.02, gt=0, allow_inf_nan=False, description="excess cost, as a fraction of a "
                                  "unit's typical cost, above which a sample is scheduled")
    window_samples: Optional[int] = Field(
        None, gt=0, le=MAX_LENGTH, description="plan the epoch in independent windows of this many items (delay "
                                "queues flush at window ends), so windows can be planned in "
                                "parallel with a result identical to a serial run; None = one "
                                "window")

    @property
    def advance(self) -> int:
        return 3 * self.max_delay if self.max_advance is None else self.max_advance

    @model_validator(mode="after")
    def _one_budget(self):
        if self.global_batch_tokens is not None and self.global_batch_samples is not None:
            raise ValueError("give global_batch_tokens or global_batch_samples, not both")
        return self


def step_budget(layout: Layout, config: PlannerConfig) -> tuple[int, bool]:
    """``(budget, by_samples)``: what a step takes, in samples (``global_batch_samples``) or in
    tokens (``global_batch_tokens``, default dp x microbatches x capacity)."""
    if config.global_batch_samples is not None:
        return int(config.global_batch_samples), True
    tokens = config.global_batch_tokens
    return int(tokens if tokens is not None else layout.dp * layout.microbatches
               * layout.capacity), False


def min_budget(layout: Layout, by_samples: bool) -> int:
    """The smallest step budget that can hold one sample per microbatch: dp x microbatches
    samples, or as many tokens times the fewest tokens a sample takes (1, or 2 x cp under CP,
    where every document is padded to a multiple of 2 x cp)."""
    per_step = layout.dp * layout.microbatches
    return per_step if by_samples else per_step * cp_pad_unit(layout.cp)


def check_budget(layout: Layout, budget: int, by_samples: bool) -> None:
    """Refuse a step budget that cannot give every microbatch of a step one sample, naming the
    budget, the layout and the minimum. Every strategy plans a valid epoch for any budget at or
    above :func:`min_budget` (a step whose budget holds fewer samples than microbatches takes
    one sample per microbatch)."""
    low = min_budget(layout, by_samples)
    if int(budget) >= low:
        return
    name = "global_batch_samples" if by_samples else "global_batch_tokens"
    per_step = layout.dp * layout.microbatches
    if by_samples:
        why, unit = "", "samples"
    else:
        tok = low // per_step
        pad = f" (padded to a multiple of 2 x cp={layout.cp})" if layout.cp > 1 else ""
        why = f" and a sample takes at least {tok} token{'s' if tok > 1 else ''}{pad}"
        unit = "tokens"
    raise ValueError(f"{name}={int(budget)} cannot give every microbatch of a step a sample: "
                     f"the layout dp={layout.dp} x microbatches={layout.microbatches} has "
                     f"{per_step} microbatches per step{why}, so the smallest budget is {low} "
                     f"{unit}; raise {name} to at least {low}, or use fewer DP ranks or "
                     f"microbatches")


def check_fixed_mode(layout: Layout, what: str) -> None:
    """Refuse a ``cp_mode='hybrid'`` layout in the fixed-CP planner ``what`` (plan_epoch,
    precompute): planning it as fixed CP groups would silently train another layout."""
    if layout.cp_mode == "hybrid":
        raise ValueError(f"{what}: layout cp_mode='hybrid' is planned per microbatch round by "
                         f"the hybrid planner, not as fixed CP groups: use "
                         f"balancer.loader.HybridBatchSampler (or balancer.planning.hybrid."
                         f"plan_stream) for it, or cp_mode='fixed' for fixed CP")


def load_yaml(path, what: str = "config file") -> dict:
    """The top-level mapping of a YAML file (``yaml.safe_load``; the one reader of configs and
    presets). A syntax error, a tag safe_load refuses (``!!python/...``), bytes that are not
    UTF-8 or a document that is not a mapping raise one ValueError line naming the file (and the
    line and column where known); ``what`` names the kind of file in the last message."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a UTF-8 text file ({e.reason} at byte {e.start})") \
            from None
    except yaml.constructor.ConstructorError as e:
        raise ValueError(f"{path}: not plain YAML{_yaml_mark(e)}: {e.problem} (only plain YAML "
                         f"is read, with yaml.safe_load; remove the tag)") from None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ValueError(f"{path}: not valid YAML{_yaml_mark(e)}: {problem}") from None
    doc = {} if doc is None else doc
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a {what} must be a mapping at the top level, got "
                         f"{type(doc).__name__}")
    return doc


def _yaml_mark(e) -> str:
    m = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    return f" (line {m.line + 1}, column {m.column + 1})" if m is not None else ""
