"""Packing strategies by name (``registry``): sizes, costs, layout and budget in, a
``packing.StreamPlan`` out."""
