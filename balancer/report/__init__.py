"""Figures of a plan: metrics, the strategy comparison, the imbalance report (json, markdown,
plots). Plans and cost models in, dicts and files out."""
from .._moved import forward

# ``balancer.report`` was one module before issue #12: its names still resolve here
# (the report command's helpers, run_report and co., moved to balancer.cli.report)
__getattr__ = forward(__name__, "balancer.report.build", "balancer.cli.report")
