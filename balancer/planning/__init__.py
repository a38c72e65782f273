"""Planning an epoch: samples, a cost model, a layout and a config in, a ``Plan`` out
(``planner``); hybrid DP x CP plans (``hybrid``)."""
