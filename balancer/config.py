"""Frozen, validated configuration: the parallel layout and the planner's policy knobs.
Unknown keys are errors, so a typo in a YAML file never silently falls back to a default."""
from __future__ import annotations

import functools
import inspect
from typing import Literal, Optional

import yaml
from pydantic import BaseModel, Field, model_serializer, model_validator

from packing.validate import MAX_LENGTH, MAX_STEP_TOKENS

from .zigzag import cp_pad_unit
from .frozen import FROZEN, NoBoolNumbers

_FROZEN = FROZEN  # balancer.frozen: the one model_config
#: bound of the counts (ranks, microbatches, steps of delay): values feed int64 arithmetic
MAX_COUNT = 2 ** 20


class Layout(NoBoolNumbers):
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
        if self.dp * self.microbatches > MAX_COUNT:   # arrays of one step's microbatches
            raise ValueError(f"dp x microbatches = {self.dp} x {self.microbatches} = "
                             f"{self.dp * self.microbatches} microbatches per step exceeds the "
                             f"limit 2**20 ({MAX_COUNT})")
        if self.cp_mode == "hybrid" and self.rank_capacity is None:
            raise ValueError("cp_mode='hybrid' needs rank_capacity (the tokens one rank holds in "
                             "one microbatch round)")
        if self.rank_capacity is not None and self.capacity != self.cp * self.rank_capacity:
            raise ValueError(f"capacity {self.capacity} must be cp x rank_capacity = {self.cp} x "
                             f"{self.rank_capacity} = {self.cp * self.rank_capacity} (a "
                             f"microbatch of a CP group holds rank_capacity tokens per rank)")
        return self

    @property
    def lockstep(self) -> bool:
        """Whether the DP ranks run in lockstep: more than one, with one pipeline stage, waiting
        for each other after every microbatch (``sync='microbatch'``: FSDP, ZeRO-3). A step
        then lasts the sum over microbatch positions of the costliest microbatch there, not
        the costliest rank's sum (``balanced`` places microbatches and the report times steps
        by it)."""
        return self.sync == "microbatch" and self.pp == 1 and self.dp > 1

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        # ``sync`` is left out at its default so that a layout dumps (and hashes) exactly as it
        # did before the field existed: stored plans, their manifests, plan fingerprints and
        # sampler checkpoints written then still match a default layout now
        out = handler(self)
        if isinstance(out, dict) and out.get("sync") == "step":
            del out["sync"]
        # the same for the CP mode: a fixed layout without rank_capacity dumps as
        # before these fields existed
        if isinstance(out, dict) and out.get("cp_mode") == "fixed":
            del out["cp_mode"]
        if isinstance(out, dict) and "rank_capacity" in out and out["rank_capacity"] is None:
            del out["rank_capacity"]
        return out


class PlannerConfig(NoBoolNumbers):
    """Policy of the step planner."""

    model_config = _FROZEN
    strategy: str = Field("balanced", description="packing strategy name (see strategies); "
                                                  "cp_mode hybrid: hybrid_stream unless set")
    seed: int = Field(0, ge=0, le=2 ** 63 - 1, description="seed of the per-epoch shuffle")
    shuffle: bool = Field(True, description="shuffle samples each epoch (seed, epoch)")
    order: Literal["permutation", "blocks"] = Field(
        "permutation", description="the shuffled epoch order: one seeded permutation of the "
                                   "corpus (held by every planning process, 8 B/sample), or "
                                   "'blocks': blocks of 4096 consecutive samples in a seeded "
                                   "order, shuffled within groups of 1M samples, computed per "
                                   "window (memory bounded by the window; other plans)")
    global_batch_tokens: Optional[int] = Field(
        None, gt=0, le=MAX_STEP_TOKENS,
        description="tokens taken per step; default dp x microbatches x capacity; at least "
                    "dp x microbatches (x 2 cp under CP): a step whose budget holds fewer "
                    "samples than microbatches takes one sample per microbatch")
    global_batch_samples: Optional[int] = Field(
        None, gt=0, le=MAX_LENGTH, description="samples taken per step instead of a token "
                                               "budget; at least dp x microbatches")
    max_delay: int = Field(4, ge=0, le=MAX_COUNT,
                           description="most steps a sample may wait after it is read (cp_mode "
                                       "fixed: at least 1); cp_mode hybrid: most steps a "
                                       "document may move from its global batch, either way "
                                       "(hybrid_stream; 0: none moves), default 2 there "
                                       "(MODE_DEFAULTS)")
    max_advance: Optional[int] = Field(
        None, ge=0, le=MAX_COUNT, description="most steps `balanced` may read a heavy sample before its turn "
                                "to meet partners of similar cost (default: 3 x max_delay; 0 = "
                                "only delay, as WLB-LLM)")
    over_length: Literal["error", "chunk"] = Field(
        "error", description="samples longer than the capacity (cp_mode hybrid: than the "
                             "pool's largest aligned group holds): raise, or cut into pieces of "
                             "that size (counted); the hybrid API's older name: over_limit")
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

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        # ``order`` is left out at its default so that a config dumps (and hashes) exactly as
        # it did before the field existed: manifests and checkpoints written then still match
        out = handler(self)
        if isinstance(out, dict) and out.get("order") == "permutation":
            del out["order"]
        return out

    @property
    def advance(self) -> int:
        return 3 * self.max_delay if self.max_advance is None else self.max_advance

    @model_validator(mode="after")
    def _one_budget(self):
        if self.global_batch_tokens is not None and self.global_batch_samples is not None:
            raise ValueError("give global_batch_tokens or global_batch_samples, not both")
        return self


# ---- one vocabulary for both CP modes ----------------------------------------------------------
#: the PlannerConfig fields each ``Layout.cp_mode`` reads. The hybrid mode plans global batches
#: of ``global_batch_tokens`` in the epoch's shuffled order, per microbatch round: it has no
#: sample budget, windows, tail policy or outlier knobs, and a config that sets one of those to
#: another value than its default is refused there (:func:`mode_config`), never ignored
MODE_FIELDS = {
    "fixed": tuple(PlannerConfig.model_fields),
    "hybrid": ("strategy", "seed", "global_batch_tokens", "max_delay", "over_length"),
}
#: where a mode's default differs from PlannerConfig's field default (the fixed mode's), in the
#: same names; taken for the fields a config leaves unset. The default strategy of a mode is the
#: strategy registry's (``balancer.strategies.registry.default``): balanced / hybrid_stream.
#: ``max_delay`` differs because it bounds another movement: in the fixed mode, how long
#: ``balanced`` lets a heavy sample wait for partners of similar cost (4, while it may read one
#: up to 3 x 4 steps early); in the hybrid mode, how far ``hybrid_stream`` moves a tall document
#: late or early (2 either way: the window tools/bench_hybrid.py measured, and what
#: HybridBatchSampler, ``precompute --cp-mode hybrid`` and every stored hybrid plan have used,
#: so the same inputs keep giving the same plan)
MODE_DEFAULTS = {"fixed": {}, "hybrid": {"max_delay": 2}}
#: keyword spellings of the hybrid mode's first API -> the names both modes use (the fixed
#: mode's): accepted wherever the new name is (:func:`renamed`), never written anywhere; the
#: JSON keys of stored plans and reports keep their names (a hybrid manifest's ``over_limit``)
ALIASES = {"over_limit": "over_length", "model": "cost"}


def _same(a, b) -> bool:
    if a is b:
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


def renamed(**old_to_new: str):
    """Decorator: ``fn`` also takes each keyword under its older name (``over_limit=`` for
    ``over_length=``, ``model=`` for ``cost=``; see :data:`ALIASES`), passed on under the new
    one. Both given with different values is one ValueError naming both."""
    def deco(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kw):
            olds = {k: kw.pop(k) for k in list(kw) if k in old_to_new}
            if not olds:
                return fn(*args, **kw)
            bound = sig.bind_partial(*args, **kw)
            for old, value in olds.items():
                new = old_to_new[old]
                have = bound.arguments.get(new)
                if have is not None and not _same(have, value):
                    raise ValueError(f"{new}={have!r} and {old}={value!r} disagree ({old} is "
                                     f"the older name of {new}): give one of them")
                bound.arguments[new] = value if have is None else have
            return fn(*bound.args, **bound.kwargs)
        return wrapper
    return deco


def with_values(config: Optional[PlannerConfig] = None, **values) -> PlannerConfig:
    """``config`` (default ``PlannerConfig()``) with the keyword ``values`` that are not None on
    top, validated; a field set by either counts as set (``model_fields_set``). A value that
    disagrees with one the config sets itself is one ValueError naming both."""
    config = PlannerConfig() if config is None else config
    if not isinstance(config, PlannerConfig):
        raise TypeError(f"config must be a PlannerConfig, got {type(config).__name__}")
    given = {k: v for k, v in values.items() if v is not None}
    for k, v in given.items():
        if k in config.model_fields_set and not _same(getattr(config, k), v):
            raise ValueError(f"{k}={v!r} disagrees with the config's {k}="
                             f"{getattr(config, k)!r}: give one of them")
    if not given:
        return config
    return PlannerConfig(**{**{k: getattr(config, k) for k in config.model_fields_set},
                            **given})


def mode_config(config: PlannerConfig, mode: str, default_strategy: str) -> PlannerConfig:
    """``config`` as ``mode`` plans with it: the fields it leaves unset take the mode's defaults
    (:data:`MODE_DEFAULTS`; ``default_strategy`` for ``strategy``), and a field the mode does not
    read (:data:`MODE_FIELDS`) set to another value than its default is one ValueError naming
    it. The result sets every field it resolved, so resolving it again changes nothing."""
    if mode not in MODE_FIELDS:
        raise ValueError(f"cp_mode {mode!r}: expected one of {list(MODE_FIELDS)}")
    unused = [k for k in PlannerConfig.model_fields if k not in MODE_FIELDS[mode]
              and getattr(config, k) != PlannerConfig.model_fields[k].default]
    if unused:
        raise ValueError(f"cp_mode {mode!r} does not use " + ", ".join(
            f"{k}={getattr(config, k)!r}" for k in unused) + f" (it reads "
            f"{', '.join(MODE_FIELDS[mode])})")
    defaults = {"strategy": default_strategy, **MODE_DEFAULTS[mode]}
    unset = {k: v for k, v in defaults.items() if k not in config.model_fields_set}
    if not unset:
        return config
    return PlannerConfig(**{k: getattr(config, k) for k in config.model_fields_set}, **unset)


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


def check_fixed_mode(layout: Layout, what: str, config: Optional[PlannerConfig] = None) -> None:
    """Refuse a ``cp_mode='hybrid'`` layout in the fixed-CP planner ``what`` (plan_epoch,
    precompute): planning it as fixed CP groups would silently train another layout; and a
    ``config`` with ``max_delay=0``, which only the hybrid mode plans (no document moves)."""
    if layout.cp_mode == "hybrid":
        raise ValueError(f"{what}: layout cp_mode='hybrid' is planned per microbatch round by "
                         f"the hybrid planner, not as fixed CP groups: use "
                         f"balancer.loader.HybridBatchSampler (or balancer.planning.hybrid."
                         f"plan_stream) for it, or cp_mode='fixed' for fixed CP")
    if config is not None:
        check_fixed_delay(config.max_delay)


def check_fixed_delay(max_delay: int) -> None:
    """The fixed mode's strategies let a sample wait at least one step: ``max_delay=0`` is the
    hybrid mode's (no document moves), refused here naming the value."""
    if int(max_delay) < 1:
        raise ValueError(f"max_delay={max_delay}: the fixed mode (cp_mode 'fixed') needs "
                         f"max_delay >= 1 (--max-delay); 0 is the hybrid mode's 'no document "
                         f"moves'")


def load_yaml(path, what: str = "config file") -> dict:
    """The top-level mapping of a YAML file (``yaml.safe_load``; the one reader of configs and
    presets). A syntax error, a tag safe_load refuses (``!!python/...``), bytes that are not
    UTF-8 or a document that is not a mapping raise one ValueError line naming the file (and the
    line and column where known); ``what`` names the kind of file in the last message."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.load(f, Loader=_PlainLoader)   # safe_load, without anchors/duplicates
    except _Refused as e:
        raise ValueError(f"{path}: {e.problem}{_yaml_mark(e)}") from None
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


class _Refused(yaml.MarkedYAMLError):
    """What plain YAML configs may not hold (see :class:`_PlainLoader`)."""


class _PlainLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses anchors and aliases before composing anything (an alias
    bomb expands nothing: a config never needs them) and duplicate keys in a mapping (the last
    value silently won)."""

    def compose_node(self, parent, index):
        ev = self.peek_event()
        if isinstance(ev, yaml.AliasEvent) or getattr(ev, "anchor", None) is not None:
            name = ev.anchor
            raise _Refused(problem=f"anchors and aliases (&{name} / *{name}) are not read in a "
                                   f"config; write the values out", problem_mark=ev.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:   # an unhashable key: construct_mapping names it
                continue
            if first is not key_node.start_mark:
                raise _Refused(problem=f"duplicate key {key!r} (first given on line "
                                       f"{first.line + 1})", problem_mark=key_node.start_mark)
        return super().construct_mapping(node, deep)


def _yaml_mark(e) -> str:
    m = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    return f" (line {m.line + 1}, column {m.column + 1})" if m is not None else ""
