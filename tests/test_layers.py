"""The package's one-way flow (issue #12): every import inside ``balancer/`` and ``packing/``,
module level or inside a function, goes to the same layer's own sub-package or to a lower
layer, never up and never sideways into another sub-package of the same layer; no cycles; and
every old module path resolves to the module that now holds it."""
from __future__ import annotations

import ast
import builtins
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from balancer import _moved

ROOT = Path(__file__).resolve().parents[1]

#: low to high; sub-packages on one line of the same rank may not import each other
LAYERS = {
    "packing": 0,
    "balancer": 1,  # the base modules: config, samples, resources, workloads, zigzag, _moved
    "balancer.cost": 2,
    "balancer.strategies": 3,
    "balancer.planning": 4,
    "balancer.store": 5, "balancer.report": 5,
    "balancer.loader": 6,  # the sampler reads stored plans (plan_dir=)
    "balancer.multimodal": 7,  # its collator builds on the loader's, its planner on metrics
    "balancer.runtime": 8, "balancer.integrations": 8,
    "balancer.cli": 9,
}
#: the public facade (``from balancer import ...``) and ``python -m balancer``: above everything
FACADE = {"balancer", "balancer.__main__"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    out = {}
    for pkg in ("balancer", "packing"):
        for p in sorted((ROOT / pkg).rglob("*.py")):
            out[module_name(p)] = p
    return out


MODULES = modules()


def exists(name: str) -> bool:
    return name in MODULES


def canonical(name: str) -> str:
    """The module an import of ``name`` really loads: old paths mapped to their new home."""
    name = _moved.MOVED.get(name, name)
    return _moved.PACKAGE_OF.get(name, name)


def imports(mod: str, path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a balancer/packing module in ``path``."""
    is_pkg = path.name == "__init__.py"
    package = mod if is_pkg else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module
            targets = []
            for a in node.names:
                sub = f"{src}.{a.name}"
                targets.append(sub if exists(canonical(sub)) or sub in _moved.MOVED else src)
        else:
            continue
        for t in targets:
            if t.split(".")[0] in ("balancer", "packing"):
                out.append((node.lineno, t))
    return out


def layer_of(mod: str) -> tuple[int, str]:
    parts = mod.split(".")
    for k in (".".join(parts[:2]), parts[0]):
        if k in LAYERS:
            if k == "balancer" and len(parts) == 1:
                break
            return LAYERS[k], k
    return 99, mod  # the facade


def graph() -> dict[str, set[str]]:
    return {m: {canonical(t) for _, t in imports(m, p)} for m, p in MODULES.items()}


def test_every_import_resolves():
    bad = [f"{p.relative_to(ROOT)}:{line}: {t}" for m, p in MODULES.items()
           for line, t in imports(m, p) if not exists(canonical(t))]
    assert not bad, "imports of modules that do not exist:\n" + "\n".join(bad)


def test_no_upward_or_sideways_import():
    bad = []
    for m, p in MODULES.items():
        if m in FACADE:
            continue
        lm, pm = layer_of(m)
        for line, t in imports(m, p):
            t = canonical(t)
            lt, pt = layer_of(t)
            if lt > lm or (lt == lm and pt != pm):
                bad.append(f"{p.relative_to(ROOT)}:{line}: {m} (layer {lm}, {pm}) imports {t} "
                           f"(layer {lt}, {pt})")
    assert not bad, "imports against the one-way flow:\n" + "\n".join(bad)


def test_no_import_cycle():
    g = graph()
    # Tarjan's strongly connected components; any with two or more modules is a cycle
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert not sccs, f"import cycles: {sccs}"


def _unbound_names(tree: ast.Module) -> list[tuple[int, str]]:
    """Names read anywhere in a module that nothing in it binds (nor builtins): a name lost when
    code moved between modules (a coarse check: any binding anywhere in the file counts)."""
    bound = set(dir(builtins)) | {"__file__", "__name__", "__doc__", "__spec__", "__package__",
                                  "__path__", "__builtins__"}
    for n in ast.walk(tree):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
            bound.add(n.id)
        elif isinstance(n, ast.arg):
            bound.add(n.arg)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            bound.add(n.name)
        elif isinstance(n, (ast.Global, ast.Nonlocal)):
            bound.update(n.names)
        elif isinstance(n, ast.MatchAs) and n.name:
            bound.add(n.name)
    return [(n.lineno, n.id) for n in ast.walk(tree)
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id not in bound]


def test_no_name_lost_in_a_move():
    bad = [f"{p.relative_to(ROOT)}:{line}: {name}" for p in MODULES.values()
           for line, name in _unbound_names(ast.parse(p.read_text()))]
    assert not bad, "names read but never defined or imported:\n" + "\n".join(bad)


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_old_path_is_the_new_module(old):
    new = importlib.import_module(_moved.MOVED[old])
    assert importlib.import_module(old) is new
    assert sys.modules[old] is new
    parent, _, leaf = old.rpartition(".")
    assert getattr(importlib.import_module(parent), leaf) is new
    assert new.__spec__.name == new.__name__ == _moved.MOVED[old]


@pytest.mark.parametrize("old", sorted(_moved.PACKAGE_OF))
def test_old_module_names_resolve_on_its_package(old):
    pkg, target = importlib.import_module(old), importlib.import_module(_moved.PACKAGE_OF[old])
    names = [n for n in vars(target) if not n.startswith("__") and n != "annotations"]
    assert names
    for n in names:
        assert getattr(pkg, n) is getattr(target, n), n


def test_old_paths_in_a_fresh_interpreter():
    # the way other code spells them: from-imports of modules and of names, monkeypatching
    code = (
        "import balancer.sampler, balancer.loader.sampler as s\n"
        "assert balancer.sampler is s\n"
        "from balancer import mm_cost, planner, strategies, report as R, store\n"
        "from balancer.multimodal import cost as c\n"
        "assert mm_cost is c and planner is __import__('balancer.planning.planner').planning.planner\n"
        "from balancer.cost import CostModel, config_dir\n"
        "from balancer.cost.model import CostModel as C2\n"
        "assert CostModel is C2 and strategies.names() and R.build_report and store.load_plan\n"
        "from balancer.collate import PackedCollator\n"
        "from balancer import PackedCollator as P2\n"
        "assert PackedCollator is P2\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
