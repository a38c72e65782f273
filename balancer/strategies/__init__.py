"""Packing strategies by name (``registry``): sizes, costs, layout and budget in, a
``packing.StreamPlan`` out."""
from .._moved import forward

# ``balancer.strategies`` was one module before issue #12: its names still resolve here
__getattr__ = forward(__name__, "balancer.strategies.registry")
