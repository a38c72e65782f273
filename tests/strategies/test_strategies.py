"""The strategy registry: one module per strategy, of either CP mode, registered in the order of
``STRATEGY_MODULES``; everything that lists strategies (the CLI's defaults of both modes, the
reports' baselines, each mode's default strategy, the test lists) is derived from it, so a new
strategy is one new module plus one registry line."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from balancer.strategies import registry as strategies
from balancer.cli import args as cli_args
from balancer.cli import hybrid as cli_hybrid
from balancer.config import PlannerConfig as PC
from balancer.cost.cp import CPCostModel
from balancer.planning import hybrid as planning_hybrid
from balancer.report import build
from balancer.report.hybrid import ours
from balancer.strategies import registry
from packing.hybrid_cp import check_plan

PKG = Path(registry.__file__).parent
#: every strategy of every mode (a family as its pattern), in registry order
ALL = [n for m in registry.MODES for n in strategies.names(m)]


def module_of(name: str) -> str:
    return name.removesuffix("<c>")


def test_names_follow_the_module_list():
    assert [module_of(n) for n in ALL] == list(registry.STRATEGY_MODULES)
    # the shipped ones keep their order (a new strategy adds a name, it changes none of these)
    shipped = ["sequential", "ffd_tokens", "kk_tokens", "balanced"]
    assert [n for n in strategies.names() if n in shipped] == shipped
    assert strategies.names() == strategies.names("fixed")
    assert list(cli_args.DEFAULT_STRATEGIES) == strategies.names("fixed")
    assert list(build.BASELINES) == strategies.baselines("fixed")
    assert [n for n in strategies.baselines() if n in shipped] == shipped[:3]
    hybrid = ["hybrid", "hybrid_stream", "megatron_hybrid", "fixed_cp<c>"]
    assert [n for n in strategies.names("hybrid") if n in hybrid] == hybrid


def test_the_hybrid_lists_are_the_registrys():
    for P in (1, 6, 8):
        assert cli_hybrid.parse_strategies(None, P) == strategies.names("hybrid", n_ranks=P) \
            == planning_hybrid.default_strategies(P)
    assert strategies.names("hybrid", n_ranks=6) == ["hybrid", "hybrid_stream",
                                                     "megatron_hybrid", "fixed_cp1", "fixed_cp2"]
    assert planning_hybrid.HYBRID_STRATEGIES == tuple(
        n for n in strategies.names("hybrid") if not strategies.is_family(n))
    assert planning_hybrid.HYBRID_DEFAULT_STRATEGY == strategies.default("hybrid")
    assert ours() == [n for n in strategies.names("hybrid") if not strategies.is_baseline(n)]
    assert strategies.baselines("hybrid") == ["megatron_hybrid", "fixed_cp<c>"]


def test_one_default_per_mode():
    assert strategies.default("fixed") == PC().strategy == "balanced"
    assert strategies.default("hybrid") == "hybrid_stream"
    for m in registry.MODES:
        assert strategies.mode_of(strategies.default(m)) == m
        assert not strategies.is_baseline(strategies.default(m))


def test_every_module_registers_its_own_name_once():
    files = {p.stem for p in PKG.glob("*.py")} - {"__init__", "registry"}
    assert files == set(registry.STRATEGY_MODULES)
    for m in registry.STRATEGY_MODULES:
        tree = ast.parse((PKG / f"{m}.py").read_text())
        regs = [d for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                for d in n.decorator_list
                if isinstance(d, ast.Call) and getattr(d.func, "id", None) == "register"]
        assert len(regs) == 1 and module_of(regs[0].args[0].value) == m, m


@pytest.mark.parametrize("name", ALL)
def test_knobs_are_config_fields_and_docs_are_one_line(name):
    assert set(strategies.knobs(name)) <= set(PC.model_fields)
    assert strategies.describe(name) and "\n" not in strategies.describe(name)
    assert strategies.mode_of(name) in registry.MODES


def test_unknown_names_knobs_and_modes_are_refused():
    with pytest.raises(ValueError, match=r"unknown strategy 'nope'; known: \['sequential'"):
        strategies.get("nope")
    with pytest.raises(ValueError, match=r"knobs \['max_dealy'\] are not PlannerConfig fields"):
        registry.register("x", "y", knobs=("max_dealy",))
    with pytest.raises(ValueError, match="already registered"):
        registry.register("balanced", "again")(lambda *a: None)
    with pytest.raises(ValueError, match=r"mode 'hybird' is not one of"):
        registry.register("x", "y", mode="hybird")
    # a strategy of the other mode is named as such, with the mode's own list
    with pytest.raises(ValueError, match=r"strategy 'hybrid' plans cp_mode 'hybrid', not "
                                         r"'fixed' \(cp_mode 'fixed' strategies: "
                                         r"\['sequential'"):
        strategies.get("hybrid")
    with pytest.raises(ValueError, match=r"strategy 'balanced' plans cp_mode 'fixed'"):
        strategies.get("balanced", "hybrid")
    with pytest.raises(ValueError, match=r"unknown strategy 'fixed_cp3' \(fixed_cp<c> takes a "
                                         r"power of two"):
        strategies.get("fixed_cp3", "hybrid")
    assert strategies.get("fixed_cp4", "hybrid").keywords == {"degree": 4}


def test_baseline_budgets_are_tokens_or_samples():
    assert registry.token_and_count_budget(100, None) == (100, None)
    assert registry.token_and_count_budget(7, np.ones(3)) == (1 << 62, 7)


def mixed(n=120, cap=1024, seed=0):
    rng = np.random.default_rng(seed)
    short = rng.integers(8, cap // 2, n)
    return np.where(rng.random(n) < 0.1, rng.integers(cap, 4 * cap, n), short).astype(np.int64)


@pytest.mark.parametrize("name", strategies.names("hybrid", n_ranks=4))
def test_every_hybrid_strategy_trains_every_token_once(name):
    """Every hybrid-mode strategy the registry lists for a pool, through its registered
    function: a well-formed plan whose items tile every document exactly once, within the
    rank capacity unless the strategy bounds memory per document (Megatron's rule)."""
    cost = CPCostModel.from_preset("llama-7b", 1024)
    L = mixed()
    plan, secs = strategies.get(name, "hybrid")(L, cost, 4, 4 * 2 * 1024,
                                                 strategies.configure("hybrid"))
    check_plan(plan, aligned=name != "megatron_hybrid")
    assert len(secs) == plan.n_steps or name != "hybrid_stream"
    lengths = plan.item_length if plan.item_length.any() else L[plan.item_doc]
    assert np.array_equal(np.bincount(plan.item_doc, weights=lengths, minlength=L.shape[0]), L)
    o = np.lexsort((plan.item_start, plan.item_doc))
    d, s, e = plan.item_doc[o], plan.item_start[o], plan.item_start[o] + lengths[o]
    first = np.r_[True, d[1:] != d[:-1]]
    assert (s == np.where(first, 0, np.r_[0, e[:-1]])).all()   # pieces tile the document
