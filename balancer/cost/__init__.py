"""Cost models: per-document forward/backward cost (``model``), CP cost with the K/V exchange
(``cp``), fitting presets to measured passes (``calibration``). Lengths in, costs out."""
