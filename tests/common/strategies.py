"""Strategy lists of the tests, from the one registry (balancer.strategies.registry), so that a
strategy added there is tested everywhere without editing a list."""
from __future__ import annotations

from balancer.strategies import registry


def each_hybrid_strategy(degree: int = 2) -> list[str]:
    """Every hybrid-mode strategy of the registry once, in registry order; a family
    (``fixed_cp<c>``) as its member of ``degree``."""
    return [n.replace("<c>", str(degree)) if registry.is_family(n) else n
            for n in registry.names("hybrid")]
