"""Multimodal samples: the table (``table``), encoder/LLM cost (``cost``), the planner with
its media phase (``plan``), the collator (``collate``) and synthetic workloads (``workloads``)."""
from .._moved import forward

# ``balancer.multimodal`` was one module before issue #12: its names still resolve here
__getattr__ = forward(__name__, "balancer.multimodal.table")
