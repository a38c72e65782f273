"""Cost-balanced microbatches for DP x PP x CP training: sample metadata, cost models, the step
planner, plans, metrics and the command line."""
from . import _moved

_moved.install()  # old module paths (balancer.sampler, balancer.planner, ...) keep working

from .config import Layout, PlannerConfig
from .cost.model import CostModel, ModelSpec, PassCost, load_cost_model
from .planning.planner import Items, Plan, epoch_order, plan_epoch, plan_epochs
from .samples import SampleTable


def __getattr__(name):  # the torch runtime is imported only when asked for
    if name in ("PackedBatchSampler", "MicrobatchRef"):
        from .loader import sampler
        return getattr(sampler, name)
    if name in ("PackedCollator", "PackedDataset", "FlatTokens"):
        from .loader import collate
        return getattr(collate, name)
    if name in ("HybridBatchSampler", "HybridCollator"):   # hybrid DP x CP (issue #15)
        from . import hybrid_loader
        return getattr(hybrid_loader, name)
    if name in ("CPCostModel", "CPHardware"):
        from . import cp_cost
        return getattr(cp_cost, name)
    if name in ("plan_hybrid", "plan_fixed_cp", "plan_megatron_hybrid", "estimate"):
        from . import hybrid
        return getattr(hybrid, name)
    raise AttributeError(name)

__all__ = ["CPCostModel", "CPHardware", "CostModel", "FlatTokens", "HybridBatchSampler",
           "HybridCollator", "Items", "Layout", "MicrobatchRef", "ModelSpec",
           "PackedBatchSampler", "PackedCollator", "PackedDataset", "PassCost", "Plan",
           "PlannerConfig", "SampleTable", "epoch_order", "estimate", "load_cost_model",
           "plan_epoch", "plan_epochs", "plan_fixed_cp", "plan_hybrid", "plan_megatron_hybrid"]
__version__ = "0.1.0"
