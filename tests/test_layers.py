"""The package's one-way flow: every import inside ``balancer/`` and ``packing/``, module level
or inside a function, goes to the same layer's own sub-package or to a lower layer, never up and
never sideways into another sub-package of the same layer; ``tools/`` sits above the package and
nothing below imports it; no cycles (``tools/`` included); and the module paths retired when the
modules moved into sub-packages are gone: no import, no string naming a module to import, no
reference in code or docs uses them."""
from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]

#: low to high; sub-packages of the same rank may not import each other. A mode of context
#: parallelism is no layer of its own: the hybrid mode lives in each layer under the name
#: ``hybrid`` (strategies in the one registry, planning/hybrid/, store/hybrid/, report/hybrid/,
#: loader/hybrid.py, cli/hybrid.py)
LAYERS = {
    "packing": 0,
    "balancer": 1,  # the base modules: config, samples, resources, workloads, zigzag, frozen
    "balancer.cost": 2,
    "balancer.strategies": 3,
    "balancer.planning": 4,
    "balancer.store": 5,
    "balancer.loader": 6,  # the sampler reads stored plans (plan_dir=)
    "balancer.multimodal": 7,  # its collator builds on the loader's, its planner on the planner
    # the figures of plans of every mode; only the CLI and tools read them (nothing that plans,
    # stores or trains depends on the report layer)
    "balancer.runtime": 8, "balancer.integrations": 8, "balancer.report": 8,
    "balancer.cli": 9,
    "tools": 100,  # benchmarks, the demo trainer, calibration: above the package and its facade
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
    for pkg in ("balancer", "packing", "tools"):
        for p in sorted((ROOT / pkg).rglob("*.py")):
            out[module_name(p)] = p
    return out


MODULES = modules()


def exists(name: str) -> bool:
    return name in MODULES


def canonical(name: str) -> str:
    """The module an import of ``name`` loads (no aliases: every module has one path)."""
    return name


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
                targets.append(sub if exists(sub) else src)
        else:
            continue
        for t in targets:
            if t.split(".")[0] in ("balancer", "packing", "tools"):
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


#: module paths retired when the modules moved into sub-packages; none may come back
RETIRED = (
    "balancer.calibration", "balancer.cp_cost", "balancer.planner", "balancer.hybrid",
    "balancer.precompute", "balancer.metrics", "balancer.compare", "balancer.report_md",
    "balancer.plots", "balancer.sampler", "balancer.collate", "balancer.cp_shard",
    "balancer.adapters", "balancer.mm_cost", "balancer.mm_plan", "balancer.mm_collate",
    "balancer.mm_workloads", "balancer.cli_args", "balancer.store_cli", "balancer.calibration_cli",
    "balancer.hybrid_eval", "balancer.hybrid_loader", "balancer.hybrid_report", "balancer._moved",
    # the hybrid mode brought inside the layers (strategies registry, planning/hybrid/,
    # store/hybrid/, report/hybrid/, cli/hybrid.py) and the run-time balancer's module named
    "balancer.planning.hybrid_eval", "balancer.planning.hybrid_epoch",
    "balancer.planning.hybrid_batch", "balancer.planning.hybrid_bound",
    "balancer.planning.hybrid_stream", "balancer.planning.megatron_hybrid",
    "balancer.store.hybrid_store", "balancer.store.hybrid_check", "balancer.cli.hybrid_report",
    "balancer.cli.hybrid_store", "balancer.runtime.balancer",
)
RETIRED_RE = re.compile(
    r"\b(" + "|".join(re.escape(r) for r in RETIRED) + r")\b(?![\w/])"
    # "from balancer import sampler, mm_cost" names them too (a shell heredoc, a docs snippet)
    + r"|from balancer import ([\w, ]*\b(?:"
    + "|".join(r.rpartition(".")[2] for r in RETIRED) + r")\b)")
#: everything a user or CI reads: code, tests, tools, examples, docs, configs, CI
SCANNED = [p for p in sorted(ROOT.rglob("*"))
           if p.is_file() and p.relative_to(ROOT).parts[0] in (
               "balancer", "packing", "tools", "examples", "tests", "configs", "docs", "benchmarks",
               ".ci", "README.md", "pyproject.toml", "dev")
           and "__pycache__" not in p.parts and p.suffix in (".py", ".md", ".yaml", ".toml", "")
           and p != Path(__file__).resolve()]


def test_retired_paths_are_not_modules():
    # no module file, no package, no finder: a retired path is gone from the tree
    back = [old for old in RETIRED if exists(old)
            or (ROOT / old.replace(".", "/")).with_suffix(".py").exists()]
    assert not back, f"retired module paths are back: {back}"
    lazy = [old for old in RETIRED if old.rpartition(".")[2] in vars(__import__("balancer"))]
    assert not lazy, f"retired names on the package: {lazy}"


#: references left to the README's rewrite (README.md is edited on its own branch): (file, path);
#: delete an entry once the file no longer names the path
PENDING_DOCS: set = set()


def test_no_reference_to_a_retired_path():
    bad = [f"{p.relative_to(ROOT)}:{i}: {m.group(0)}" for p in SCANNED
           for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
           for m in RETIRED_RE.finditer(line) if m.group(0)
           and (str(p.relative_to(ROOT)), m.group(0)) not in PENDING_DOCS]
    assert not bad, "retired module paths:\n" + "\n".join(bad)


MODULE_STRING = re.compile(r"^(balancer|packing|tools)(\.[A-Za-z_]\w*)+$")


def _resolves(dotted: str) -> bool:
    """``dotted`` is a module of the tree, or an attribute of one (``pkg.mod.name``)."""
    if exists(dotted):
        return True
    mod, _, attr = dotted.rpartition(".")
    if not exists(mod):
        return False
    tree = ast.parse(MODULES[mod].read_text())
    lazy = {k.value for n in ast.walk(tree) if isinstance(n, ast.Dict)
            for k in n.keys if isinstance(k, ast.Constant)}  # names a package loads on first use
    if attr in lazy:
        return True
    return attr in {n.name for n in ast.walk(tree)
                    if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
        t.id for n in ast.walk(tree) if isinstance(n, ast.Assign)
        for t in n.targets if isinstance(t, ast.Name)} | {
        (a.asname or a.name).split(".")[0] for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}


def test_module_strings_resolve():
    # what the import graph cannot see: importlib.import_module("balancer.x"), a command table
    # of module names, monkeypatch.setattr("balancer.x.name", ...): every string constant that
    # is a dotted path into the tree names a module of it, or an attribute of one
    bad = []
    for p in SCANNED:
        if p.suffix != ".py":
            continue
        for n in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) \
                    and MODULE_STRING.match(n.value) and not _resolves(n.value):
                bad.append(f"{p.relative_to(ROOT)}:{n.lineno}: {n.value!r}")
    assert not bad, "strings naming modules that do not exist:\n" + "\n".join(bad)
