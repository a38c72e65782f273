"""Cost-balanced microbatches for DP x PP x CP training: sample metadata, cost models, the step
planner, plans, metrics and the command line."""
from .config import Layout, PlannerConfig
from .cost import CostModel, ModelSpec, PassCost, load_cost_model
from .planner import Items, Plan, epoch_order, plan_epoch, plan_epochs
from .samples import SampleTable

__all__ = ["CostModel", "Items", "Layout", "ModelSpec", "PassCost", "Plan", "PlannerConfig",
           "SampleTable", "epoch_order", "load_cost_model", "plan_epoch", "plan_epochs"]
__version__ = "0.1.0"
