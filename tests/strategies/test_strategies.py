"""The strategy registry (issue #12): one module per strategy, registered in the order of
``STRATEGY_MODULES``; everything that lists strategies (CLI defaults, report baselines, test
lists) is derived from it, so a new strategy is one new module plus one registry line."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from balancer.strategies import registry as strategies
from balancer.cli import args as cli_args
from balancer.config import PlannerConfig as PC
from balancer.report import build
from balancer.strategies import registry

PKG = Path(registry.__file__).parent


def test_names_follow_the_module_list():
    assert strategies.names() == list(registry.STRATEGY_MODULES)
    # the shipped ones keep their order (a new strategy adds a name, it changes none of these)
    shipped = ["sequential", "ffd_tokens", "kk_tokens", "balanced"]
    assert [n for n in strategies.names() if n in shipped] == shipped
    assert list(cli_args.DEFAULT_STRATEGIES) == strategies.names()
    assert list(build.BASELINES) == strategies.baselines()
    assert [n for n in strategies.baselines() if n in shipped] == shipped[:3]


def test_every_module_registers_its_own_name_once():
    files = {p.stem for p in PKG.glob("*.py")} - {"__init__", "registry"}
    assert files == set(registry.STRATEGY_MODULES)
    for m in registry.STRATEGY_MODULES:
        tree = ast.parse((PKG / f"{m}.py").read_text())
        regs = [d for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                for d in n.decorator_list
                if isinstance(d, ast.Call) and getattr(d.func, "id", None) == "register"]
        assert len(regs) == 1 and regs[0].args[0].value == m, m


@pytest.mark.parametrize("name", strategies.names())
def test_knobs_are_config_fields_and_docs_are_one_line(name):
    assert set(strategies.knobs(name)) <= set(PC.model_fields)
    assert strategies.describe(name) and "\n" not in strategies.describe(name)


def test_unknown_names_and_knobs_are_refused():
    with pytest.raises(ValueError, match=r"unknown strategy 'nope'; known: \['sequential'"):
        strategies.get("nope")
    with pytest.raises(ValueError, match=r"knobs \['max_dealy'\] are not PlannerConfig fields"):
        registry.register("x", "y", knobs=("max_dealy",))
    with pytest.raises(ValueError, match="already registered"):
        registry.register("balanced", "again")(lambda *a: None)



def test_baseline_budgets_are_tokens_or_samples():
    assert registry.token_and_count_budget(100, None) == (100, None)
    assert registry.token_and_count_budget(7, np.ones(3)) == (1 << 62, 7)
