"""Cost-balanced microbatches for DP x PP x CP training: sample metadata, cost models, the step
planner, plans, metrics and the command line."""
from .config import Layout, PlannerConfig
from .cost.model import CostModel, ModelSpec, PassCost, load_cost_model
from .planning.plan import Items, Plan
from .samples import SampleTable

#: public names imported on first use: the planner (numba) and the torch runtime are not
#: imported by ``import balancer`` or by the loader's collator
_LAZY = {"epoch_order": "planning.stream", "plan_epoch": "planning.planner",
         "plan_epochs": "planning.planner", "PackedBatchSampler": "loader.sampler",
         "MicrobatchRef": "loader.refs", "PackedCollator": "loader.collate",
         "PackedDataset": "loader.collate", "FlatTokens": "loader.collate",
         # hybrid DP x CP
         "HybridBatchSampler": "loader.hybrid", "HybridCollator": "loader.hybrid",
         "CPCostModel": "cost.cp", "CPHardware": "cost.cp", "plan_hybrid": "planning.hybrid",
         "plan_fixed_cp": "planning.hybrid", "plan_megatron_hybrid": "planning.hybrid",
         "estimate": "planning.hybrid", "warmup": "planning.warmup",
         # run-time balancing of streamed batches and RL rollouts
         **{n: "runtime" for n in ("RuntimeBalancer", "StepResult", "StepPlanner", "StepPlan",
                                   "Offers", "balance_rollout", "RolloutMicrobatches",
                                   "StreamingPackedDataset")}}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(name)

__all__ = ["CPCostModel", "CPHardware", "CostModel", "FlatTokens", "HybridBatchSampler",
           "HybridCollator", "Items", "Layout", "MicrobatchRef", "ModelSpec",
           "PackedBatchSampler", "PackedCollator", "PackedDataset", "PassCost", "Plan",
           "PlannerConfig", "SampleTable", "epoch_order", "estimate", "load_cost_model",
           "plan_epoch", "plan_epochs", "plan_fixed_cp", "plan_hybrid", "plan_megatron_hybrid",
           "Offers", "RolloutMicrobatches", "RuntimeBalancer", "StepPlan", "StepPlanner",
           "StepResult", "StreamingPackedDataset", "balance_rollout", "warmup"]
__version__ = "0.1.0"
