"""What a cost formula must provide. Everything that asks "what does this cost"
goes through these methods, never through a formula's coefficients: the planner and the
metrics (:mod:`balancer.cost.blocks`), CP sharding (:mod:`balancer.loader.cp_shard`),
calibration (:mod:`balancer.cost.calibration`), the CP cost model (:mod:`balancer.cost.cp`) and
the multimodal cost model's LLM part (:mod:`balancer.multimodal.cost`).

:class:`balancer.cost.model.CostModel` (``a L^2 + b L + d`` per document and pass, ``c`` per
microbatch) is the implementation the package ships; a new formula implements this protocol
and every consumer above works with it unchanged."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class CostFormula(Protocol):
    """Costs of documents (int64 lengths in, float64 out), in the formula's ``unit``."""

    name: str
    unit: str

    def doc_costs(self, lengths) -> tuple[np.ndarray, np.ndarray]:
        """Per-document ``(forward, backward)`` float64[n] each, without the per-microbatch
        constant; a cost that overflows float64 is a ValueError naming the sample."""

    def doc_total(self, lengths) -> np.ndarray:
        """Forward plus backward per document, float64[n]: what the planner balances."""

    @property
    def microbatch_constant(self) -> tuple[float, float]:
        """``(forward, backward)`` cost every microbatch pays once, whatever it holds."""

    def doc_parts(self, lengths) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per-document ``(attention forward, attention backward, linear, per-document
        constant)`` float64[n] each (recompute included), summing to :meth:`doc_total`: the
        CP cost model scales each part with the CP degree."""

    def shard_costs(self, lengths, cp: int) -> tuple[np.ndarray, np.ndarray]:
        """CP placement costs of the documents of one microbatch: ``(whole float64[n],
        sharded float64[n, cp])``, the forward plus backward of each document placed whole on
        one CP rank, and of each CP rank's zigzag shard of it."""

    def calibration_features(self, doc_lengths, offsets) -> np.ndarray:
        """The design matrix float64[M, k] of microbatches (documents ``doc_lengths`` grouped
        by ``offsets`` int64[M + 1]) whose least-squares fit against measured pass times gives
        the formula's coefficients (column order: the coefficients' order)."""
