"""Figures of a plan: metrics, the strategy comparison, the imbalance report (json, markdown,
plots). Plans and cost models in, dicts and files out."""
from .._moved import forward

# ``balancer.report`` was one module before issue #12: its names still resolve here
__getattr__ = forward(__name__, "balancer.report.build")
