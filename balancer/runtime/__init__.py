"""Run-time balancing of data that arrives while training runs (streams, RL rollouts): every
step, the DP ranks all-gather their samples' lengths, plan the same step with the offline
planner's ``balanced`` kernel, exchange the samples with one all-to-all and collate packed
microbatches; results go back to the samples' ranks in their original order. See README.md in
this folder for what flows in and out."""
from .payload import Columns, FieldSpec
from .plan import Offers, StepPlan, StepPlanner, imbalance


def __getattr__(name):  # the torch.distributed parts load on first use
    if name in ("RuntimeBalancer", "StepResult"):
        from . import runtime_balancer
        return getattr(runtime_balancer, name)
    if name in ("balance_rollout", "RolloutMicrobatches"):
        from . import rollout
        return getattr(rollout, name)
    if name == "StreamingPackedDataset":
        from . import stream
        return getattr(stream, name)
    raise AttributeError(f"module 'balancer.runtime' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


__all__ = ["Columns", "FieldSpec", "Offers", "RolloutMicrobatches", "RuntimeBalancer",
           "StepPlan", "StepPlanner", "StepResult", "StreamingPackedDataset", "balance_rollout",
           "imbalance"]
