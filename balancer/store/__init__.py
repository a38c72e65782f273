"""The plan store: plans written ahead of training (``precompute``) into a plan directory
and read back (``plan_store``)."""
