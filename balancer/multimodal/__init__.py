"""Multimodal samples: the table (``table``), encoder/LLM cost (``cost``), the planner with
its media phase (``plan``), the collator (``collate``) and synthetic workloads (``workloads``)."""
