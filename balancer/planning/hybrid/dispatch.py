"""A hybrid-mode strategy planned by name over an epoch's stream of documents: the one place
the hybrid mode turns (strategy name, documents, CP cost model, pool, batch tokens, config) into
a :class:`packing.hybrid_cp.HybridPlan` (:func:`plan_strategy`), and the strategy lists of a
pool, derived from the strategy registry (:mod:`balancer.strategies.registry`).

Every strategy sees the same global batches (consecutive documents of the stream, a batch
closing with the document that reaches the batch tokens,
:func:`balancer.strategies.hybrid.global_batches`), so their plans compare directly.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from packing.hybrid_cp import HybridPlan

from ...config import PlannerConfig, renamed
from ...cost.cp import CPCostModel, CPHardware
from ...strategies import registry as strategies
from ...strategies.hybrid import (_largest_group, global_batches,  # noqa: F401 (dispatch.*)
                                   pool_group)

#: named strategies of the hybrid mode (the ``fixed_cp<c>`` family comes on top, one per degree)
HYBRID_STRATEGIES = tuple(n for n in strategies.names("hybrid") if not strategies.is_family(n))
#: the strategy that cp_mode hybrid plans with when none is named (the sampler, ``precompute``):
#: the registry's default of the mode. ``hybrid_stream`` meets the quality targets ``hybrid``
#: misses on prolong x llama-7b, is never slower than ``hybrid`` by more than 0.5% on any cell of
#: ``tools/bench_hybrid.py``, and plans in a few ms per global batch (its movement compiled)
HYBRID_DEFAULT_STRATEGY = strategies.default("hybrid")


def fixed_degrees(n_ranks: int) -> list[int]:
    """Power-of-two CP degrees that tile a pool of ``n_ranks``: 1, 2, 4, ... dividing it."""
    return strategies.degrees(n_ranks)


def default_strategies(n_ranks: int) -> list[str]:
    """Every hybrid-mode strategy of a pool of ``n_ranks``, in registry order (the family
    ``fixed_cp<c>`` as one name per degree that tiles the pool)."""
    return strategies.names("hybrid", n_ranks=n_ranks)


def hybrid_config(config: Optional[PlannerConfig] = None, **values) -> PlannerConfig:
    """The config cp_mode hybrid plans with: ``config`` with the keyword ``values`` (PlannerConfig
    names; None: not given) on top, the hybrid mode's defaults for what neither sets (strategy
    ``hybrid_stream``, ``max_delay`` 2: :data:`balancer.config.MODE_DEFAULTS`), a field the mode
    does not read refused, the strategy checked to be a hybrid-mode one
    (:func:`balancer.strategies.registry.configure`)."""
    return strategies.configure("hybrid", config, **values)


def cp_cost_model(cost_model: str, rank_capacity: int, *, pp: int = 1, gpus_per_node: int = 8,
                  overlap: float = 1.0) -> CPCostModel:
    """The CP cost model of a preset with a ``model:`` mapping (llama-7b, llama-70b, ...)."""
    hw = CPHardware(gpus_per_node=gpus_per_node, overlap=overlap)
    return CPCostModel.from_preset(cost_model, int(rank_capacity), hardware=hw, pp=pp)


@renamed(over_limit="over_length", model="cost")
def check_pool_limit(lengths: np.ndarray, cost: CPCostModel, n_ranks: int,
                     over_length: str = "error") -> None:
    """Refuse (``over_length="error"``; older name ``over_limit``) a document longer than the
    pool's largest aligned group holds, naming the sample by its id in ``lengths`` (planning sees
    shuffled batches, whose positions are not sample ids), its length and the limit."""
    if over_length == "chunk":
        return
    limit, g = cost.pool_limit(n_ranks)
    over = np.flatnonzero(np.asarray(lengths) > limit)
    if over.size:
        i = int(over[0])
        group = pool_group(g, n_ranks)
        raise ValueError(f"sample {i}: length {int(lengths[i])} exceeds the pool's limit of "
                         f"{limit} tokens ({group} x rank_capacity {cost.rank_capacity}, CP "
                         f"padding included); --over-length chunk (over_length='chunk') cuts "
                         f"such documents into pieces (counted as documents_cut)")


def check_pieces(lengths: np.ndarray, cost: CPCostModel, n_ranks: int, name: str,
                 over_length: str) -> None:
    """Refuse, before any piece is made, a sample the strategy ``name`` would cut into more
    than :data:`balancer.planning.stream.MAX_PIECES` pieces (``fixed_cp<c>``: pieces of what
    a group of ``c`` holds; ``over_length="chunk"``: of the pool's limit), naming the sample by
    its id in ``lengths``, its length and the limit (a corrupt length of 2**40 would otherwise
    fill the memory with its pieces first)."""
    from ..stream import MAX_PIECES
    if name.startswith("fixed_cp") and name[len("fixed_cp"):].isdigit():
        piece = cost.doc_limit(int(name[len("fixed_cp"):]))
    elif over_length == "chunk":
        piece = cost.pool_limit(n_ranks)[0]
    else:
        return
    if piece < 1:
        return
    L = np.asarray(lengths)
    over = np.flatnonzero(L > MAX_PIECES * piece)
    if over.size:
        i = int(over[0])
        raise ValueError(f"sample {i}: length {int(L[i])} would be cut into "
                         f"{(int(L[i]) - 1) // piece + 1} pieces of at most {piece} tokens "
                         f"({name}), over the limit of {MAX_PIECES} (2**20) pieces per sample; "
                         f"check that length, or raise the rank capacity")


@renamed(over_limit="over_length", model="cost")
def plan_strategy(name: str, lengths: np.ndarray, cost: CPCostModel, n_ranks: int,
                  batch_tokens: int, config: Optional[PlannerConfig] = None, *,
                  max_delay: Optional[int] = None,
                  over_length: Optional[str] = None) -> tuple[HybridPlan, list]:
    """``(plan of the stream, planning seconds per global batch)`` of the hybrid-mode strategy
    ``name`` (:func:`balancer.strategies.registry.get`), with ``config`` (its strategy aside) and
    the keywords on top (:func:`hybrid_config`). ``plan.item_doc`` indexes ``lengths``. A document longer than the
    pool holds is an error naming it, or cut (counted) with ``over_length="chunk"`` (fixed
    degrees always cut what their groups cannot hold: that is the baseline)."""
    if config is not None:   # the name is the strategy: the config's other fields apply
        config = PlannerConfig(**{k: getattr(config, k) for k in config.model_fields_set
                                  if k != "strategy"})
    config = hybrid_config(config, strategy=name, max_delay=max_delay, over_length=over_length)
    fn = strategies.get(name, "hybrid")
    return fn(np.asarray(lengths, np.int64), cost, int(n_ranks), int(batch_tokens), config)


__all__ = ["HYBRID_DEFAULT_STRATEGY", "HYBRID_STRATEGIES", "check_pieces", "check_pool_limit",
           "cp_cost_model",
           "default_strategies", "fixed_degrees", "global_batches", "hybrid_config",
           "plan_strategy"]
