"""Cost models: per-document forward/backward cost (``model``), CP cost with the K/V exchange
(``cp``), fitting presets to measured passes (``calibration``). Lengths in, costs out."""
from .._moved import forward

# ``balancer.cost`` was one module before issue #12: its names still resolve here
__getattr__ = forward(__name__, "balancer.cost.model")
