"""``balanced`` fills its steps (issue 27 items 1, 6): packing efficiency within 0.5 points of
the hard limit -- the fewest microbatches the tokens need, ceil(tokens / capacity) rounded up to
a multiple of dp -- on shipped workloads and on held-out-style distributions built here (heavy
tails to 10x the capacity, chunked; real-document-like; bimodal SFT; long tail). The lead case:
the look-ahead reads heavy documents up to max_advance steps early, so the first steps are
nearly all heavy; the intake counted them against the budget, so no light document was read to
fill the holes they leave, and those steps were underfilled (97.7% where the limit is 99.4%).
"""
from __future__ import annotations

import numpy as np
import pytest

from balancer import CostModel, Layout, PlannerConfig, SampleTable, plan_epoch, workloads

COST = CostModel.quadratic(65536)


def efficiency_and_limit(plan) -> tuple[float, float]:
    """(tokens / (microbatches x capacity), the same with the fewest microbatches possible)."""
    lay = plan.layout
    tokens = int(plan.entry_length.sum())
    mbs = plan.mb_offsets.shape[0] - 1
    need = -(-tokens // lay.capacity)
    fewest = -(-need // lay.dp) * lay.dp
    return tokens / (mbs * lay.capacity), tokens / (fewest * lay.capacity)


def real_docs(n=52_000, seed=0):
    """Median ~450 tokens, 1% of documents from a Pareto tail up to 1.44M (chunked)."""
    r = np.random.default_rng(seed)
    a = np.where(r.random(n) < 0.01, 20_000 * (1 + r.pareto(0.9, n)),
                 r.lognormal(np.log(447), 1.3, n))
    return np.clip(a, 1, 1_440_000).astype(np.int64)


def heavy_tail(n=200_000, seed=0):
    """Pareto(1.05) x 300 tokens, up to 10x a 128K capacity."""
    r = np.random.default_rng(seed)
    return np.clip(r.pareto(1.05, n) * 300, 1, 1_310_720).astype(np.int64)


def long_tail(n=200_000, seed=1):
    r = np.random.default_rng(seed)
    return np.clip(r.lognormal(np.log(1500), 1.6, n), 1, 1_000_000).astype(np.int64)


CASES = {
    "real-docs 8x5 128K": (real_docs, dict(dp=8, microbatches=5, capacity=131072)),
    "heavy-tail-10x 8x5 128K": (heavy_tail, dict(dp=8, microbatches=5, capacity=131072)),
    "long-tail 8x4 128K": (long_tail, dict(dp=8, microbatches=4, capacity=131072)),
    "bimodal-sft 64x4 16K": (lambda: workloads.load("bimodal-sft", n=300_000, seed=1),
                             dict(dp=64, microbatches=4, capacity=16384)),
    "wlbllm pp4 128K": (lambda: workloads.load("wlbllm"),
                        dict(dp=1, pp=4, microbatches=4, capacity=131072)),
    "wikipedia 8x4 32K": (lambda: workloads.load("wikipedia", n=300_000, seed=0),
                          dict(dp=8, microbatches=4, capacity=32768)),
    "prolong 4x2pp 2cp 64K": (lambda: workloads.load("prolong"),
                              dict(dp=4, pp=2, cp=2, microbatches=4, capacity=65536)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_balanced_packs_within_half_a_point_of_the_hard_limit(case):
    make, lay = CASES[case]
    lengths = make()
    plan = plan_epoch(SampleTable(lengths), COST, Layout(**lay),
                      PlannerConfig(over_length="chunk"))
    eff, limit = efficiency_and_limit(plan)
    assert eff >= limit - 0.005, (case, eff, limit)
    # every sample's tokens exactly once
    assert int(plan.entry_length.sum()) == int(lengths.sum())


def _uniform(n, hi, seed):
    return np.random.default_rng(seed).integers(1, hi + 1, n).astype(np.int64)


#: critically loaded: about half the documents are longer than half a microbatch, so nearly
#: every microbatch must hold one of them plus the short ones that make up its complement
CRITICAL = {
    "uniform-32k 8x4 32K": (lambda: workloads.load("uniform-32k"),
                            dict(dp=8, microbatches=4, capacity=32768)),
    "uniform 16K 16x8 16K": (lambda: _uniform(150_000, 16384, 3),
                             dict(dp=16, microbatches=8, capacity=16384)),
    "lognormal cap/3 8x4 32K": (
        lambda: np.clip(np.random.default_rng(4).lognormal(np.log(32768 / 3), 0.8, 100_000),
                        1, 32768).astype(np.int64), dict(dp=8, microbatches=4, capacity=32768)),
    "uniform to 2x, chunked 8x4 32K": (lambda: _uniform(100_000, 65536, 5),
                                       dict(dp=8, microbatches=4, capacity=32768)),
}


@pytest.mark.parametrize("scale", [65536, 4096])
@pytest.mark.parametrize("case", sorted(CRITICAL))
def test_critically_loaded_steps_are_packed_for_tokens_first(case, scale):
    """LPT on cost left 3-6% of these steps empty (efficiency 0.940-0.977 where Martello-Toth's
    L2 bound allows 0.998-0.9998); the token-first step (packing.balanced_fill), with the intake
    reading no further once a long document waits for every microbatch, packs them to within
    1.5 points of L2 (0.984-0.994; 0.5-1.4 points), every delay within max_delay."""
    from packing.binpack import bins_lower_bound_l2
    make, lay = CRITICAL[case]
    lengths = make()
    layout = Layout(**lay)
    plan = plan_epoch(SampleTable(lengths), CostModel.quadratic(scale), layout,
                      PlannerConfig(over_length="chunk"))
    tokens = int(plan.entry_length.sum())
    eff = tokens / ((plan.mb_offsets.shape[0] - 1) * layout.capacity)
    l2 = -(-bins_lower_bound_l2(plan.entry_length, layout.capacity) // layout.dp) * layout.dp
    assert eff >= tokens / (l2 * layout.capacity) - 0.015, (case, eff)
    assert plan.entry_delay.max() <= PlannerConfig().max_delay
    assert tokens == int(lengths.sum())


def _long_half(n, seed, capacity=32768):
    """Half the documents 0.6-1.0 of a microbatch, half 1..capacity/10: more long documents
    arrive with a step's tokens (about 38) than the step has microbatches (32)."""
    r = np.random.default_rng(seed)
    return np.where(r.random(n) < 0.5, r.integers(int(0.6 * capacity), capacity + 1, n),
                    r.integers(1, capacity // 10 + 1, n)).astype(np.int64)


@pytest.mark.parametrize("scale", [65536, 4096])
@pytest.mark.parametrize("seed", [2, 7])
def test_long_documents_arriving_faster_than_microbatches_keep_the_delay_bound(seed, scale):
    """Long documents (over half a microbatch) cannot share one. The intake read by tokens, so
    where they come faster than one a microbatch they queued without bound: delays of 17-909
    steps, counted in stats["delay_bound_exceeded"], and the default tail='partial' failed at
    the end ("4 items cannot be spread over 8 DP ranks"). The intake now stops once the pool
    holds a long document for every microbatch: every delay within the bound, every token
    exactly once, efficiency at Martello-Toth's L2 limit (the long documents decide it) on seed
    2 and 1.0 point below it on seed 7 (8 steps of short documents are left for the epoch's
    end: no step reads ahead in the stream's last max_delay + max_advance + 1 steps' worth of
    light weight, far more than 17 steps of this stream)."""
    from packing.binpack import bins_lower_bound_l2
    lengths = _long_half(60_000, seed)
    layout = Layout(dp=8, microbatches=4, capacity=32768)
    plan = plan_epoch(SampleTable(lengths), CostModel.quadratic(scale), layout, PlannerConfig())
    assert plan.entry_delay.max() <= PlannerConfig().max_delay
    assert plan.stats["delay_bound_exceeded"] == 0
    tokens = int(plan.entry_length.sum())
    assert tokens == int(lengths.sum())
    eff = tokens / ((plan.mb_offsets.shape[0] - 1) * layout.capacity)
    l2 = -(-bins_lower_bound_l2(plan.entry_length, layout.capacity) // layout.dp) * layout.dp
    assert eff >= tokens / (l2 * layout.capacity) - 0.012, eff


@pytest.mark.parametrize("scale", [65536, 4096])
@pytest.mark.parametrize("lay", [dict(dp=4, pp=2, microbatches=4),
                                 dict(dp=8, cp=2, microbatches=4)],
                         ids=["4dp-2pp-microbatch-units", "8dp-2cp"])
def test_long_documents_keep_the_delay_bound_in_other_layouts(lay, scale):
    """The same cap holds with microbatch units (pp > 1) and under CP (sizes padded): on 20K
    documents, half long, these failed at the tail ("2 items cannot be spread over 4 DP ranks")
    or waited up to 281 steps."""
    lengths = _long_half(20_000, 3)
    plan = plan_epoch(SampleTable(lengths), CostModel.quadratic(scale),
                      Layout(capacity=32768, **lay), PlannerConfig())
    assert plan.entry_delay.max() <= PlannerConfig().max_delay
    assert int(plan.entry_length.sum()) == int(lengths.sum())


#: microbatch units: pipeline stages (pp > 1), or ranks that wait for each other after every
#: microbatch (sync='microbatch': FSDP, ZeRO-3)
MICROBATCH_UNITS = {
    "4dp-2pp-8mb": dict(dp=4, pp=2, microbatches=8, capacity=32768),
    "8dp-lockstep-4mb": dict(dp=8, microbatches=4, capacity=32768, sync="microbatch"),
}


@pytest.mark.parametrize("scale", [65536, 4096])
@pytest.mark.parametrize("case", sorted(MICROBATCH_UNITS))
def test_microbatch_units_are_packed_for_tokens_first_too(case, scale):
    """uniform-32k with microbatch units: LPT on cost left 6.5-7.2 points of the steps empty
    (0.928-0.935 where L2 allows 0.998). The token-first step, kept where it is no less
    balanced (pipeline: its costliest microbatch, and its costliest rank after the split over
    ranks; lockstep: its lockstep time) and leaves no more waiting tokens behind, packs
    0.947-0.974, every delay within the bound."""
    lengths = workloads.load("uniform-32k", n=100_000, seed=0)
    layout = Layout(**MICROBATCH_UNITS[case])
    plan = plan_epoch(SampleTable(lengths), CostModel.quadratic(scale), layout,
                      PlannerConfig(over_length="chunk"))
    tokens = int(plan.entry_length.sum())
    assert tokens == int(lengths.sum())
    eff = tokens / ((plan.mb_offsets.shape[0] - 1) * layout.capacity)
    assert eff >= 0.94, (case, eff)
    assert plan.entry_delay.max() <= PlannerConfig().max_delay
    assert (plan.entry_delay < 0).sum() > 1000  # short documents read ahead into the holes


def test_token_first_microbatch_units_keep_waiting_documents_within_the_bound():
    """With microbatch units the token-first step's best fit took fresh and waiting documents
    alike, largest first, and was kept whenever it was no less balanced: on lognormal 4K-median
    documents (4 DP x 2 PP x 8 x 32K, L + L^2/4096) the waiting ones piled up behind the heavy
    documents the look-ahead reads early, 1.2M tokens due in a step of 1.05M, and 74 documents
    waited 5 steps. The waiting documents now go first and a step that leaves more of their
    tokens behind than LPT keeps LPT's packing."""
    lengths = workloads.load("lognormal-4k", n=100_000, seed=0)
    plan = plan_epoch(SampleTable(lengths), CostModel.quadratic(4096),
                      Layout(dp=4, pp=2, microbatches=8, capacity=32768),
                      PlannerConfig(over_length="chunk"))
    assert plan.stats["delay_bound_exceeded"] == 0
    assert plan.entry_delay.max() <= PlannerConfig().max_delay
    assert int(plan.entry_length.sum()) == int(lengths.sum())
