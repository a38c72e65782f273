"""Old module paths, kept importable after the modules moved into sub-packages (issue #12).

``import balancer.sampler`` or ``from balancer.planner import Plan`` gives the module object of
the new path itself (``balancer.loader.sampler``, ``balancer.planning.planner``), not a copy, so
monkeypatching either name and ``isinstance`` keep working. Where the old path is now the name
of a sub-package (``balancer.cost``, ``balancer.store``, ...), that package forwards the old
module's attributes instead (:func:`forward`); see :data:`PACKAGE_OF`.

This module imports nothing from the package: the finder imports the new module only when an
old name is asked for."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

#: old module path -> new module path (a plain alias: the same module object)
MOVED: dict[str, str] = {
    "balancer.calibration": "balancer.cost.calibration",
    "balancer.cp_cost": "balancer.cost.cp",
    "balancer.planner": "balancer.planning.planner",
    "balancer.hybrid": "balancer.planning.hybrid",
    "balancer.precompute": "balancer.store.precompute",
    "balancer.metrics": "balancer.report.metrics",
    "balancer.compare": "balancer.report.compare",
    "balancer.report_md": "balancer.report.markdown",
    "balancer.plots": "balancer.report.plots",
    "balancer.sampler": "balancer.loader.sampler",
    "balancer.collate": "balancer.loader.collate",
    "balancer.cp_shard": "balancer.loader.cp_shard",
    "balancer.adapters": "balancer.loader.adapters",
    "balancer.mm_cost": "balancer.multimodal.cost",
    "balancer.mm_plan": "balancer.multimodal.plan",
    "balancer.mm_collate": "balancer.multimodal.collate",
    "balancer.mm_workloads": "balancer.multimodal.workloads",
    "balancer.cli_args": "balancer.cli.args",
    "balancer.store_cli": "balancer.cli.store",
    "balancer.calibration_cli": "balancer.cli.calibrate",
    "balancer.hybrid_eval": "balancer.planning.hybrid_eval",
    "balancer.hybrid_loader": "balancer.loader.hybrid",
    "balancer.hybrid_report": "balancer.cli.hybrid_report",
}

#: old module path that is now a sub-package -> the module whose attributes it forwards
PACKAGE_OF: dict[str, str] = {
    "balancer.cost": "balancer.cost.model",
    "balancer.strategies": "balancer.strategies.registry",
    "balancer.store": "balancer.store.plan_store",
    "balancer.report": "balancer.report.build",
    "balancer.multimodal": "balancer.multimodal.table",
    "balancer.cli": "balancer.cli.app",
}


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path of :data:`MOVED` and loads it as the new module object itself."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        # the import system files the module under the old name in sys.modules as well
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__  # its own spec, put back by exec_module
        return module

    def exec_module(self, module):
        # already executed under its new name; the import system has just set __spec__ to
        # the alias spec: give the module back its own (relative imports inside functions
        # and importlib.reload read it)
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        # first: an editable install's finder or a stale checkout must not answer an old path
        sys.meta_path.insert(0, _AliasFinder())


def forward(package: str, *modules: str):
    """A module ``__getattr__`` for ``package`` (an old module path that is now a package):
    an attribute it lacks is looked up on ``modules`` in order, each imported on first use (so
    importing one submodule of the package does not import the rest)."""
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        if importlib.util.find_spec(f"{package}.{name}") is not None:
            # a submodule of the package (``from balancer.report import metrics``) wins
            return importlib.import_module(f"{package}.{name}")
        for module in modules:
            target = importlib.import_module(module)
            if hasattr(target, name):
                return getattr(target, name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__
