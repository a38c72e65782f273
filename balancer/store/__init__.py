"""The plan store: plans written ahead of training (``precompute``) into a plan directory
and read back (``plan_store``)."""
from .._moved import forward

# ``balancer.store`` was one module before issue #12: its names still resolve here
__getattr__ = forward(__name__, "balancer.store.plan_store")
